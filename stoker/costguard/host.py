"""This host's side of a cost-guard sweep: discovery of its containers, Slurm jobs, local jobs
and instance, the actors that can stop them, and ``sweep_host``, one sweep with the real NVML
binding, Docker Engine and EC2 API (:func:`stoker.costguard.sweep.run_sweep` does the judging).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stoker.costguard.actions import Actor, DockerActor, Ec2Actor
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.inventory import (
    Resource,
    claimed_jobs,
    discover_containers,
    discover_jobs,
    host_instance,
    jobs_by_name,
)
from stoker.costguard.nvml import NvmlReader, load_nvml
from stoker.costguard.signals import read_jobs
from stoker.costguard.sweep import Discover, SweepReport, run_sweep


def discover_all(config: CostGuardConfig, docker_client: Any | None) -> Discover:
    """Discovery over this host: Stoker containers (if a client is given), Stoker's Slurm jobs
    (if enabled), local jobs and the configured instance. Containers or Slurm jobs that cannot
    be listed become a note, not a failure."""

    def discover() -> tuple[list[Resource], list[str]]:
        policy = config.policy
        # MLflow matters only where the heartbeat alone would let a job count as idle or stalled.
        jobs = read_jobs(config.work_dir, read_mlflow=config.read_mlflow,
                         mlflow_if_older_than_s=min(policy.idle_timeout_s, policy.stall_timeout_s))
        notes = [f"job {j.name}: {n}" for j in jobs for n in j.notes]
        resources: list[Resource] = []
        if docker_client is not None:
            import docker.errors
            import requests

            try:
                resources += discover_containers(docker_client, config.docker.label_filters,
                                                 jobs_by_name(jobs))
            except (docker.errors.DockerException, requests.RequestException) as e:
                notes.append(f"Docker containers not listed: {e}")
        if config.slurm.enabled:  # a Slurm job's processes are judged as that job
            from stoker.costguard.slurm import discover_slurm_jobs

            slurm_jobs, slurm_notes = discover_slurm_jobs(jobs_by_name(jobs))
            resources, notes = resources + slurm_jobs, notes + slurm_notes
        resources += discover_jobs(jobs, claimed_jobs(resources))
        if config.ec2.instance_id:
            resources.append(host_instance(config.ec2.instance_id, jobs))
        return resources, notes

    return discover


def connect_docker(config: CostGuardConfig) -> tuple[Any | None, str | None]:
    """A Docker client for ``config.docker`` (None when disabled), or why none could be made."""
    if not config.docker.enabled:
        return None, None
    import docker
    import requests

    try:
        client = (docker.DockerClient(base_url=config.docker.base_url) if config.docker.base_url
                  else docker.from_env())
        client.ping()
    except (docker.errors.DockerException, requests.RequestException) as e:
        return None, f"Docker Engine unreachable, containers not judged: {e}"
    return client, None


def standard_actors(config: CostGuardConfig, docker_client: Any | None) -> dict[str, Actor]:
    """The Docker actor (if a client is given), the Slurm actor (if enabled) and the EC2 actor
    (if an instance is set)."""
    actors: dict[str, Actor] = {}
    if docker_client is not None:
        actors["container"] = DockerActor(docker_client, config.docker.stop_timeout_s)
    if config.slurm.enabled:
        from stoker.costguard.slurm import SlurmActor

        actors["slurm"] = SlurmActor(config.slurm.stop_timeout_s)
    if config.ec2.instance_id:
        actors["instance"] = Ec2Actor.connect(config.ec2.region, config.ec2.endpoint_url)
    return actors


def sweep_host(config: CostGuardConfig, extra_actors: Mapping[str, Actor] | None = None
               ) -> SweepReport:
    """One sweep of this host with the real NVML binding, Docker Engine and EC2 API.

    Args:
        config: what to read, how to decide, what may be acted on.
        extra_actors: further actors by kind (the Prefect actor for jobs lives in ``tasks/``).

    Returns:
        The report; an unreachable Docker Engine is a note in it, not a failure.
    """
    client, note = connect_docker(config)
    actors = {**standard_actors(config, client), **(extra_actors or {})}
    discover = discover_all(config, client)

    def discover_with_note() -> tuple[list[Resource], list[str]]:
        resources, notes = discover()
        return resources, [note, *notes] if note else notes

    try:
        with NvmlReader(load_nvml(config.nvml_module)) as reader:
            return run_sweep(config, reader, discover_with_note, actors)
    finally:
        if client is not None:
            client.close()
