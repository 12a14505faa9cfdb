"""What the cost guard may judge: Stoker-owned containers, local jobs and this host's instance.

Each is a :class:`Resource` with the GPUs it was given (``devices``) and/or the host PIDs of its
processes, which NVML's process lists map to GPUs. Only resources that carry Stoker's ownership
mark are listed; the actors check the mark again before they act.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from stoker.costguard.signals import JobSignals
from stoker.ownership import DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL

log = logging.getLogger(__name__)

ResourceKind = Literal["container", "job", "instance", "slurm"]


@dataclass(frozen=True)
class Resource:
    """Something that holds GPUs and that Stoker may stop.

    ``devices``: GPUs it was given, as NVIDIA_VISIBLE_DEVICES tokens ("all", an index, a GPU or MIG
    UUID); None: it is judged by the GPUs its processes (``pids``, host namespace) run on.
    ``jobs``: the progress signals that count for it (their errors make its state unknown).
    ``errors``: facts about it that could not be read (state unknown). ``no_gpu_reason``: why
    it cannot be using a GPU whatever NVML says (a local job on a host without a GPU device
    file); None: it may be. Times are Unix seconds.
    """

    kind: ResourceKind
    id: str
    name: str
    devices: tuple[str, ...] | None
    pids: frozenset[int]
    started_at: float | None
    jobs: tuple[JobSignals, ...] = ()
    flow_run_id: str | None = None
    errors: tuple[str, ...] = ()
    no_gpu_reason: str | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.id}"

    @property
    def last_progress(self) -> float | None:
        times = [j.last_progress for j in self.jobs if j.last_progress is not None]
        return max(times) if times else None


# --- Docker -------------------------------------------------------------------------------------

def container_devices(attrs: dict[str, Any]) -> tuple[str, ...] | None:
    """GPUs a container was given, from ``docker inspect`` attributes.

    ``--gpus`` lands in HostConfig.DeviceRequests (Count -1: all; DeviceIDs; or the first Count
    GPUs, as the NVIDIA container toolkit picks them). NVIDIA_VISIBLE_DEVICES counts only under
    the ``nvidia`` runtime: CUDA images set it to ``all`` even where no GPU is attached.

    Returns:
        Device tokens, () when given none explicitly, or None when nothing says.
    """
    host = attrs.get("HostConfig") or {}
    tokens: list[str] = []
    said = False
    for request in host.get("DeviceRequests") or []:
        capabilities = {c for group in request.get("Capabilities") or [] for c in group}
        if "gpu" not in capabilities and request.get("Driver") != "nvidia":
            continue
        said = True
        if request.get("Count") == -1:
            tokens.append("all")
        elif request.get("DeviceIDs"):
            tokens.extend(request["DeviceIDs"])
        else:
            tokens.extend(str(i) for i in range(int(request.get("Count") or 0)))
    if host.get("Runtime") == "nvidia":
        env = dict(item.split("=", 1) for item in (attrs.get("Config") or {}).get("Env") or []
                   if "=" in item)
        value = env.get("NVIDIA_VISIBLE_DEVICES")
        if value is not None:
            said = True
            if value.strip() not in ("", "none", "void"):
                tokens.extend(t.strip() for t in value.split(",") if t.strip())
    return tuple(dict.fromkeys(tokens)) if said else None


def _parse_docker_time(value: str | None) -> float | None:
    if not value or value.startswith("0001-"):
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def container_pids(container: Any) -> frozenset[int]:
    """Host PIDs of a container's processes (``docker top``, which reports host PIDs).

    Raises:
        docker.errors.APIError: the engine could not list them.
        ValueError: the listing has no PID column.
    """
    top = container.top()
    titles = top.get("Titles") or []
    if "PID" not in titles:
        raise ValueError(f"docker top {container.name}: no PID column in {titles}")
    column = titles.index("PID")
    return frozenset(int(row[column]) for row in top.get("Processes") or [])


def discover_containers(client: Any, label_filters: list[str],
                        jobs: dict[str, JobSignals]) -> list[Resource]:
    """Running containers labelled ``dev.stoker.owned=true`` (and matching ``label_filters``).

    Args:
        client: a ``docker.DockerClient``.
        label_filters: further ``key`` or ``key=value`` label filters, all required.
        jobs: job signals by job folder name, matched to the ``dev.stoker.job`` label.
    """
    import docker.errors

    found = client.containers.list(filters={
        "label": [f"{DOCKER_OWNER_LABEL}=true", *label_filters], "status": "running"})
    resources = []
    for container in found:
        errors: list[str] = []
        try:
            pids = container_pids(container)
        except docker.errors.NotFound:
            continue  # gone since listed
        except (docker.errors.APIError, ValueError) as e:
            pids, errors = frozenset(), [f"processes unreadable: {e}"]
        job_name = container.labels.get(DOCKER_JOB_LABEL)
        job = jobs.get(job_name) if job_name else None
        resources.append(Resource(
            kind="container", id=container.id, name=container.name,
            devices=container_devices(container.attrs), pids=pids,
            started_at=_parse_docker_time(container.attrs.get("State", {}).get("StartedAt")),
            jobs=(job,) if job else (), flow_run_id=job.flow_run_id if job else None,
            errors=tuple(errors)))
    return resources


# --- PIDs from NVML ------------------------------------------------------------------------------

NO_PID = 0xFFFFFFFF  # what some drivers report for a process they cannot name (in containers)


def pid_problem(pid: object) -> str | None:
    """Why a PID from NVML does not name a live process on this host; None when it does.

    Never raises: out of range (``psutil.pid_exists`` raises OverflowError for PIDs >= 2**31),
    <= 0, not a number, or absent (exited, or a PID of another PID namespace).
    """
    if isinstance(pid, bool) or not isinstance(pid, int):
        return f"PID {pid!r} is not a number"
    if pid == NO_PID:
        return f"PID {pid} is NVML's 'no PID' value (a process NVML cannot name)"
    if pid <= 0:
        return f"PID {pid} is not a process ID (<= 0)"
    try:
        exists = psutil.pid_exists(pid)
    except (OverflowError, ValueError, OSError) as e:
        return f"PID {pid} is out of range for this host ({type(e).__name__}: {e})"
    if not exists:
        return (f"PID {pid} not found on this host (exited, or in another PID namespace: run "
                f"the guard in the host's PID namespace)")
    return None


def process_name(pid: int) -> str | None:
    """The name of a live process (None when it cannot be read)."""
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OverflowError, ValueError, OSError):
        return None


# --- Local jobs --------------------------------------------------------------------------------

START_TOLERANCE_S = 0.05  # create_time is in clock ticks (10 ms); the same reading both sides


def job_pids(job: JobSignals) -> frozenset[int] | None:
    """Host PIDs of a job's training processes, or None when it does not run on this host.

    The heartbeat names rank 0's PID and start time; the PID counts only if that process
    started then (a PID from a container's namespace or a reused PID names another process).
    A heartbeat without the start time (an older runtime) counts only if the process's command
    line names this job's spec (a rank forked from a standby launcher has the standby's command
    line: ``stoker.launch.local.Standby``). Under torchrun (world size > 1) the job is the agent
    and all its descendants, else rank 0 and its descendants (DataLoader workers).
    """
    beat = job.heartbeat
    if beat is None or beat.pid is None:
        return None
    try:
        proc = psutil.Process(beat.pid)
        if beat.pid_started is not None:
            if abs(proc.create_time() - beat.pid_started) > START_TOLERANCE_S:
                return None
        elif not any(arg.endswith(f"{job.name}/spec.yaml") for arg in proc.cmdline()):
            return None
        root = proc.parent() if (beat.world_size or 1) > 1 else proc
        root = root or proc
        return frozenset([root.pid, *(p.pid for p in root.children(recursive=True))])
    except (psutil.Error, OverflowError, ValueError, TypeError):  # gone, or not a pid
        return None


def discover_jobs(jobs: list[JobSignals], claimed: set[str],
                  dev: Path = Path("/dev")) -> list[Resource]:
    """Running local jobs (heartbeat without outcome, rank 0 alive here), except ``claimed`` ones
    (judged as part of their container). On a host without a GPU device file under ``dev``
    (no driver: ``gpu_device_present``) their processes cannot be on a GPU, and each says so
    in ``no_gpu_reason``."""
    from stoker.runtime.launch import gpu_device_present

    no_gpu = None if gpu_device_present(dev) else (
        f"no GPU device on this host (no {dev}/nvidia*, kfd or dxg): its processes cannot use "
        "a GPU")
    resources = []
    for job in jobs:
        if not job.running or job.name in claimed:
            continue
        pids = job_pids(job)
        if pids is None:
            continue
        resources.append(Resource(
            kind="job", id=job.name, name=job.name, devices=None, pids=pids,
            started_at=job.started_at, jobs=(job,), flow_run_id=job.flow_run_id,
            no_gpu_reason=no_gpu))
    return resources


# --- This host's instance ----------------------------------------------------------------------

def host_instance(instance_id: str, jobs: list[JobSignals]) -> Resource:
    """This host as a cloud instance: all its GPUs, every job's progress, started at boot."""
    return Resource(kind="instance", id=instance_id, name=instance_id, devices=("all",),
                    pids=frozenset(), started_at=psutil.boot_time(), jobs=tuple(jobs))


def jobs_by_name(jobs: list[JobSignals]) -> dict[str, JobSignals]:
    return {job.name: job for job in jobs}


def claimed_jobs(resources: list[Resource]) -> set[str]:
    return {Path(job.job_dir).name for r in resources for job in r.jobs}
