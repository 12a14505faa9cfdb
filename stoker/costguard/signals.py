"""Job progress signals: the runtime's heartbeat and progress events, and MLflow's last metric.

A job is a folder ``<work_dir>/jobs/<job>/`` written by the training runtime
(:mod:`stoker.runtime.progress`): ``heartbeat.json`` rewritten at least at every event,
``progress.jsonl`` with one event per line, ``spec.yaml`` (the run spec, whose tags carry the
Prefect flow run id) and ``mlflow_run_id``.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from stoker.config import ConfigError
from stoker.runtime.records import real_number

log = logging.getLogger(__name__)

_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Heartbeat:
    """The runtime's last heartbeat: Unix time, step, and the rank-0 PID (its own namespace)."""

    time: float
    step: int | None
    epoch: int | None
    pid: int | None
    world_size: int | None
    outcome: str | None
    pid_started: float | None = None  # rank 0's start time (Unix s); older heartbeats: None


@dataclass(frozen=True)
class JobSignals:
    """What a job folder says about progress. Times are Unix seconds.

    ``started_at``: start of the current attempt (its ``start`` event; else when the spec was
    written). ``last_progress``: the newest of heartbeat, last progress event and MLflow's last
    metric. ``errors``: signals that exist but cannot be read (they make the job's state unknown);
    ``notes``: optional signals that were unavailable.
    """

    job_dir: Path
    heartbeat: Heartbeat | None
    started_at: float | None
    last_progress: float | None
    flow_run_id: str | None
    spec_path: Path
    errors: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    spec_written_at: float | None = None

    @property
    def starting(self) -> bool:
        """Its spec is newer than its heartbeat (or it has none yet): an attempt is starting.
        The train task rewrites the spec at every run, before the runtime's first heartbeat."""
        return self.spec_written_at is not None and not self.errors and (
            self.heartbeat is None or self.spec_written_at > self.heartbeat.time)

    @property
    def name(self) -> str:
        return self.job_dir.name

    @property
    def running(self) -> bool:
        """Heartbeat present and no outcome written (the runtime writes one when it ends)."""
        return self.heartbeat is not None and self.heartbeat.outcome is None


def read_heartbeat(job_dir: Path) -> Heartbeat | None:
    """The job's heartbeat, or None when it has none yet.

    Raises:
        ValueError: ``heartbeat.json`` exists but is not a heartbeat (names the file and why).
    """
    path = Path(job_dir) / "heartbeat.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable: {e}") from None
    if not isinstance(data, dict) or real_number(data.get("time")) is None:
        raise ValueError(f"{path}: no numeric 'time' field")
    return Heartbeat(time=real_number(data["time"]), step=data.get("step"), epoch=data.get("epoch"),
                     pid=data.get("pid"), world_size=data.get("world_size"),
                     outcome=data.get("outcome"),
                     pid_started=real_number(data.get("pid_started")))


def tail_events(job_dir: Path, max_bytes: int = _TAIL_BYTES) -> list[dict]:
    """The progress events in the last ``max_bytes`` of ``progress.jsonl``, oldest first.

    Reads only the tail: the file grows by a line per step. A torn or foreign line is skipped.
    """
    path = Path(job_dir) / "progress.jsonl"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - max_bytes))
            chunk = f.read()
    except FileNotFoundError:
        return []
    lines = chunk.splitlines()
    if size > max_bytes:
        lines = lines[1:]  # the first line may start mid-record
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and real_number(event.get("time")) is not None:
            events.append(event)
    return events


@functools.lru_cache(maxsize=8)
def _mlflow_client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)  # one per store: creating one checks the store's schema


def mlflow_last_metric_time(tracking_uri: str, run_id: str) -> float:
    """Unix time of the newest metric logged to an MLflow run.

    Raises:
        mlflow.exceptions.MlflowException: the run or the store cannot be read.
        LookupError: the run has no metrics yet.
    """
    run = _mlflow_client(tracking_uri).get_run(run_id)
    # RunData.to_proto() keeps each metric's latest value with its timestamp (ms).
    stamps = [m.timestamp for m in run.data.to_proto().metrics]
    if not stamps:
        raise LookupError(f"MLflow run {run_id}: no metrics yet")
    return max(stamps) / 1000.0


def read_job(job_dir: Path, read_mlflow: bool = True,
             mlflow_if_older_than_s: float = 0.0) -> JobSignals:
    """Collect the progress signals of one job folder. Never raises for a bad file: a heartbeat
    that cannot be read is an error (state unknown); a missing MLflow signal is a note.

    Args:
        job_dir: the job folder.
        read_mlflow: also ask MLflow for the run's last metric time.
        mlflow_if_older_than_s: ask MLflow only when the folder's own newest signal (heartbeat,
            progress event) is older than this (s): a fresh heartbeat already says all that
            MLflow could, and importing MLflow costs seconds.
    """
    job_dir = Path(job_dir)
    errors: list[str] = []
    notes: list[str] = []
    try:
        heartbeat = read_heartbeat(job_dir)
    except ValueError as e:
        heartbeat, errors = None, [str(e)]
    events = tail_events(job_dir)
    spec_path = job_dir / "spec.yaml"
    finished = heartbeat is not None and heartbeat.outcome is not None
    spec = None
    if not finished and spec_path.is_file():  # a finished job's spec tells the guard nothing
        try:
            spec = _load_spec(spec_path)
        except ConfigError as e:
            notes.append(f"spec unreadable: {e}")
    starts = [e["time"] for e in events if e.get("event") == "start"]
    spec_written_at = _mtime(spec_path)
    started_at = starts[-1] if starts else spec_written_at
    times = [heartbeat.time] if heartbeat else []
    times += [events[-1]["time"]] if events else []
    run_file = job_dir / "mlflow_run_id"
    fresh = bool(times) and time.time() - max(times) < mlflow_if_older_than_s
    ask = read_mlflow and not finished and not fresh
    if ask and spec and spec.tracking_uri and run_file.is_file():
        try:
            times.append(mlflow_last_metric_time(spec.tracking_uri, run_file.read_text().strip()))
        except Exception as e:  # an optional signal: any store failure is only a note
            notes.append(f"MLflow last metric time unavailable: {type(e).__name__}: {e}")
    return JobSignals(
        job_dir=job_dir, heartbeat=heartbeat, started_at=started_at,
        last_progress=max(times) if times else None,
        flow_run_id=(spec.tags.get("prefect.flow_run_id") if spec else None),
        spec_path=spec_path, errors=tuple(errors), notes=tuple(notes),
        spec_written_at=spec_written_at)


_SPECS: dict[tuple[str, int, int], object] = {}


def _load_spec(path: Path):
    """``RunSpec.load``, cached by path, modification time and size: a spec does not change
    while its job runs, and a sweep reads every job folder once per (re-)check.

    Raises:
        ConfigError: the spec cannot be read.
    """
    from stoker.runtime.spec import RunSpec

    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _SPECS:
        if len(_SPECS) > 1024:
            _SPECS.clear()
        _SPECS[key] = RunSpec.load(path)
    return _SPECS[key]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def read_jobs(work_dir: Path, read_mlflow: bool = True,
              mlflow_if_older_than_s: float = 0.0) -> list[JobSignals]:
    """Signals of every job folder under ``<work_dir>/jobs`` with a heartbeat or a spec, by name.

    A folder with a spec but no heartbeat yet, or a spec newer than its heartbeat, is a job
    starting; the decision counts it as busy for ``idle_timeout_s``.
    """
    jobs_dir = Path(work_dir) / "jobs"
    if not jobs_dir.is_dir():
        return []
    return [read_job(p, read_mlflow, mlflow_if_older_than_s) for p in sorted(jobs_dir.iterdir())
            if p.is_dir() and ((p / "heartbeat.json").exists() or (p / "spec.yaml").exists())]
