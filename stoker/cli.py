"""The ``stoker`` command line.

``stoker run [--config FILE] [field=value ...]`` runs the pipeline flow with the embedded defaults:
Prefect on a long-lived local server under ``<work_dir>/.prefect`` that the first run starts and
later runs reuse (unless PREFECT_API_URL is set; ``stoker server stop`` ends it), MLflow in
``<work_dir>/mlflow.db``, DVC with a local remote.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from stoker import stopping
from stoker.config import ConfigError, PipelineConfig, load_pipeline_config
from stoker.predict_cli import predict
from stoker.server_cli import prefect_api, server_app

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode="markdown",
                  help="Stoker: resumable GPU training pipelines on Prefect, DVC, PyTorch, MLflow.")


TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1",
                 # and no progress bars of MLflow's artifact downloads in a terminal log
                 "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (relative to the current directory
    when written with three slashes and a relative path), else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///"))


def quiet_telemetry(work_dir: Path) -> None:
    """Telemetry off and Prefect's home inside the work directory, unless the user set them."""
    os.environ.setdefault("PREFECT_HOME", str((work_dir / ".prefect").resolve()))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    # The local Prefect server migrates its database on first start: slow on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    for name, value in TELEMETRY_OFF.items():
        os.environ.setdefault(name, value)


WORK_DIR_OPTION = typer.Option("--work-dir", "-w", help="The work folder (work_dir) of the jobs")
RUN_WORK_DIR_OPTION = typer.Option(
    "--work-dir", "-w", help="The work folder: the same as the override work_dir=PATH")


def _config(config_file: Path | None, overrides: list[str] | None) -> PipelineConfig:
    try:
        return load_pipeline_config(config_file, overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _with_work_dir(overrides: list[str] | None, work_dir: Path | None) -> list[str]:
    """``--work-dir X`` of ``run`` / ``show-config`` as the override ``work_dir=X`` (the jobs
    commands take ``--work-dir``; both forms work everywhere a config is read). Exit 2 when an
    override names another folder."""
    overrides = list(overrides or [])
    if work_dir is None:
        return overrides
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("work_dir=")]
    if any(Path(g) != work_dir for g in given):
        typer.echo(f"error: --work-dir {work_dir} and work_dir={given[-1]} name different "
                   "folders; give one", err=True)
        raise typer.Exit(2)
    return [*overrides, f"work_dir={work_dir}"]


def _job_argument(job: str) -> str:
    """A job name; ``work_dir=X`` in its place (the form ``stoker run`` takes) exits 2 with the
    option these commands take."""
    if job.startswith("work_dir="):
        typer.echo(f"error: {job!r} is not a job name; this command takes the work folder as "
                   f"--work-dir {job.split('=', 1)[1]}", err=True)
        raise typer.Exit(2)
    return job


def _check_before_pull(config: PipelineConfig) -> None:
    """World size and a dead tracking server are named here, not after the pull inside a rank."""
    from stoker.data.pull import DatasetError
    from stoker.launch.factory import check_before_pull

    try:
        check_before_pull(config)
    except (ConfigError, DatasetError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. train.epochs=3 data.rev=v1")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with PipelineConfig fields")] = None,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Print tracebacks in the terminal (the Prefect task log always has "
        "them)")] = False,
    resume_stalled: Annotated[bool, typer.Option(
        "--resume-stalled", help="Resume a job the cost guard stopped for a stall (same as "
        "retry.resume_stalled=true)")] = False,
    work_dir: Annotated[Path | None, RUN_WORK_DIR_OPTION] = None,
) -> None:
    """Run the main job: pull the dataset, train with torchrun, register the model in MLflow.

    Exit codes: 0 done, 1 failed, 2 bad input, 3 stopped on request, 4 the job is owned by
    another live run, 130/143 Ctrl-C/SIGTERM (docs: reference/exit-codes.md)."""
    overrides = _with_work_dir(overrides, work_dir)
    if resume_stalled:
        overrides = [*overrides, "retry.resume_stalled=true"]
    config = _config(config_file, overrides)
    from stoker.jobs.job import check_job_early, new_job_notice
    from stoker.jobs.lease import JobBusy
    from stoker.jobs.stop_request import TrainingStopped

    try:
        notice = new_job_notice(config)  # a shortened job_id: refused, naming the job
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        done = check_job_early(config)  # a busy, done or stalled job_id: before the flow starts
    except JobBusy as e:  # one line, no traceback: another run owns the job
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(EXIT_BUSY) from None
    except TrainingStopped as e:  # the guard stopped it for a stall: not resumed by default
        typer.echo(f"stoker run: {e}", err=True)
        raise typer.Exit(stopping.EXIT_STOPPED) from None
    if done is not None:
        typer.echo(f"job {config.job_id} is already done; nothing to do", err=True)
        typer.echo(json.dumps(done, indent=2, default=str))
        return
    _check_before_pull(config)
    if notice:  # said once the input passed: bad input is one line
        typer.echo(notice, err=True)
    quiet_telemetry(config.work_dir)
    from stoker.stdio import guard_stdio

    # A reader that goes away (a killed worker, a closed pipe) fails nothing: the output,
    # Prefect's log lines and the final summary included, goes on in the work folder's log.
    guard_stdio(Path(config.work_dir) / "logs" / "output.log")
    stopping.install()
    _prestart_launcher(config)
    code = 0
    try:
        with prefect_api():
            from flows.pipeline import pipeline

            if not debug:
                quiet_console_tracebacks()

            from prefect.exceptions import CancelledRun

            try:
                summary = pipeline(config)
                typer.echo(json.dumps(summary, indent=2, default=str))
            except CancelledRun:  # the flow recorded a stop signal as its Cancelled end
                from tasks.stopping import prefect_cancel

                if stopping.stop_reason() is not None:
                    _say_stopped()
                    code = stopping.stop_exit_code()
                elif (cancel := prefect_cancel()) is not None:  # from the Prefect UI or API
                    if cancel.get("summary") is not None:
                        typer.echo(json.dumps(cancel["summary"], indent=2, default=str))
                    typer.echo(f"stoker run: {cancel['message']}", err=True)
                    code = stopping.EXIT_STOPPED if cancel["stopped"] else 0
                else:
                    raise
            except TrainingStopped as e:  # the cost guard or a user stopped the job
                typer.echo(f"stoker run: {e}", err=True)
                code = stopping.EXIT_STOPPED
            except JobBusy as e:  # found after the pull (no job_id): still one line
                typer.echo(f"error: {e}", err=True)
                code = EXIT_BUSY
    except KeyboardInterrupt:
        _say_stopped()
        code = stopping.stop_exit_code()
    except Exception as e:
        code = _report_failure(e, debug)
    from stoker.launch.local import discard_standby

    discard_standby()  # not taken: nothing trained (a done job, a refused dataset, a failure)
    # Everything is recorded and the training tree is gone: skip the interpreter's finalizers
    # (Prefect's exit hooks, torch), which held the exit back for seconds.
    stopping.exit_now(code)


def _prestart_launcher(config: PipelineConfig) -> None:
    """Start the first attempt's launcher now, so that its imports (torch, torchrun, the
    runtime: 3-4 s on 2 cores) run on another core while Prefect starts the flow and the
    dataset is pulled (``stoker.launch.local.Standby``). Only for the local launcher, and
    only where the world size is known without importing torch (no GPU device, or
    ``train.nproc_per_node`` set)."""
    if config.launcher.kind != "local":
        return
    from stoker.launch.local import prestart
    from stoker.launch.supervisor import nproc
    from stoker.runtime.launch import gpu_device_present

    if config.train.nproc_per_node != "auto" or not gpu_device_present():
        prestart(nproc(config))


def _say_stopped() -> None:
    typer.echo(stopping.stopped_line(), err=True)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that name bad input (a field, the data, an image, the host): one line, exit 2."""
    from stoker.data.pull import DatasetError
    from stoker.images.build import ImageError
    from stoker.images.preflight import PreflightError
    from stoker.launch.docker import DockerLaunchError
    from stoker.runtime import CheckpointError
    from stoker.tracking.registry import LineageError

    return (ConfigError, DatasetError, LineageError, ImageError, PreflightError,
            DockerLaunchError, CheckpointError)


def _report_failure(error: Exception, debug: bool) -> int:
    """One line for a user error (exit 2) or a failed job (exit 1, with where to look); the
    traceback only for a bug, or with ``--debug``."""
    from stoker.launch.supervisor import TrainingFailed
    from stoker.local_server import ServerError

    if debug:
        traceback.print_exc()
    if isinstance(error, ServerError):
        typer.echo(f"error: {error}", err=True)
        return 1
    if isinstance(error, _user_errors()):
        typer.echo(f"error: {error}", err=True)
        return 2
    if isinstance(error, TrainingFailed):
        job = str(error).split()[1] if str(error).startswith("job ") else ""
        typer.echo(f"error: {error}" + (f" (its output: stoker logs {job})" if job else ""),
                   err=True)
        return 1
    if not debug:
        traceback.print_exc()
    return 1


class _TracebackFree(logging.Formatter):
    """Formats a record as ``inner`` does, without its traceback (other handlers keep it)."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


class _UserErrorOnce(logging.Filter):
    """On the terminal, a user error (``_user_errors``) or a job's failure (``TrainingFailed``)
    raised in a flow is said once, by the command's last line (``error: ...``): Prefect's lines
    that repeat it (the task's exception and end, the flow's exception) are dropped, the flow's
    end reads ``Finished in state Failed (DatasetError: see the error line)``, and the lines of
    Stoker's own state hook go. The Prefect UI's logs (the API handler) keep every line."""

    HOOK = "cancel_stopped_flow_run"

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        message = record.getMessage()
        if f"hook '{self.HOOK}'" in message.lower():
            return False
        named = next((n for n in self.names if f"{n}(" in message or f"{n}: " in message), None)
        if named is None:
            return True
        if message.startswith("Finished in state Failed"):
            if record.name.startswith("prefect.task_runs"):
                return False
            record.msg, record.args = f"Finished in state Failed ({named}: see the error line)", ()
            return True
        return record.levelno < logging.ERROR  # the exception's own lines


def _with_subclasses(classes: tuple[type, ...]) -> list[str]:
    """The names of ``classes`` and of all their subclasses (Prefect's lines name the raised
    class: ``RegistryUnreachableError(...)``, an ``ImageError``), longest first."""
    names: set[str] = set()
    todo = list(classes)
    while todo:
        cls = todo.pop()
        if cls.__name__ not in names:
            names.add(cls.__name__)
            todo.extend(cls.__subclasses__())
    return sorted(names, key=len, reverse=True)


def quiet_console_tracebacks() -> None:
    """Prefect's terminal lines keep their message but not the traceback: a failed task repeats
    it several times. A user error, or a job that did not complete (``TrainingFailed``), is said
    once (:class:`_UserErrorOnce`). The Prefect UI's task log (the API handler) keeps every
    traceback and line."""
    from stoker.launch.supervisor import TrainingFailed

    names = tuple(_with_subclasses((*_user_errors(), TrainingFailed)))
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) \
                    and not isinstance(handler.formatter, _TracebackFree):
                handler.setFormatter(_TracebackFree(handler.formatter or logging.Formatter()))
                handler.addFilter(_UserErrorOnce(names))


EXIT_BUSY = 4  # `stoker run`: the job is owned by another live run (nothing was changed)


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


@app.command()
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
    header = ("JOB", "STATE", "STEP", "ATTEMPTS", "PREEMPTED", "COST", "MLFLOW RUN",
              "HEARTBEAT")
    table = [header] + [(
        r.job, r.state, f"{r.step}/{r.total_steps}" if r.total_steps else "-", str(r.attempts),
        str(r.preemptions), "-" if r.cost_usd is None else f"${r.cost_usd:.4f}",
        r.mlflow_run_id or "-", age(r.heartbeat_age_s)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@app.command()
def status(job: Annotated[str | None, typer.Argument(
        help="Job folder name (or a unique prefix); default: the newest job")] = None,
           work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work"),
           checkpoint_dir: Annotated[str | None, STORE_OPTION] = None) -> None:
    """Show one job: state, progress and ETA, attempts, owner, MLflow run, where its files are."""
    from stoker.jobs.attempts import AttemptLog, describe_interrupted
    from stoker.launch.retry import describe_exit
    from stoker.jobs.status import age, job_summary

    leases = _sync_store(work_dir, checkpoint_dir)
    folder = _job_folder(work_dir, job)
    s = job_summary(folder, bucket_lease=leases.get(folder.name))
    typer.echo(f"job        {s.job}")
    typer.echo(f"state      {s.state}" + (f" ({s.owner})" if s.owner else "")
               + (f" ({s.stopped_by})" if s.stopped_by else ""))
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
    attempts = AttemptLog(folder)
    for a in attempts.history():
        code = a.get("exit_code")  # none (-1) when the attempt's process was lost
        typer.echo(f"attempt {a.get('number')}: {a.get('outcome')}"
                   + (f" (stopped by {a['stopped_by']})" if a.get("stopped_by") else "")
                   + (f" (exit {describe_exit(code, a.get('ended_by_rank'))})"
                      if isinstance(code, int) and code >= 0
                      else "") + " "
                   f"after {float(a.get('duration_s') or 0):.1f} s on "
                   f"{a.get('capacity_type', '-')} capacity"
                   + (f", {a['steps_lost']} step(s) lost" if a.get("steps_lost") else ""))
        if why := describe_interrupted(a):  # why it was closed, what its ranks did
            typer.echo(f"           {why}")
    for a in attempts.open_attempts():  # `jobs` counts these too
        typer.echo(_open_attempt_line(a, training=s.state == "training",
                                      stopped=s.state == "stopped"))
    typer.echo(f"folder     {folder.resolve()}")
    if s.state == "unfinished" or (s.state == "stopped" and not s.stalled):
        # A deployment's run has no command to repeat (trial): its parameters do the same.
        typer.echo(f"resume it: run the same command again, or the same deployment with the "
                   f"same parameters (job_id={s.job} with the settings in "
                   f"{folder.resolve() / 'spec.yaml'})")


def _open_attempt_line(attempt: dict, training: bool, stopped: bool = False) -> str:
    """``attempt 2: running for 41 s on spot capacity``, or, for one a dead run left open,
    ``attempt 1: left open by a run that died (started 300 s ago); ...`` (``stopped``: the run
    was stopped, e.g. by a second Ctrl-C, and did not wait to close it)."""
    import time

    from stoker.runtime.records import real_number

    started = real_number(attempt.get("started"))
    age_s = time.time() - started if started is not None else None
    head = f"attempt {attempt.get('number')}:"
    if training:
        ran = f" for {age_s:.0f} s" if age_s is not None else ""
        return f"{head} running{ran} on {attempt.get('capacity_type', '-')} capacity"
    ago = f" (started {age_s:.0f} s ago)" if age_s is not None else ""
    how = "that was stopped before it could close it" if stopped else "that died"
    return (f"{head} left open by a run {how}{ago}; it is closed and billed when the job "
            "resumes")


@app.command()
def stop(job: Annotated[str, typer.Argument(help="Job folder name (or a unique prefix)")],
         reason: Annotated[str | None, typer.Option(
             help="Why, recorded with the request [default: stoker stop by <user>]")] = None,
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
    from stoker.jobs.stop_request import StopFailed, TrainedElsewhere, one_line, stop_job

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


@app.command()
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


@app.command("cost-guard")
def cost_guard(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. dry_run=false policy.window_s=120")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with CostGuardConfig fields")] = None,
    plain: Annotated[bool, typer.Option(
        "--plain", help="Sweep without Prefect: print the Markdown report; no flow run, "
        "artifact or events, and local jobs' flow runs are not cancelled")] = False,
) -> None:
    """Run one cost-guard sweep: find idle GPUs and stalled jobs (dry run unless dry_run=false)."""
    from stoker.config import load_config
    from stoker.costguard.config import CostGuardConfig

    try:
        config = load_config(CostGuardConfig, config_file, overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    quiet_telemetry(config.work_dir)
    if plain:
        from stoker.costguard.report import render_markdown
        from stoker.costguard.sweep import sweep_host

        typer.echo(render_markdown(sweep_host(config)), nl=False)
        return
    if not config.prefect.enabled:  # no flow run to record nor to cancel: no server either
        from stoker.costguard.summary import summary
        from stoker.costguard.sweep import sweep_host

        typer.echo(json.dumps(summary(sweep_host(config)), indent=2, default=str))
        return
    with prefect_api():  # the local server (or PREFECT_API_URL), not a temporary one
        from flows.cost_guard import cost_guard as cost_guard_flow

        typer.echo(json.dumps(cost_guard_flow(config), indent=2, default=str))
    stopping.exit_now(0)  # recorded and drained: Prefect's exit hooks would add seconds


@app.command("build-image")
def build_image(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="ImageRequest fields, e.g. matrix_entry=cu128-py312 registry=127.0.0.1:5000")
    ] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with ImageRequest fields")] = None,
    work_dir: Annotated[Path, WORK_DIR_OPTION] = Path("work"),
    debug: Annotated[bool, typer.Option("--debug", help="Tracebacks on the terminal")] = False,
) -> None:
    """Build the training image of a matrix entry and push it, unless the registry already holds
    its content-hash tag; prints image, digest and whether it was built (the ``build-image``
    flow, on the local Prefect server of ``--work-dir``).

    Exit codes: 0 done, 1 failed, 2 bad input (a field, Docker, the base image or the registry,
    named in one line), 130 Ctrl-C."""
    from stoker.config import load_config
    from stoker.images.spec import ImageRequest

    try:
        request = load_config(ImageRequest, config_file, overrides)
        request.spec()  # an unknown matrix entry: named before Prefect starts
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    quiet_telemetry(work_dir)
    code = 0
    try:
        with prefect_api():  # the local server (or PREFECT_API_URL), not a temporary one
            from flows.build_image import build_image_flow

            if not debug:
                quiet_console_tracebacks()
            typer.echo(json.dumps(build_image_flow(request), indent=2, default=str))
    except KeyboardInterrupt:
        typer.echo("stoker build-image: interrupted", err=True)
        code = stopping.EXIT_SIGINT
    except Exception as e:
        code = _report_failure(e, debug)
    stopping.exit_now(code)


@app.command("show-config")
def show_config(
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides")] = None,
    config_file: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    work_dir: Annotated[Path | None, RUN_WORK_DIR_OPTION] = None,
) -> None:
    """Print the resolved, validated configuration as YAML (usable as a ``--config`` file); a
    relative ``work_dir`` is shown with the folder it names from here as a comment, and
    ``tracking.tracking_uri`` as the URI a run uses (``PipelineConfig.tracking_uri()``: an
    empty one is the default store in the work folder, said in a comment)."""
    import yaml

    config = _config(config_file, _with_work_dir(overrides, work_dir))
    values = config.model_dump(mode="json")
    values["tracking"]["tracking_uri"] = config.tracking_uri()
    text = yaml.safe_dump(values, sort_keys=False)
    if not config.tracking.tracking_uri:  # said where the field is
        text = text.replace("\ntracking:\n", "\n# tracking.tracking_uri is not set: a run uses "
                            "the default shown, mlflow.db in work_dir\ntracking:\n", 1)
    work_dir = Path(config.work_dir)
    if not work_dir.is_absolute():
        text = f"# work_dir {work_dir} is {work_dir.resolve()} from here\n{text}"
    typer.echo(text)


app.command()(predict)  # `stoker predict` (stoker.predict_cli)
app.add_typer(server_app, name="server")  # `stoker server start|status|stop`

if __name__ == "__main__":
    sys.exit(app())
