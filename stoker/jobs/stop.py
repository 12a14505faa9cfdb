"""``stoker stop``: ask a job to stop (:mod:`stoker.jobs.stop_request`), signal its launcher,
and wait for its stop checkpoint, wherever its ranks run (here, in containers, in a cluster)."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from stoker.jobs.processes import launcher_below
from stoker.jobs.stop_request import request_stop


class StopFailed(RuntimeError):
    """``stoker stop`` could not stop the job (one line: why, and what to do)."""


class TrainedElsewhere(StopFailed):
    """The job's lease is held on another host: this one cannot signal its processes."""


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
             poll_s: float = 0.2, by: str = "user", wait: bool = True) -> str | None:
    """Stop a job this host trains, on purpose: record a user stop request, then SIGTERM the
    attempt's launcher (as ``docker stop`` or a spot reclaim would): the local launcher below
    the lease holder, or, when the ranks run in containers (the Docker launcher), each of the
    job's containers (their entrypoint passes it to the ranks). On Kubernetes (the attempt's
    started record names the launcher) nothing is signalled from here: the launcher reads the
    request at its next status poll and deletes the job, whose pods get SIGTERM and their
    grace; on Slurm the launcher sends the job's steps SIGTERM (``scancel --signal=TERM``)
    and cancels the job after the grace. The ranks commit a stop checkpoint, the attempt ends
    **stopped** (not retried), the flow run ends Cancelled and ``stoker run`` exits 3; the
    same command resumes the job.

    Args:
        job_dir: the job's folder.
        reason: recorded in the request; the ranks' stop line and the flow run's state say it.
        timeout_s: how long to wait for a rank to appear (an attempt starting) and then for the
            job to stop training, in seconds.
        poll_s: how often to look, in seconds.
        by: who asks, as the request records it (``user``; the flow's own
            ``a Prefect cancel of flow run 'name'``).
        wait: wait for the job to stop training; False: return once signalled (the budget
            watcher, inside the flow that trains the job: it stops training only after).

    Returns:
        None when the job was not training (nothing done), else the job's state afterwards
        (``stopped``; ``stopping`` without ``wait``).

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
    # On Kubernetes and Slurm nothing of the job runs below the holder: its launcher reads the
    # request at its next poll and deletes the job (the pods get SIGTERM and their grace to
    # commit) or sends the Slurm job SIGTERM (scancel --signal=TERM, scancel after the grace).
    remote = _launcher_kind(job_dir) in ("kubernetes", "slurm")
    client = None if remote else docker_client()  # one for the whole wait
    try:
        return _stop_and_wait(job_dir, holder, pid, remote, client, deadline, timeout_s, poll_s,
                              wait)
    finally:
        if client is not None:
            client.close()


def _stop_and_wait(job_dir: Path, holder: psutil.Process, pid: int, remote: bool,
                   client: Any | None, deadline: float, timeout_s: float,
                   poll_s: float, wait: bool = True) -> str:
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
    if not wait:
        return "stopping"
    while (state := job_summary(job_dir).state) == "training":
        if time.monotonic() > deadline:
            raise StopFailed(f"job {job_dir.name} still trains {timeout_s:g} s after the stop "
                             "request (a long stop checkpoint?); `stoker status "
                             f"{job_dir.name}` shows when it stops")
        time.sleep(poll_s)
    return state
