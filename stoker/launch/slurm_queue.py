"""Where a job's Slurm batch job stands in the queue, for ``stoker status`` and ``stoker jobs``.

The launcher records the id of each job it submits in ``<job_dir>/slurm_job.json``
(:func:`record_submitted`). While the job's last attempt is open and ran on Slurm,
:func:`job_queue_state` asks ``squeue`` (else ``sacct``, for a job ``squeue`` no longer lists)
for the job's state and Slurm's reason, e.g. ``PENDING`` because of ``Resources``: a job that
waits for nodes shows that it waits, and why, before its ranks write anything. What Slurm
prints is read as untrusted text: a state that is not one upper-case word, or a reason with
characters outside a plain set, is not shown as it came.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from stoker.jobs.attempts import AttemptLog, is_closed
from stoker.launch.slurm_jobs import SlurmError, slurm
from stoker.runtime import private
from stoker.runtime.records import read_json, real_number

SLURM_JOB_FILE = "slurm_job.json"
QUERY_TIMEOUT_S = 5.0  # a status command does not wait on a busy controller for long
_JOB_ID = re.compile(r"^\d{1,12}$")
_STATE = re.compile(r"^[A-Z_]{1,32}$")
_REASON_CHARS = re.compile(r"[^A-Za-z0-9_ ().,:=/+-]")
REASON_MAX_CHARS = 80
# Slurm's reason codes a user meets most, in words (``squeue --help``: JOB REASON CODES).
REASON_WORDS = {
    "Resources": "waiting for free nodes",
    "Priority": "jobs of higher priority go first",
    "JobHeldUser": "held (scontrol release {id})",
    "JobHeldAdmin": "held by an administrator",
    "Dependency": "waiting for a job it depends on",
    "ReqNodeNotAvail": "a node it asked for is not available",
    "PartitionNodeLimit": "it asks for more nodes than the partition has",
    "PartitionTimeLimit": "its time limit is over the partition's",
    "QOSMaxJobsPerUserLimit": "the user's limit of running jobs is reached",
    "BeginTime": "its start time has not come yet",
}


@dataclass(frozen=True)
class QueueState:
    """One Slurm job as the queue sees it: ``job_id``; ``state`` (``PENDING``, ``RUNNING``,
    ..., ``UNKNOWN`` when Slurm did not say); ``reason``: Slurm's reason code, or why the state
    is unknown (None for none)."""

    job_id: str
    state: str
    reason: str | None = None

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"

    def describe(self) -> str:
        """``Slurm job 12 PENDING (Resources): waiting for free nodes; it trains once Slurm
        starts it``, or ``Slurm job 12 RUNNING``."""
        line = f"Slurm job {self.job_id} {self.state}"
        if self.reason:
            line += f" ({self.reason})"
        if self.pending:
            words = REASON_WORDS.get(self.reason or "")
            line += (f": {words.format(id=self.job_id)}" if words else "") + \
                "; it trains once Slurm starts it"
        return line


def record_submitted(job_dir: Path, job_id: str) -> None:
    """Record the id of the Slurm job just submitted for ``job_dir`` (``slurm_job.json``,
    written atomically, 0600)."""
    path = Path(job_dir) / SLURM_JOB_FILE
    tmp = path.with_name(f"{SLURM_JOB_FILE}.tmp")
    private.write_text(tmp, json.dumps({"job_id": job_id, "submitted": time.time()}))
    tmp.replace(path)


def recorded_job_id(job_dir: Path, since: float) -> str | None:
    """The id :func:`record_submitted` recorded at or after ``since`` (Unix seconds: an
    earlier attempt's job is not the current one); None without one, or one that is not a
    plain job number (the file is read as data)."""
    record = read_json(Path(job_dir) / SLURM_JOB_FILE, default=None, warn=lambda *_: None)
    if not isinstance(record, dict) or (real_number(record.get("submitted")) or 0) < since:
        return None
    job_id = record.get("job_id")
    return job_id if isinstance(job_id, str) and _JOB_ID.match(job_id) else None


def _plain(text: str) -> str:
    """``text`` with only plain characters (others read ``?``), cut to ``REASON_MAX_CHARS``."""
    return _REASON_CHARS.sub("?", " ".join(text.split()))[:REASON_MAX_CHARS]


def parse_queue_line(job_id: str, line: str) -> QueueState:
    """One ``STATE|REASON`` line (``squeue -o %T|%r``, ``sacct -o State,Reason``) as a
    :class:`QueueState`; a state that is not one upper-case word reads ``UNKNOWN``, and a
    reason keeps only plain characters, cut to ``REASON_MAX_CHARS``."""
    state, _, reason = line.strip().partition("|")
    state = state.split()[0] if state.split() else ""  # sacct: "CANCELLED by 1000"
    reason = _plain(reason)
    if not _STATE.match(state):
        return QueueState(job_id, "UNKNOWN", "Slurm's answer was not a job state")
    return QueueState(job_id, state, None if reason in ("", "None") else reason)


def queue_state(job_id: str) -> QueueState:
    """The state of Slurm job ``job_id``: ``squeue``'s, else ``sacct``'s for a job that left
    the queue; ``UNKNOWN`` (with why) when neither answers."""
    try:
        out = slurm("squeue", "-h", "-j", job_id, "-o", "%T|%r", timeout_s=QUERY_TIMEOUT_S)
        if out.strip():
            return parse_queue_line(job_id, out.splitlines()[0])
    except SlurmError as e:
        if "Invalid job id" not in str(e):
            return QueueState(job_id, "UNKNOWN", _plain(str(e)))
    try:
        out = slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,Reason",
                    timeout_s=QUERY_TIMEOUT_S)
    except SlurmError as e:
        return QueueState(job_id, "UNKNOWN", _plain(str(e)))
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return QueueState(job_id, "UNKNOWN", "neither squeue nor sacct knows it")
    return parse_queue_line(job_id, lines[-1])


def job_queue_state(job_dir: Path) -> QueueState | None:
    """The queue state of the job's current Slurm job: only while its last attempt is open
    and was launched on Slurm (else None, and Slurm is not asked)."""
    records = AttemptLog(job_dir).records()
    if not records or is_closed(records[-1]) or records[-1].get("launcher") != "slurm":
        return None
    job_id = recorded_job_id(job_dir, real_number(records[-1].get("started")) or 0.0)
    return queue_state(job_id) if job_id is not None else None
