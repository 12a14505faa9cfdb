"""Typed, frozen settings of the cost guard: the decision policy and what it may act on.

The ``cost-guard`` deployment's form (stoker/forms.py) builds it. Errors name the field, as in
:mod:`stoker.config`: ``policy.window_s: must be >= sample_interval_s (10.0), got 5.0``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from stoker.config import _Frozen
from stoker.tracking.pricing import CapacityType, PriceTable


class Policy(_Frozen):
    """When a resource counts as idle or stalled, and when the guard may act on it."""

    window_s: float = Field(
        60.0, gt=0, description="Each sweep samples every GPU over this many seconds.")
    sample_interval_s: float = Field(5.0, gt=0, description="Seconds between two samples.")
    min_samples: int = Field(
        3, ge=2, description="Fewer samples of a GPU in the window make its state unknown.")
    idle_utilization_percent: float = Field(
        5.0, ge=0, le=100, description="A GPU is idle only if no sample exceeds this utilization.")
    idle_memory_mib: float = Field(
        512.0, ge=0, description="A GPU is idle only if no sample holds more memory than this.")
    idle_timeout_s: float = Field(
        1800.0, gt=0, description="A training heartbeat fresher than this keeps a resource busy.")
    min_idle_s: float = Field(
        600.0, ge=0, description="Observed idle time (across sweeps) before an idle resource is "
        "stopped; 0 stops it on the first idle window.")
    warmup_grace_s: float = Field(
        900.0, ge=0, description="Resources younger than this are never judged idle or stalled.")
    stall_utilization_percent: float = Field(
        0.0, ge=0, le=100, description="Utilization at or below this counts as 'zero' for stalls.")
    stall_timeout_s: float = Field(
        1800.0, gt=0, description="A job holding GPU memory at zero utilization whose heartbeat "
        "has not advanced for this long is stalled.")
    stop_idle: bool = Field(True, description="Stop idle resources (unless dry_run).")
    stop_stalled: bool = Field(
        False, description="Stop stalled jobs gracefully (SIGTERM, so they checkpoint); "
        "false: report them only.")

    @property
    def samples_per_window(self) -> int:
        """Samples one sweep takes: one at the start, then one every ``sample_interval_s``."""
        return int(self.window_s // self.sample_interval_s) + 1

    @model_validator(mode="after")
    def _window_holds_samples(self) -> Policy:
        if self.window_s < self.sample_interval_s:
            raise ValueError(f"window_s must be >= sample_interval_s ({self.sample_interval_s}), "
                             f"got {self.window_s}")
        if self.samples_per_window < self.min_samples:
            raise ValueError(
                f"window_s/sample_interval_s gives {self.samples_per_window} samples, fewer than "
                f"min_samples ({self.min_samples})")
        return self


class DockerTarget(_Frozen):
    """Docker containers labelled ``dev.stoker.owned=true`` on one engine."""

    enabled: bool = Field(True, description="Judge and stop Stoker-owned containers.")
    base_url: str | None = Field(
        None, description="Docker Engine URL; empty: the environment (DOCKER_HOST or the socket).")
    label_filters: list[str] = Field(
        default_factory=list, description="Further label filters ('key' or 'key=value'), all of "
        "which a container must match, on top of the ownership label.")
    stop_timeout_s: float = Field(
        60.0, ge=0, description="Seconds between SIGTERM and SIGKILL; leave room for a checkpoint "
        "(more than train.preemption_grace_s).")

    @field_validator("label_filters")
    @classmethod
    def _filters_not_blank(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.strip() or item.startswith("="):
                raise ValueError(f"each filter must be 'key' or 'key=value', got {item!r}")
        return value


class PrefectTarget(_Frozen):
    """Prefect flow runs of Stoker jobs (tagged ``stoker:owned``)."""

    enabled: bool = Field(True, description="Cancel the flow runs of idle or stalled local jobs.")


class SlurmTarget(_Frozen):
    """Stoker's Slurm jobs (named ``stoker-<job>``, comment ``stoker-job=<job>``) running on
    this host's Slurm nodes."""

    enabled: bool = Field(
        False, description="Judge and stop Stoker's Slurm jobs with processes on this host "
        "(needs Slurm's client commands and SLURM_CONF, and a user that may scancel them).")
    stop_timeout_s: float = Field(
        60.0, ge=0, description="Seconds between SIGTERM (stop checkpoint) and scancel; leave "
        "room for a checkpoint (more than train.preemption_grace_s).")


class Ec2Target(_Frozen):
    """The EC2 instance (tagged ``stoker:owned=true``) whose GPUs this guard watches."""

    instance_id: str | None = Field(
        None, description="Instance the guard runs on; empty: no instance is judged or stopped.")
    region: str | None = Field(None, description="AWS region; empty: boto3's default.")
    endpoint_url: str | None = Field(
        None, description="EC2 API endpoint; empty: AWS. Set for AWS-compatible APIs.")

    @field_validator("instance_id")
    @classmethod
    def _instance_id_shape(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("i-"):
            raise ValueError(f"must look like i-0123456789abcdef0, got {value!r}")
        return value


class CostGuardConfig(_Frozen):
    """One cost-guard sweep: what to read, how to decide, what it may act on."""

    work_dir: Path = Field(
        Path("work"), description="Stoker work directory: jobs are read from <work_dir>/jobs and "
        "the guard's state is kept in <work_dir>/costguard.")
    dry_run: bool = Field(
        True, description="Decide and report, act on nothing. The safe default: set false once "
        "the reports look right.")
    policy: Policy = Policy()
    docker: DockerTarget = DockerTarget()
    prefect: PrefectTarget = PrefectTarget()
    slurm: SlurmTarget = SlurmTarget()
    ec2: Ec2Target = Ec2Target()
    prices: PriceTable = PriceTable()
    capacity_type: CapacityType = Field(
        "on_demand", description="Capacity type of this host's GPUs, for the $ estimate.")
    read_mlflow: bool = Field(
        True, description="Also use each job's MLflow run (last metric time) as progress.")
    nvml_module: str = Field(
        "pynvml", description="Python module with the NVML API. Testing aid: point it at a fake "
        "module with the same functions.")

    @property
    def state_file(self) -> Path:
        """Where idle streaks are remembered between sweeps."""
        return self.work_dir / "costguard" / "state.json"
