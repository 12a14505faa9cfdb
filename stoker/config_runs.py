"""The pipeline config's orchestrator-side sections: retry budgets, the launchers (local,
docker, kubernetes, slurm) and what the GPUs cost. Part of :mod:`stoker.config`, which
re-exports every model here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from stoker.config_base import _Frozen, refuse_option_like
from stoker.tracking.pricing import PriceTable


class RetryConfig(_Frozen):
    """Separate retry budgets per way an attempt can end, counted within one run of the job
    (one ``stoker run``, one flow run): running the same command again starts them afresh."""

    max_preemptions: int = Field(20, ge=0, description="Preempted attempts resumed (exit 75), "
                              "per run of the job.")
    max_infra_failures: int = Field(2, ge=0, description="Attempts killed (SIGKILL/137) or hung "
                                 "resumed, per run of the job.")
    max_user_errors: int = Field(0, ge=0, description="Attempts failing in user code retried.")
    backoff_s: float = Field(1.0, ge=0, description="First backoff; doubles per attempt.")
    backoff_max_s: float = Field(60.0, ge=0, description="Longest backoff.")
    on_demand_after_preemptions: int | None = Field(
        None, gt=0, description="After this many preemptions switch spot capacity to on-demand "
        "(recorded on the run; passed to launchers that can choose capacity).")
    resume_stalled: bool = Field(
        False, description="Resume a job the cost guard stopped because it stalled. Off: the "
        "next run of that job refuses in one line (exit 3) naming the step, so it is not "
        "resumed into the same stall; `stoker run --resume-stalled` sets it.")


class DockerLauncherConfig(_Frozen):
    """How the docker launcher runs the training image (one container per node)."""

    image: str | None = Field(
        None, description="Training image reference; empty: build (or reuse) it from images/ "
        "with the build-image flow and use its digest.")
    nnodes: int = Field(1, ge=1, description="Containers (nodes) on this Docker host.")
    gpus: str = Field("all", description="GPUs per container: 'all', a count, or 0 for CPU "
                      "(a host without NVIDIA's container runtime needs 0).")
    shm_size: str = Field("16g", description="/dev/shm size per container.")
    user: str | None = Field(None, description="uid:gid in the container; empty: yours.")
    docker_host: str | None = Field(None, description="Docker Engine URL; empty: DOCKER_HOST "
                                    "or the local socket.")
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="c10d rendezvous port (node 0).")

    @field_validator("image")
    @classmethod
    def _not_an_option(cls, value: str | None) -> str | None:
        return refuse_option_like(value, "docker", "an image reference starts with its "
                                  "registry or repository name (e.g. 127.0.0.1:5000/stoker/train)")

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_count(cls, value: Any) -> Any:
        """``gpus=0`` or ``gpus=2`` from an override (read as a number) is the count as text;
        anything but ``all`` or a count is refused here, not by the engine at the first node."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return str(value)
        if isinstance(value, str) and (value == "all" or value.isdigit()):
            return value
        raise ValueError(f"expected 'all', a count (e.g. 2) or 0 for CPU, got {value!r}")


class SlurmLauncherConfig(_Frozen):
    """How the slurm launcher submits an attempt: one batch job, one launcher per node."""

    nodes: int = Field(1, ge=1, description="Nodes of the batch job (sbatch --nodes); at most "
                       "the partition's, checked before anything is submitted.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (sbatch --gpus-per-node); "
                               "0: CPU only.")
    time_limit_min: int | None = Field(None, gt=0, description="Time limit in minutes "
                                       "(sbatch --time); empty: the partition's.")
    partition: str | None = Field(None, description="Partition (sbatch --partition); empty: "
                                  "the cluster's default. Checked before submitting.")
    account: str | None = Field(None, description="Account charged (sbatch --account).")
    qos: str | None = Field(None, description="Quality of service (sbatch --qos).")
    rdzv_port: int = Field(29500, gt=0, lt=65536, description="Rendezvous port on the "
                           "job's first node.")
    python: str | None = Field(None, description="Python on the nodes (with Stoker and torch); "
                               "empty: the orchestrator's (a shared filesystem).")

    @field_validator("partition", "account", "qos", "python")
    @classmethod
    def _not_an_option(cls, value: str | None, info) -> str | None:
        # Given to sbatch, scontrol and the nodes' shell (exec <python> ...): never an option.
        instead = (f"a path whose name starts with '-' is written ./{value.strip()}"
                   if info.field_name == "python" and value else
                   "no Slurm partition, account or QoS name starts with '-'")
        return refuse_option_like(value, "Slurm" if info.field_name != "python" else "the "
                                  "nodes' shell (exec)", instead)


class LauncherConfig(_Frozen):
    """Where attempts run: local torchrun, Docker containers, a Kubernetes job or Slurm."""

    kind: Literal["local", "docker", "kubernetes", "slurm"] = Field(
        "local", description="local: torchrun here; docker: the training image through the "
        "Docker Engine; kubernetes: a Kubeflow TrainJob/PyTorchJob; slurm: one batch job per "
        "attempt (sbatch, srun per node).")
    docker: DockerLauncherConfig = DockerLauncherConfig()
    slurm: SlurmLauncherConfig = SlurmLauncherConfig()
    kubernetes: dict[str, Any] = Field(
        default_factory=dict,
        description="KubernetesLaunchConfig fields (stoker/launch/kubeflow.py)"
        "; validated when kind is kubernetes.")


class CostConfig(_Frozen):
    """What the job's GPUs cost: capacity type and a price table (USD per GPU-hour)."""

    capacity_type: Literal["on_demand", "spot", "reserved"] = Field(
        "on_demand", description="How the GPUs are bought; selects the price column."
    )
    prices: PriceTable = Field(default_factory=PriceTable,
                               description="USD per GPU-hour by GPU model and capacity type.")
