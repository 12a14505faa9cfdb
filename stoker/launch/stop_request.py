"""A stop someone asked for: the cost guard or a user writes it into the job folder before
signalling the training, so the retry policy knows the stop is not a preemption to resume.

``<job_dir>/stop-requested.json`` holds ``{"by": "cost-guard"|"user", "reason": str,
"time": unix seconds}``. The ``train`` task clears it when a run of the job starts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

STOP_FILE = "stop-requested.json"


@dataclass(frozen=True)
class StopRequest:
    """Who asked for the stop (``by``), why, and when (Unix seconds)."""

    by: str
    reason: str
    time: float

    def describe(self) -> str:
        return f"stopped by {self.by}: {self.reason}"


def request_stop(job_dir: Path, by: str, reason: str) -> StopRequest:
    """Record a stop request for the job (atomic write). Call before sending the signal."""
    request = StopRequest(by, reason, time.time())
    path = Path(job_dir) / STOP_FILE
    tmp = path.with_name(f"{STOP_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(request.__dict__))
    tmp.replace(path)
    return request


def read_stop_request(job_dir: Path) -> StopRequest | None:
    """The job's stop request, or None. A file that cannot be parsed still counts as a request
    (someone asked to stop): by ``unknown``."""
    path = Path(job_dir) / STOP_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return StopRequest("unknown", f"{path} unreadable: {e}", 0.0)
    try:
        data = json.loads(text)
        return StopRequest(str(data["by"]), str(data.get("reason", "")),
                           float(data.get("time", 0.0)))
    except (ValueError, KeyError, TypeError, AttributeError):
        return StopRequest("unknown", f"{path} is not a stop request JSON", 0.0)


def clear_stop_request(job_dir: Path) -> None:
    """Forget an earlier stop request (a new run of the job is a new decision)."""
    (Path(job_dir) / STOP_FILE).unlink(missing_ok=True)


class TrainingStopped(RuntimeError):
    """The cost guard or a user stopped the job; the flow run ends Cancelled with this message."""


def stopped(client, run_file: Path, request: StopRequest | None, job: str) -> None:
    """End the MLflow run KILLED and raise :class:`TrainingStopped` with who stopped the job."""
    from stoker.launch.supervisor import finish_run

    if run_file.exists():
        finish_run(client, run_file.read_text().strip(), "KILLED")
    reason = request.describe() if request else "stopped on request"
    raise TrainingStopped(f"job {job} {reason}; run the same command to resume it")
