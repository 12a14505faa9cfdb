"""The commands that read and stop jobs: ``stoker jobs``, ``stoker status``, ``stoker stop``,
``stoker logs`` (registered on the ``stoker`` app by :mod:`stoker.cli`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

WORK_DIR_OPTION = typer.Option("--work-dir", "-w", help="The work folder (work_dir) of the jobs")


def _job_argument(job: str) -> str:
    """A job name; ``work_dir=X`` in its place (the form ``stoker run`` takes) exits 2 with the
    option these commands take."""
    if job.startswith("work_dir="):
        typer.echo(f"error: {job!r} is not a job name; this command takes the work folder as "
                   f"--work-dir {job.split('=', 1)[1]}", err=True)
        raise typer.Exit(2)
    return job


STORE_OPTION = typer.Option(
    "--checkpoint-dir", "-s", help="The job store (checkpoint_dir, e.g. s3://bucket/jobs): show "
    "its jobs too, whichever node runs or ran them (copied into the work folder's cache)")


def _sync_store(work_dir: Path, checkpoint_dir: str | None) -> dict:
    """Jobs of ``checkpoint_dir`` into the cache (see ``sync_from_store``); exit 2 naming the
    store when it cannot be read."""
    from stoker.config import ConfigError
    from stoker.jobs.status import sync_from_store

    if not checkpoint_dir:
        return {}
    try:
        return sync_from_store(work_dir, checkpoint_dir)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _job_folder(work_dir: Path, job: str | None) -> Path:
    """The job named ``job`` (a folder name or a unique prefix), or with None the newest job
    (the first row of ``stoker jobs``); exit 2 with one line when there is none."""
    from stoker.jobs.status import matching_jobs, newest_job

    if job is None:
        folder = newest_job(work_dir)
        if folder is None:
            typer.echo(f"error: no jobs in {(work_dir / 'jobs').resolve()}: name one, or run "
                       "`stoker run` first", err=True)
            raise typer.Exit(2)
        return folder
    matches = matching_jobs(work_dir, _job_argument(job))
    if len(matches) > 1:  # jobs of the same settings share their first 12 characters
        shown = ", ".join(m.name for m in matches[:5]) + (", ..." if len(matches) > 5 else "")
        typer.echo(f"error: job {job!r} matches {len(matches)} jobs in "
                   f"{(work_dir / 'jobs').resolve()}: {shown}; give more of the name", err=True)
        raise typer.Exit(2)
    if not matches:
        typer.echo(f"error: job {job!r}: no such job in {(work_dir / 'jobs').resolve()}; "
                   "`stoker jobs` lists them", err=True)
        raise typer.Exit(2)
    return matches[0]


def jobs(work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work"),
         checkpoint_dir: Annotated[str | None, STORE_OPTION] = None) -> None:
    """List the jobs of a work folder (and of a job store): state, step, attempts,
    preemptions, cost, MLflow run; the first line names the folder read."""
    from stoker.jobs.status import age, list_jobs

    rows = list_jobs(work_dir, leases=_sync_store(work_dir, checkpoint_dir))
    where = (work_dir / "jobs").resolve()
    if not rows:
        typer.echo(f"no jobs in {where}")
        return
    typer.echo(f"jobs in {where}")  # a relative --work-dir read from elsewhere names another
    # LAST HEARTBEAT: a done job's age read as a sign of life under "HEARTBEAT" (trial).
    header = ("JOB", "STATE", "STEP", "ATTEMPTS", "PREEMPTED", "COST", "MLFLOW RUN",
              "LAST HEARTBEAT")
    table = [header] + [(
        r.job, _state_cell(r), f"{r.step}/{r.total_steps}" if r.total_steps else "-",
        str(r.attempts),
        str(r.preemptions), "-" if r.cost_usd is None else f"${r.cost_usd:.4f}",
        r.mlflow_run_id or "-", age(r.heartbeat_age_s)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _state_cell(row) -> str:
    """A ``stoker jobs`` row's state; ``queued (Resources)`` while its attempt's Slurm job
    waits in the queue (``PENDING``, with Slurm's reason)."""
    from stoker.launch.slurm_queue import job_queue_state

    queue = job_queue_state(row.path) if row.state in ("training", "unfinished") else None
    if queue is None or not queue.pending:
        return row.state
    return f"queued ({queue.reason})" if queue.reason else "queued"


def status(job: Annotated[str | None, typer.Argument(
        help="Job folder name (or a unique prefix); default: the newest job")] = None,
           work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work"),
           checkpoint_dir: Annotated[str | None, STORE_OPTION] = None) -> None:
    """Show one job: state, progress and ETA, attempts, owner, MLflow run, where its files are."""
    from stoker.jobs import Job
    from stoker.jobs.attempts import AttemptLog, describe_interrupted
    from stoker.jobs.status import age
    from stoker.launch.retry import describe_recorded_exit
    from stoker.launch.slurm_queue import job_queue_state
    from stoker.runtime.progress import read_events
    from stoker.tracking.cost import attempt_steps_lost

    leases = _sync_store(work_dir, checkpoint_dir)
    folder = _job_folder(work_dir, job)
    s = Job(folder).status(bucket_lease=leases.get(folder.name))
    typer.echo(f"job        {s.job}")
    typer.echo(f"state      {s.state}" + (f" ({s.owner})" if s.owner else "")
               + (f" ({s.stopped_by})" if s.stopped_by else ""))
    if (queue := job_queue_state(folder)) is not None:  # queued on Slurm: nothing runs yet
        typer.echo(f"slurm      {queue.describe()}")
    if s.state == "training":  # its PIDs here (ps -eo args names the job on each of them)
        typer.echo(f"processes  {Job(folder).processes().describe()}")
    if s.progress is not None:
        typer.echo(f"progress   {s.progress.describe()}")
    # A done or stopped job's heartbeat is its last one, not a sign of life (new-user trial).
    typer.echo(f"heartbeat  {age(s.heartbeat_age_s)}" + (
        f" (its last: nothing trains {'an' if s.state[0] in 'aeiou' else 'a'} {s.state} job)"
        if s.state != "training" and s.heartbeat_age_s is not None else ""))
    typer.echo(f"mlflow run {s.mlflow_run_id or '-'}")
    typer.echo(f"steps lost {s.steps_lost}")
    for step in s.failed_saves:
        typer.echo(f"warning    checkpoint step {step} was not saved (the store stayed "
                   "unreachable through every upload try); nothing of it is trusted, a resume "
                   "uses the newest committed step")
    if s.cost_usd is not None:
        typer.echo(f"cost       ${s.cost_usd:.4f}")
    from stoker.jobs.budget import budget_line

    if (line := budget_line(folder)) is not None:  # train.max_cost_usd / max_duration
        typer.echo(f"budget     {line}")
    attempts = AttemptLog(folder)
    history = attempts.history()
    for a, lost in zip(history, attempt_steps_lost(history, read_events(folder)), strict=True):
        code = a.get("exit_code")  # none (-1) when the attempt's process was lost
        typer.echo(f"attempt {a.get('number')}: {a.get('outcome')}"
                   + (f" (stopped by {a['stopped_by']})" if a.get("stopped_by") else "")
                   + (f" (exit {describe_recorded_exit(a)})"
                      if isinstance(code, int) and code >= 0
                      else "") + " "
                   f"after {float(a.get('duration_s') or 0):.1f} s on "
                   f"{a.get('capacity_type', '-')} capacity"
                   + (f", {lost} step(s) lost" if lost else ""))
        if why := describe_interrupted(a):  # why it was closed, what its ranks did
            typer.echo(f"           {why}")
    for a in attempts.open_attempts():  # `jobs` counts these too
        typer.echo(_open_attempt_line(a, training=s.state == "training",
                                      queued=queue is not None and queue.pending,
                                      stopped=s.state == "stopped"))
    typer.echo(f"folder     {folder.resolve()}")
    if s.state == "unfinished" or (s.state == "stopped" and not s.stalled):
        # A deployment's run has no command to repeat (trial): its parameters do the same.
        typer.echo(f"resume it: run the same command again, or the same deployment with the "
                   f"same parameters (job_id={s.job} with the settings in "
                   f"{folder.resolve() / 'spec.yaml'})")


def _open_attempt_line(attempt: dict, training: bool, stopped: bool = False,
                       queued: bool = False) -> str:
    """``attempt 2: running for 41 s on spot capacity`` (``queued``: its Slurm job waits,
    ``attempt 2: queued on Slurm for 41 s ...``), or, for one a dead run left open,
    ``attempt 1: left open by a run that died (started 300 s ago); ...`` (``stopped``: the run
    was stopped, e.g. by a second Ctrl-C, and did not wait to close it)."""
    import time

    from stoker.runtime.records import real_number

    started = real_number(attempt.get("started"))
    age_s = time.time() - started if started is not None else None
    head = f"attempt {attempt.get('number')}:"
    if training:
        ran = f" for {age_s:.0f} s" if age_s is not None else ""
        doing = "queued on Slurm" if queued else "running"
        return f"{head} {doing}{ran} on {attempt.get('capacity_type', '-')} capacity"
    ago = f" (started {age_s:.0f} s ago)" if age_s is not None else ""
    how = "that was stopped before it could close it" if stopped else "that died"
    return (f"{head} left open by a run {how}{ago}; it is closed and billed when the job "
            "resumes")


def stop(job: Annotated[str, typer.Argument(help="Job folder name (or a unique prefix)")],
         reason: Annotated[str | None, typer.Option(
             help="Why, recorded with the request [default: `stoker stop by <user>`]")] = None,
         timeout_s: Annotated[float, typer.Option(
             "--timeout", min=0, help="Seconds to wait for the job to stop")] = 120.0,
         work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work")) -> None:
    """Stop a job this machine trains, on purpose: the ranks commit a stop checkpoint, the
    attempt is not retried, its flow run ends Cancelled and its ``stoker run`` exits 3; the
    same ``stoker run`` command resumes it.

    Exit codes: 0 stopped (or it was not training), 1 it did not stop within ``--timeout``
    (the request stays), 2 no such job, or another host trains it."""
    import getpass

    from stoker.jobs.status import job_summary
    from stoker.jobs.stop import StopFailed, TrainedElsewhere, stop_job
    from stoker.jobs.text import one_line

    folder = _job_folder(work_dir, job)
    if reason is None:
        try:
            reason = f"stoker stop by {getpass.getuser()}"
        except (KeyError, OSError):  # no user name in a bare container
            reason = "stoker stop"
    try:
        state = stop_job(folder, reason, timeout_s=timeout_s)
    except StopFailed as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2 if isinstance(e, TrainedElsewhere) else 1) from None
    summary = job_summary(folder)
    if state is None:
        typer.echo(f"job {folder.name} is not training ({summary.state}); nothing to stop")
        return
    progress = f"; {summary.progress.describe()}" if summary.progress else ""
    typer.echo(f"job {folder.name} {summary.state}: stopped by user: {one_line(reason)}{progress}")


def logs(job: Annotated[str | None, typer.Argument(
        help="Job folder name (or a unique prefix); default: the newest job")] = None,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines "
                                              "while the job trains")] = False,
         work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work")) -> None:
    """Print what the job's attempts printed (torchrun and every rank), from its train.log."""
    import time

    from stoker.jobs.status import JOB_LOG, job_summary

    folder = _job_folder(work_dir, job)
    path = folder / JOB_LOG
    offset = 0
    while True:
        if path.is_file():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # whole lines only: a line being written waits
            if end:
                sys.stdout.write(chunk[:end].decode(errors="replace"))
                sys.stdout.flush()
                offset += end
        if not follow or job_summary(folder).state != "training":
            break
        time.sleep(1.0)
    if not path.is_file():
        typer.echo(f"job {folder.name}: no output yet ({path})", err=True)


