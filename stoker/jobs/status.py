"""What a job is doing now, from its progress events: state, step, throughput and ETA; and the
jobs of a work folder as ``stoker jobs`` / ``stoker status`` show them.

Read by the ``train`` task's progress watcher (the Prefect progress artifact and log line) and
by the ``stoker`` CLI. Plain functions over the job folder's records (every reader tolerates a
torn last line); times are Unix seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from stoker.runtime.records import integer, real_number

MIN_STEPS_FOR_ETA = 5     # an ETA from fewer steps of an attempt is mostly start-up noise
WINDOW_STEPS = 20         # the moving average of step time covers this many recent steps


@dataclass(frozen=True)
class JobProgress:
    """One view of a job. ``state``: ``starting``, ``training``, ``restarting``, ``completed``,
    ``ended`` (the last attempt ended otherwise) or ``idle`` (no live run trains the job: what
    ``stoker status`` shows for an unfinished one); ``eta_s`` is None until more
    than ``MIN_STEPS_FOR_ETA`` steps of the current attempt were seen; the throughput and the ETA
    leave out the attempt's first ``MIN_STEPS_FOR_ETA - 1`` (its warm-up)."""

    state: str
    attempt: int
    step: int
    total_steps: int
    samples_per_s: float | None = None
    eta_s: float | None = None
    resume_step: int | None = None
    outcome: str | None = None
    start_step: int | None = None  # the step the current attempt started (resumed) at

    @property
    def outcome_name(self) -> str | None:
        """The runtime's word for how the attempt ended (its ``end`` event: ``failed``,
        ``storage``, ...) as the attempt's outcome reads everywhere else (``user_error``,
        ``storage_error``, ...: ``stoker.launch.retry.Outcome``)."""
        from stoker.jobs.attempts import END_OUTCOME

        return END_OUTCOME.get(self.outcome, self.outcome) if self.outcome else None

    @property
    def percent(self) -> float:
        """Share of steps done, 0-100, one decimal."""
        return round(100 * self.step / max(self.total_steps, 1), 1)

    def describe(self) -> str:
        """One line for a person, e.g. ``step 60/132 (attempt 1), 1207 samples/s, ETA 37 s``."""
        where = f"step {self.step}/{self.total_steps} (attempt {self.attempt})"
        if self.state == "starting":
            if self.start_step is None or self.step == self.start_step:
                return f"attempt {self.attempt} starting at step {self.step}/{self.total_steps}"
            return (f"step {self.step}/{self.total_steps} (attempt {self.attempt}, from step "
                    f"{self.start_step})")
        if self.state == "restarting":
            return (f"restarting (attempt {self.attempt + 1}, resuming at step "
                    f"{self.resume_step or 0}/{self.total_steps})")
        if self.state in ("completed", "ended"):
            return f"{where}: {self.outcome_name}"
        if self.state == "idle":
            return (f"not running: reached step {self.step}/{self.total_steps}, resumes at step "
                    f"{self.resume_step or 0} (run the same command)")
        line = where
        if self.samples_per_s:
            line += f", {self.samples_per_s:.0f} samples/s"
        if self.eta_s is not None:
            line += f", ETA {_duration(self.eta_s)}"
        return line


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def attempt_at(records: list[dict], time_s: object) -> int | None:
    """The number of the attempt that was running at ``time_s`` (Unix seconds): the newest of
    the job's attempt records (``attempts.jsonl``, :meth:`AttemptLog.records`) that started at
    or before it; None when none did or a value is not a number (untrusted records)."""
    time_s = real_number(time_s)
    if time_s is None:
        return None
    numbers = [r["number"] for r in records if integer(r.get("number")) is not None
               and (started := real_number(r.get("started"))) is not None and started <= time_s]
    return max(numbers, default=None)


def job_progress(events: list[dict], records: list[dict] | None = None) -> JobProgress | None:
    """The job's current view from its events (oldest first); None before the first start.

    ``records``: the job's attempt records (:meth:`AttemptLog.records`), which number the
    attempts (an attempt that died before its ranks' ``start`` event has a record but no
    event); without them, or when no record covers the last start, the ``start`` events are
    counted."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not starts:
        return None
    start = events[starts[-1]]
    attempt = attempt_at(records or [], start.get("time")) or len(starts)
    total = int(start.get("total_steps") or 1)
    current = events[starts[-1] + 1:]
    steps = [e for e in current if e.get("event") == "step"]
    step = int(steps[-1]["step"]) if steps else int(start.get("step") or 0)
    ends = [e for e in current if e.get("event") == "end"]
    if ends:
        outcome = str(ends[-1].get("outcome") or "ended")
        if outcome == "completed":
            return JobProgress("completed", attempt, total, total, outcome=outcome)
        checkpoints = [int(e["step"]) for e in events if e.get("event") == "checkpoint"]
        resume = max(checkpoints) if checkpoints else 0
        # Preempted and infrastructure failures resume from the last checkpoint.
        state = "restarting" if outcome in ("preempted", "infrastructure") else "ended"
        return JobProgress(state, attempt, int(ends[-1].get("step") or step), total,
                           resume_step=resume, outcome=outcome)
    if len(steps) <= MIN_STEPS_FOR_ETA:
        return JobProgress("starting", attempt, step, total,
                           start_step=int(start.get("step") or 0))
    # An attempt's first steps (data workers starting, the first all-reduce) ran 2-4x slower
    # than the rest: a window that held them showed an ETA of 5 min for 75 s (trial). The
    # window starts at the MIN_STEPS_FOR_ETA-th step event.
    window = steps[MIN_STEPS_FOR_ETA - 1:][-WINDOW_STEPS:]
    done = int(window[-1]["step"]) - int(window[0]["step"])
    elapsed = float(window[-1]["time"]) - float(window[0]["time"])
    eta = (total - step) * elapsed / done if done > 0 and elapsed >= 0 else None
    return JobProgress("training", attempt, step, total, samples_per_s=window_rate(window),
                       eta_s=eta if eta is None or math.isfinite(eta) else None)


def window_rate(window: list[dict]) -> float | None:
    """The throughput of a window of ``step`` events, samples/s: the harmonic mean of their
    ``samples_per_s`` (each one step's own, global batch / step time), which is all their samples
    over all their step time (the batch is the same every step); None without a usable value.

    One step's figure swung by 2x between status lines (2285, 4221, 3512, 2754 samples/s at
    15 ms steps); 20 steps' is steady. Values that are not positive finite numbers (a record
    is untrusted) are left out."""
    rates = [rate for e in window
             if (rate := real_number(e.get("samples_per_s"))) is not None and rate > 0]
    return statistics.harmonic_mean(rates) if rates else None


JOB_LOG = "train.log"  # every line the attempts printed (torchrun, ranks), appended, each timed


@dataclass(frozen=True)
class JobSummary:
    """One row of ``stoker jobs``.

    ``state``: ``done``, ``training`` (a live run holds the lease), ``stopped`` (a stop was
    requested: the cost guard, ``stoker stop``, or its run was stopped by Ctrl-C, SIGTERM or a
    Prefect cancel), or ``unfinished`` (no live owner, and its last run died or failed). The
    same command resumes a stopped or unfinished job (a stall the guard stopped needs
    ``--resume-stalled``). ``heartbeat_age_s``
    is the seconds since rank 0's last heartbeat; ``cost_usd``: a done job's cost, or what a
    stopped or unfinished one's closed attempts were billed (``stoker.jobs.billed``);
    ``steps_lost``: :func:`stoker.tracking.cost.steps_lost` (the figure the job summary and
    MLflow show).
    ``stopped_by`` says who stopped a ``stopped`` job (``stopped by cost-guard: stalled ...``,
    ``stopped by Ctrl-C``; None otherwise); ``stalled``: the guard stopped it for a stall."""

    job: str
    path: Path
    state: str
    step: int
    total_steps: int
    attempts: int
    preemptions: int
    cost_usd: float | None
    mlflow_run_id: str | None
    heartbeat_age_s: float | None
    progress: JobProgress | None
    owner: str | None
    steps_lost: int = 0
    failed_saves: tuple[int, ...] = ()  # steps whose save was given up (store unreachable)
    stopped_by: str | None = None
    stalled: bool = False


def checkpoint_location(job_dir: Path) -> str:
    """Where the job's checkpoints are: its run spec's ``checkpoint_dir`` (a bucket's
    ``<store>/<job>/checkpoints``), else ``<job_dir>/checkpoints`` (no spec, or one that
    cannot be read)."""
    import yaml

    try:
        spec = yaml.safe_load((Path(job_dir) / "spec.yaml").read_text())
        location = spec.get("checkpoint_dir") if isinstance(spec, dict) else None
    except (OSError, yaml.YAMLError):
        location = None
    return location if isinstance(location, str) and location else str(
        Path(job_dir) / "checkpoints")


_ENDED_AS = {"stopped": "was stopped", "interrupted": "was interrupted",
             "preempted": "was preempted", "infrastructure_failure": "lost a rank or its node",
             "user_error": "failed", "storage_error": "could not write a checkpoint"}


def resuming_line(job_dir: Path, checkpoint_location: str) -> str | None:
    """For a run that takes up a job earlier runs left unfinished: one line saying so, from
    where, and how its last attempt ended, e.g. ``job fruit: resuming a stopped job as attempt
    3 from its checkpoint of step 40/120 (attempt 2 was stopped at step 52 by budget:
    max_cost_usd $0.15 reached)``. None for a job with no closed attempt (a new one). The
    records are read as untrusted data: a value of the wrong type is left out.

    Args:
        job_dir: the job folder (``attempts.jsonl``, ``progress.jsonl``).
        checkpoint_location: the job's checkpoints, folder or fsspec URL (the step to resume
            from is the newest committed one there).
    """
    from stoker.jobs.attempts import AttemptLog, committed_step, reached_step
    from stoker.runtime.records import read_jsonl

    log = AttemptLog(job_dir)
    history = log.history()
    if not history:
        return None
    last = history[-1]
    outcome = last.get("outcome") if isinstance(last.get("outcome"), str) else None
    events = read_jsonl(Path(job_dir) / "progress.jsonl")
    starts = [e for e in events if e.get("event") == "start"]
    total = integer(starts[-1].get("total_steps")) if starts else None
    of_total = f"/{total}" if total else ""
    resume = committed_step(checkpoint_location)
    since = real_number(last.get("started"))
    reached = integer(last.get("reached_step"))
    if reached is None and since is not None:
        reached = reached_step(Path(job_dir), since, events)
    by = last.get("stopped_by") if isinstance(last.get("stopped_by"), str) else None
    # The words `stoker jobs` uses for it: stopped when someone stopped it (a stop request, a
    # signal), unfinished when its run died (kill -9: trial, "a stopped job" after a kill)
    what = ("a stopped job" if outcome == "stopped" or (outcome == "interrupted" and by)
            else "an unfinished job" if outcome == "interrupted" else "the job")
    where = (f"from its checkpoint of step {resume}{of_total}" if resume
             else "from step 0 (no checkpoint was committed)")
    ended = _ENDED_AS.get(outcome or "", f"ended {outcome or 'without a recorded outcome'}")
    if outcome == "interrupted" and not by and last.get("left_open"):
        ended = "ended when its run died"
    if reached is not None:
        ended += f" at step {reached}{of_total}"
    if by:
        ended += f" by {' '.join(by.split())[:200]}"
    return (f"job {Path(job_dir).name}: resuming {what} as attempt {log.next_number()} "
            f"{where} (attempt {integer(last.get('number')) or '?'} {ended})")


def job_summary(job_dir: Path, now: float | None = None,
                bucket_lease: dict | None = None) -> JobSummary:
    """Summarise one job folder from its records (never raises on a torn or missing record);
    ``bucket_lease``: the job's lease object in the bucket, when it lives in one."""
    from stoker.jobs.attempts import AttemptLog, closed, committed_step, is_closed
    from stoker.jobs.billed import billed_cost
    from stoker.jobs.job import done_summary
    from stoker.jobs.lease import holder_alive
    from stoker.jobs.stop_request import read_stop_request
    from stoker.runtime.preemption import stop_signal_reason
    from stoker.runtime.progress import read_events
    from stoker.runtime.records import read_json, read_text
    from stoker.tracking.cost import steps_lost

    now = time.time() if now is None else now
    quiet = lambda *_: None  # noqa: E731 - a listing must not print a warning per torn line
    done = done_summary(job_dir)
    lease = read_json(job_dir / "lease.json", default=None, warn=quiet)
    live = isinstance(lease, dict) and holder_alive(lease, now)
    if not live and bucket_lease is not None and holder_alive(bucket_lease, now):
        lease, live = bucket_lease, True  # trained on another node
    events = [e for e in read_events(job_dir)
              if real_number(e.get("time")) is not None and integer(e.get("step")) is not None]
    failed = tuple(e["step"] for e in events if e.get("event") == "checkpoint_failed")
    records = AttemptLog(job_dir).records()
    progress = job_progress(events, records)
    history = closed(records)
    beat = read_json(job_dir / "heartbeat.json", default=None, warn=quiet)
    beat_time = real_number(beat.get("time")) if isinstance(beat, dict) else None
    request = read_stop_request(job_dir)
    stopped_by = None
    if request is not None:
        stopped_by = request.describe()
    elif records and is_closed(records[-1]) and records[-1].get("stopped_by"):
        # Ctrl-C, SIGTERM, a Prefect cancel
        stopped_by = f"stopped by {records[-1]['stopped_by']}"
    elif records and not is_closed(records[-1]) and not live and (
            started := real_number(records[-1].get("started"))) is not None and (
            signal_reason := stop_signal_reason(job_dir, started)):
        # Its run died while stopping (a second Ctrl-C): stopped, not lost
        stopped_by = f"stopped by {signal_reason}"
    if done is not None:
        state = "done"
    elif live:
        state = "training"
    elif stopped_by is not None:
        state = "stopped"
    else:
        state = "unfinished"
    idle = state in ("stopped", "unfinished") and progress is not None and progress.state in (
        "starting", "training", "restarting")  # nothing trains it: no ETA, no "restarting"
    if idle or (progress is not None and progress.state == "restarting"):
        # The markers decide where a resume starts: a checkpoint event comes before its commit
        # (a rank killed in the save: "resumes at step 120", the resume took 115, trial), and a
        # bucket's COMMITTED is written through, its progress events only every few seconds.
        marker = None
        with contextlib.suppress(Exception):
            marker = committed_step(checkpoint_location(job_dir), unlisted=None)
        if marker is None:  # a store that does not answer: the events
            marker = max((e["step"] for e in events if e.get("event") == "checkpoint"),
                         default=0)
        progress = dataclasses.replace(progress, resume_step=marker)
        if idle:
            progress = dataclasses.replace(progress, state="idle", eta_s=None,
                                           samples_per_s=None)
    cost = (done or {}).get("cost", {}).get("cost_usd") if isinstance(done, dict) else None
    if done is None and state in ("stopped", "unfinished"):  # its closed attempts' bill
        cost = billed_cost(job_dir)
    owner = None
    if live:
        owner = f"host {lease.get('host')} pid {lease.get('pid')}"
    return JobSummary(
        job=job_dir.name, path=job_dir, state=state,
        step=progress.step if progress else 0,
        total_steps=progress.total_steps if progress else 0,
        attempts=len(records),
        preemptions=sum(1 for a in history if a.get("outcome") == "preempted"),
        cost_usd=real_number(cost),
        mlflow_run_id=read_text(job_dir / "mlflow_run_id", warn=quiet),
        heartbeat_age_s=max(0.0, now - beat_time) if beat_time is not None else None,
        progress=progress, owner=owner,
        # An attempt that no live run trains and no one closed (its run died, or a second
        # Ctrl-C stopped it at once) has lost its steps already (trial: `steps lost 0` beside
        # `reached step 705/1449, resumes at step 700`).
        steps_lost=steps_lost(history, events) + (
            AttemptLog(job_dir).steps_lost_if_closed(records[-1]) if records and not live else 0),
        failed_saves=failed, stopped_by=stopped_by if state == "stopped" else None,
        stalled=state == "stopped" and request is not None and request.stalled)


def sync_from_store(work_dir: Path, checkpoint_dir: str) -> dict[str, dict | None]:
    """Fill ``<work_dir>/jobs`` (the cache) with every job of the store ``checkpoint_dir``
    (another node's too) and refresh the records of those this node does not train.

    Returns:
        job name -> its lease object in the bucket (None: nobody holds it).

    Raises:
        BucketError: the store cannot be read (one line naming ``checkpoint_dir``).
    """
    from stoker.jobs.job import job_owner
    from stoker.jobs.store import BucketError, JobStore, _redact

    store = JobStore(checkpoint_dir)
    jobs = Path(work_dir) / "jobs"
    leases = {}
    try:
        if not store.local and not store.fs.exists(store.root.split("/", 1)[0]):
            raise FileNotFoundError("no such bucket")
        for name in store.jobs():
            job_dir = jobs / name
            store.pull(name, job_dir, refresh=job_owner(job_dir) is None)
            leases[name] = store.lease(name)
    except Exception as e:  # botocore/aiohttp raise many types: all mean "unreadable store"
        raise BucketError(f"checkpoint_dir {store.url}: cannot list the jobs there "
                          f"({type(e).__name__}: {_redact(str(e))[:300]})") from None
    return leases


def job_folders(work_dir: Path) -> list[Path]:
    """The job folders under ``<work_dir>/jobs``, newest first (by folder modification time:
    a heartbeat or a record rewritten in it moves it up); [] when there is none."""
    jobs = Path(work_dir) / "jobs"
    if not jobs.is_dir():
        return []
    folders = [p for p in jobs.iterdir() if p.is_dir() and not p.name.startswith(".")]
    folders.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return folders


def newest_job(work_dir: Path) -> Path | None:
    """The newest job folder (the first row of ``stoker jobs``), or None."""
    folders = job_folders(work_dir)
    return folders[0] if folders else None


def list_jobs(work_dir: Path, leases: dict[str, dict | None] | None = None) -> list[JobSummary]:
    """Every job folder under ``<work_dir>/jobs``, newest first (:func:`job_folders`);
    ``leases``: the bucket leases of the jobs of a store (``sync_from_store`` ran first)."""
    leases = leases or {}
    return [job_summary(p, bucket_lease=leases.get(p.name)) for p in job_folders(work_dir)]


def matching_jobs(work_dir: Path, name: str) -> list[Path]:
    """The job folders ``name`` names, sorted: the one called ``name``, else every one whose
    name starts with it (a short key; jobs of the same settings share their first 12
    characters). ``name`` is a plain prefix, never a pattern or a path ([] for ``*``, ``..``,
    ``a/b`` or an empty name)."""
    jobs = Path(work_dir) / "jobs"
    if not name or "/" in name or "\x00" in name or name.startswith(".") or not jobs.is_dir():
        return []
    if (jobs / name).is_dir():
        return [jobs / name]
    return sorted(p for p in jobs.iterdir() if p.name.startswith(name) and p.is_dir())


def age(seconds: float | None) -> str:
    """``12 s ago`` / ``3 min ago`` / ``-``."""
    if seconds is None:
        return "-"
    return f"{_duration(seconds)} ago"
