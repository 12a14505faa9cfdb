"""A stop someone asked for: the cost guard or a user writes it into the job folder before
signalling the training, so the retry policy knows the stop is not a preemption to resume.

``<job_dir>/stop-requested.json`` holds ``{"by": "cost-guard"|"user", "reason": str,
"time": unix seconds, "verdict": str | null, "step": int | null}`` (``verdict``: the guard's,
e.g. ``stalled``; ``step``: the step rank 0's heartbeat showed then). The ``train`` task clears
it when a run of the job starts, except after a stall: :func:`refuse_stalled` keeps a stalled
job stopped until the run says ``retry.resume_stalled=true`` (``stoker run --resume-stalled``).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stoker.jobs.text import MAX_REASON, one_line  # noqa: F401 - re-exported
from stoker.runtime import private
from stoker.runtime.records import integer, real_number

STOP_FILE = "stop-requested.json"
@dataclass(frozen=True)
class StopRequest:
    """Who asked for the stop (``by``), why, and when (Unix seconds)."""

    by: str
    reason: str
    time: float
    verdict: str | None = None
    step: int | None = None

    def describe(self) -> str:
        return f"stopped by {self.by}: {self.reason}"

    @property
    def stalled(self) -> bool:
        """The guard stopped the job because it made no progress (files written before the
        ``verdict`` field say so at the start of ``reason``)."""
        return self.verdict == "stalled" or (self.verdict is None
                                             and self.reason.startswith("stalled"))


def request_stop(job_dir: Path, by: str, reason: str, verdict: str | None = None
                 ) -> StopRequest:
    """Record a stop request for the job (atomic write). Call before sending the signal.
    ``by`` and ``reason`` are kept as one line (:func:`one_line`): messages quote them.

    ``verdict`` is the guard's (``stalled``, ``idle``); ``step`` is the last step rank 0
    reported (progress events and heartbeat; None before the first)."""
    from stoker.jobs.attempts import reached_step

    request = StopRequest(one_line(by), one_line(reason), time.time(), verdict,
                          reached_step(Path(job_dir), 0.0))
    path = Path(job_dir) / STOP_FILE
    tmp = path.with_name(f"{STOP_FILE}.tmp-{os.getpid()}")
    private.write_text(tmp, json.dumps(asdict(request)))
    tmp.replace(path)
    return request


def read_stop_request(job_dir: Path) -> StopRequest | None:
    """The job's stop request, or None. A file that cannot be parsed still counts as a request
    (someone asked to stop): by ``unknown``. ``by`` and ``reason`` are read as one line each."""
    path = Path(job_dir) / STOP_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return StopRequest("unknown", f"{path} unreadable: {e}", 0.0)
    try:
        data = json.loads(text)
        step, verdict = data.get("step"), data.get("verdict")
        return StopRequest(one_line(str(data["by"])), one_line(str(data.get("reason", ""))),
                           real_number(data.get("time", 0.0)) or 0.0,
                           str(verdict) if verdict is not None else None, integer(step))
    except (ValueError, KeyError, TypeError, AttributeError):
        return StopRequest("unknown", f"{path} is not a stop request JSON", 0.0)


def clear_stop_request(job_dir: Path) -> None:
    """Forget an earlier stop request (a new run of the job is a new decision)."""
    (Path(job_dir) / STOP_FILE).unlink(missing_ok=True)


class TrainingStopped(RuntimeError):
    """The cost guard or a user stopped the job; the flow run ends Cancelled with this message."""


def refuse_stalled(job_dir: Path, resume_stalled: bool) -> StopRequest | None:
    """Keep a job the guard stopped for a stall stopped: resuming it would most likely stall
    again at the same step (a dead data source, a hung collective) and burn the GPUs until the
    guard's next sweep.

    Returns:
        The stall's request when ``resume_stalled`` lets the run resume it anyway, else None.

    Raises:
        TrainingStopped: the job's stop request is a stall and ``resume_stalled`` is false (one
            line: the step, when, who, and the override).
    """
    request = read_stop_request(job_dir)
    if request is None or not request.stalled:
        return None
    if resume_stalled:
        return request
    when = datetime.datetime.fromtimestamp(request.time, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S UTC") if request.time else "at an unknown time"
    at = f"at step {request.step}" if request.step is not None else "at an unknown step"
    raise TrainingStopped(
        f"job {Path(job_dir).name} stalled {at} and was stopped by {request.by} {when} "
        f"({request.reason}); not resumed into the same stall: fix the cause, then run with "
        "--resume-stalled (retry.resume_stalled=true)")

