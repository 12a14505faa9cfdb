"""A stop someone asked for: the cost guard or a user writes it into the job folder before
signalling the training, so the retry policy knows the stop is not a preemption to resume.

``<job_dir>/stop-requested.json`` holds ``{"by": "cost-guard"|"user", "reason": str,
"time": unix seconds, "verdict": str | null, "step": int | null}`` (``verdict``: the guard's,
e.g. ``stalled``; ``step``: the step rank 0's heartbeat showed then). The ``train`` task clears
it when a run of the job starts, except after a stall: :func:`refuse_stalled` keeps a stalled
job stopped until the run says ``retry.resume_stalled=true`` (``stoker run --resume-stalled``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from stoker.runtime.records import integer, real_number

STOP_FILE = "stop-requested.json"
MAX_REASON = 300  # characters of a reason kept: it is quoted in one-line messages


def one_line(text: str) -> str:
    """``text`` as one line for the messages that quote it: every run of whitespace and control
    characters (a newline, a tab, an escape sequence's ESC) is one space; at most
    ``MAX_REASON`` characters (then ``…``)."""
    flat = " ".join(re.sub(r"[\x00-\x1f\x7f]+", " ", text).split())
    return flat if len(flat) <= MAX_REASON else flat[:MAX_REASON - 1] + "…"


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
    tmp.write_text(json.dumps(asdict(request)))
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


def stopped(client, run_file: Path, request: StopRequest | None, job: str) -> None:
    """End the MLflow run KILLED and raise :class:`TrainingStopped` with who stopped the job."""
    from stoker.launch.supervisor import finish_run

    if run_file.exists():
        finish_run(client, run_file.read_text().strip(), "KILLED")
    reason = request.describe() if request else "stopped on request"
    if request is not None and request.by == "budget":  # stoker.jobs.budget: exit 5
        error = TrainingStopped(f"job {job} {reason}; raise train.max_cost_usd / "
                                "train.max_duration and run the same command to resume it")
        error.by = request.by
        raise error
    raise TrainingStopped(f"job {job} {reason}; run the same command to resume it")


class StopFailed(RuntimeError):
    """``stoker stop`` could not stop the job (one line: why, and what to do)."""


class TrainedElsewhere(StopFailed):
    """The job's lease is held on another host: this one cannot signal its processes."""


RANK_NAME = re.compile(r"^stoker-rank\d+$")  # what a rank names itself (stoker.runtime)


def launcher_below(holder: psutil.Process) -> psutil.Process | None:
    """The launcher (torchrun's process) of the attempt running below ``holder`` (the process
    that holds the job's lease): the parent of the processes named ``stoker-rank<N>``. None
    while no rank runs there (an attempt starting, a retry's back-off, ranks in a container)."""
    try:
        below = holder.children(recursive=True)
    except psutil.Error:
        return None
    for proc in below:
        with contextlib.suppress(psutil.Error):
            if RANK_NAME.match(proc.name()):
                return proc.parent()
    return None


def docker_client() -> Any | None:
    """A client of this host's Docker Engine, or None without the Docker SDK or a reachable
    engine (no container of ours to find). Close it when done."""
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
        return client
    except Exception:  # no SDK, no engine, no permission
        return None


def job_containers(job: str, client: Any | None) -> list:
    """The running containers of ``job`` on ``client``'s engine (the Docker launcher labels
    them with the job and as Stoker's own); [] without a client or when listing fails."""
    from stoker.ownership import DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL

    if client is None:
        return []
    try:
        return client.containers.list(filters={
            "label": [f"{DOCKER_JOB_LABEL}={job}", f"{DOCKER_OWNER_LABEL}=true"],
            "status": "running"})
    except Exception:  # the engine went away meanwhile
        return []


def _launcher_kind(job_dir: Path) -> str | None:
    """The launcher of the job's last attempt, as its started record says (None: an older
    record, or none)."""
    from stoker.jobs.attempts import AttemptLog

    records = AttemptLog(job_dir).records()  # each attempt's records merged, newest last
    kind = records[-1].get("launcher") if records else None
    return kind if isinstance(kind, str) else None


def stop_job(job_dir: Path, reason: str, timeout_s: float = 120.0,
             poll_s: float = 0.2, by: str = "user") -> str | None:
    """Stop a job this host trains, on purpose: record a user stop request, then SIGTERM the
    attempt's launcher (as ``docker stop`` or a spot reclaim would): the local launcher below
    the lease holder, or, when the ranks run in containers (the Docker launcher), each of the
    job's containers (their entrypoint passes it to the ranks). On Kubernetes (the attempt's
    started record names the launcher) nothing is signalled from here: the launcher reads the
    request at its next status poll and deletes the job, whose pods get SIGTERM and their
    grace. The ranks commit a stop checkpoint, the attempt ends **stopped** (not retried), the
    flow run ends Cancelled and ``stoker run`` exits 3; the same command resumes the job.

    Args:
        job_dir: the job's folder.
        reason: recorded in the request; the ranks' stop line and the flow run's state say it.
        timeout_s: how long to wait for a rank to appear (an attempt starting) and then for the
            job to stop training, in seconds.
        poll_s: how often to look, in seconds.
        by: who asks, as the request records it (``user``; the flow's own
            ``a Prefect cancel of flow run 'name'``).

    Returns:
        None when the job was not training (nothing done), else the job's state afterwards
        (``stopped``).

    Raises:
        TrainedElsewhere: another host trains it (nothing is recorded).
        StopFailed: no launcher showed up below its process within
            ``timeout_s`` (the request stays: the attempt stops when it ends), or it still
            trains after ``timeout_s``.
    """
    import socket

    from stoker.jobs.lease import holder_alive
    from stoker.runtime.records import read_json

    job_dir = Path(job_dir)
    lease = read_json(job_dir / "lease.json", default=None, warn=lambda *_: None)
    if not (isinstance(lease, dict) and holder_alive(lease)):
        return None
    host, pid = lease.get("host"), lease.get("pid")
    if host != socket.gethostname():
        raise TrainedElsewhere(f"job {job_dir.name} trains on host {host} (pid {pid}), not this "
                         "one: run `stoker stop` there")
    try:
        holder = psutil.Process(pid)  # holder_alive checked 0 < pid < 2**31
    except psutil.Error:
        return None  # it ended meanwhile
    request_stop(job_dir, by, reason)
    deadline = time.monotonic() + timeout_s
    # On Kubernetes nothing of the job runs here: its launcher reads the request at its next
    # status poll and deletes the job (the pods get SIGTERM and their grace to commit).
    remote = _launcher_kind(job_dir) == "kubernetes"
    client = None if remote else docker_client()  # one for the whole wait
    try:
        return _stop_and_wait(job_dir, holder, pid, remote, client, deadline, timeout_s, poll_s)
    finally:
        if client is not None:
            client.close()


def _stop_and_wait(job_dir: Path, holder: psutil.Process, pid: int, remote: bool,
                   client: Any | None, deadline: float, timeout_s: float,
                   poll_s: float) -> str:
    from stoker.jobs.status import job_summary

    launcher, containers = None, []
    while not remote and (launcher := launcher_below(holder)) is None \
            and not (containers := job_containers(job_dir.name, client)):
        if not holder.is_running():
            break
        if time.monotonic() > deadline:
            raise StopFailed(
                f"job {job_dir.name}: no training process below pid {pid} and no container of "
                f"the job within {timeout_s:g} s; the stop request is recorded, so the job "
                "stops when its attempt ends")
        time.sleep(poll_s)
    if launcher is not None:
        with contextlib.suppress(psutil.Error):
            launcher.send_signal(signal.SIGTERM)
    for container in containers:  # `docker kill -s SIGTERM`: the entrypoint stops the ranks
        with contextlib.suppress(Exception):
            container.kill(signal="SIGTERM")
    while (state := job_summary(job_dir).state) == "training":
        if time.monotonic() > deadline:
            raise StopFailed(f"job {job_dir.name} still trains {timeout_s:g} s after the stop "
                             "request (a long stop checkpoint?); `stoker status "
                             f"{job_dir.name}` shows when it stops")
        time.sleep(poll_s)
    return state
