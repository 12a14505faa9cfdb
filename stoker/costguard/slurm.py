"""The cost guard on a Slurm node: Stoker's Slurm jobs whose processes run on this host, and an
actor that stops one the way ``stoker stop`` does (SIGTERM, stop checkpoint, ``scancel`` after
the grace).

A Slurm job is Stoker's when its name is ``stoker-<job>`` and its comment ``stoker-job=<job>``
(:mod:`stoker.launch.slurm_jobs`); its processes on this host are what ``scontrol listpids``
says for each node whose ``slurmd`` runs here, which NVML's process lists map to GPUs.
"""

from __future__ import annotations

import datetime as dt
import socket

from stoker.costguard.actions import ActionResult
from stoker.costguard.inventory import Resource
from stoker.costguard.signals import JobSignals
from stoker.launch.slurm_jobs import (
    COMMENT_PREFIX,
    JOB_PREFIX,
    SlurmError,
    job_record,
    parse_fields,
    slurm,
    stop_gracefully,
)


def local_nodes() -> list[str]:
    """Names of the Slurm nodes whose ``slurmd`` runs on this host (``NodeHostName``).

    Raises:
        SlurmError: the controller did not answer.
    """
    host = socket.gethostname().split(".")[0]
    nodes = [parse_fields(line) for line in slurm("scontrol", "-o", "show", "node").splitlines()]
    return [n["NodeName"] for n in nodes
            if n.get("NodeName") and n.get("NodeHostName", "").split(".")[0] == host]


def stoker_jobs() -> list[tuple[str, str, str]]:
    """(Slurm job id, Stoker job key, start time) of the running jobs that carry Stoker's marks.

    Raises:
        SlurmError: ``squeue`` failed.
    """
    found = []
    for line in slurm("squeue", "-h", "-t", "RUNNING", "-o", "%i|%S|%j|%k").splitlines():
        job_id, _, rest = line.partition("|")
        start, _, rest = rest.partition("|")
        name, _, comment = rest.partition("|")
        key = name.removeprefix(JOB_PREFIX)
        if job_id.isdigit() and name.startswith(JOB_PREFIX) and comment == COMMENT_PREFIX + key:
            found.append((job_id, key, start))
    return found


def job_pids(job_id: str, nodes: list[str]) -> frozenset[int]:
    """Host PIDs of the Slurm job's processes on ``nodes`` (``scontrol listpids``); a node the
    job does not run on adds none."""
    pids: set[int] = set()
    for node in nodes:
        try:
            out = slurm("scontrol", "listpids", job_id, node)
        except SlurmError:  # "JobId=N does not exist on node n2"
            continue
        pids.update(int(line.split()[0]) for line in out.splitlines()[1:]
                    if line.split() and line.split()[0].isdigit())
    return frozenset(pids)


def _start_time(text: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(text).timestamp()  # the controller's local time
    except ValueError:
        return None


def discover_slurm_jobs(jobs: dict[str, JobSignals]) -> tuple[list[Resource], list[str]]:
    """Stoker's running Slurm jobs with processes on this host, as resources of kind ``slurm``.

    Args:
        jobs: job signals by job folder name; a Slurm job whose folder is not among them has
            an unknown state (never stopped).

    Returns:
        The resources, and notes on what could not be listed (no Slurm answering).
    """
    try:
        nodes = local_nodes()
        running = stoker_jobs()
    except SlurmError as e:
        return [], [f"Slurm jobs not listed: {e}"]
    resources = []
    for job_id, key, start in running:
        pids = job_pids(job_id, nodes)
        if not pids:
            continue  # it runs on other hosts: their guards judge it
        job = jobs.get(key)
        errors = () if job else (f"job folder {key} not found under the work folder: its "
                                 "progress is unknown",)
        resources.append(Resource(
            kind="slurm", id=job_id, name=f"{JOB_PREFIX}{key}", devices=None, pids=pids,
            started_at=_start_time(start), jobs=(job,) if job else (),
            flow_run_id=job.flow_run_id if job else None, errors=errors))
    return resources, []


class SlurmActor:
    """Stops Stoker's Slurm jobs as ``stoker stop`` does: SIGTERM to the batch shell and every
    step (the ranks commit a stop checkpoint), ``scancel`` after ``stop_timeout_s``.

    Args:
        stop_timeout_s: seconds between SIGTERM and ``scancel`` (more than
            ``train.preemption_grace_s``).
        poll_s: seconds between two looks at the job while it stops.
    """

    kind = "slurm"

    def __init__(self, stop_timeout_s: float = 60.0, poll_s: float = 1.0):
        self.stop_timeout_s, self.poll_s = stop_timeout_s, poll_s

    def act(self, resource: Resource) -> ActionResult:
        try:
            record = job_record(resource.id)
        except SlurmError as e:
            return ActionResult("failed", f"Slurm: {e}")
        if record is None:
            return ActionResult("gone", f"Slurm job {resource.id} no longer known")
        name = record.get("JobName", "")
        if not name.startswith(JOB_PREFIX) or \
                record.get("Comment") != COMMENT_PREFIX + name.removeprefix(JOB_PREFIX):
            return ActionResult("refused", f"Slurm job {resource.id} ({name}) has no "
                                f"{COMMENT_PREFIX}<job> comment matching its name")
        if record.get("JobState") != "RUNNING":
            return ActionResult("gone", f"Slurm job {resource.id} is {record.get('JobState')}")
        try:
            state = stop_gracefully(resource.id, self.stop_timeout_s, self.poll_s)
        except SlurmError as e:
            return ActionResult("failed", f"Slurm: {e}")
        if state == "CANCELLED":
            return ActionResult("stopped", f"Slurm job {resource.id} did not end within "
                                f"stop_timeout_s {self.stop_timeout_s:g} after SIGTERM: "
                                "scancel")
        return ActionResult("stopped", f"Slurm job {resource.id} stopped after SIGTERM "
                            f"(stop checkpoint): {state}")
