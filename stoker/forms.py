"""What each deployment asks for: small parameter models that build the full configuration.

``PipelineConfig`` holds every knob of every launcher; a deployment's form should hold the ones
that deployment uses. Each form here picks fields of the config models (same types, defaults,
checks and descriptions: stoker/config.py stays the one source of defaults), groups them as the
config does, and keeps every other field reachable through ``overrides`` (``field=value`` lines,
as on the command line). ``to_config()`` returns the validated full config.

No Prefect here: the flows in flows/ take these models as their parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from stoker.config import (
    ConfigError,
    DataConfig,
    DockerLauncherConfig,
    PipelineConfig,
    RetryConfig,
    SlurmLauncherConfig,
    TrackingConfig,
    TrainConfig,
    validate,
)
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.config import Policy as GuardPolicy
from stoker.tracking.pricing import CapacityType


class _Form(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class _DeploymentForm(_Form):
    """A deployment's whole form; subclasses' ``to_config()`` build the full validated
    configuration (raising ConfigError naming a bad field)."""

    @model_validator(mode="after")
    def _valid_config(self):
        # Checked when the run starts (Prefect validates parameters first): a bad combination
        # fails the run before any data is pulled, naming the field.
        try:
            self.to_config()
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self


def _pick(name: str, model: type[BaseModel], fields: list[str], doc: str,
          base: type[BaseModel] = _Form, **more: Any) -> type[BaseModel]:
    """A form group holding ``fields`` of ``model`` exactly as declared there."""
    picked = {f: (model.model_fields[f].annotation, model.model_fields[f]) for f in fields}
    return create_model(name, __base__=base, __doc__=doc, __module__=__name__, **picked, **more)


OVERRIDES_HELP = (
    "Any other setting, one per line as field=value (e.g. train.weight_decay=0.01, "
    "retry.backoff_s=5, cost.capacity_type=spot); applied last. Every field is listed in the "
    "configuration reference.")

Data = _pick("Data", DataConfig, ["repo_url", "rev", "path", "remote"],
             "The dataset: a git repository with DVC-tracked data, pinned to a revision.")
Train = _pick("Train", TrainConfig,
              ["model", "epochs", "global_batch_size", "lr", "precision", "nproc_per_node",
               "image_size", "checkpoint_every_steps", "seed", "max_cost_usd"],
              "How to train (batch sizes are global: summed over all processes), and the job's "
              "budget.",
              # seconds, or text with a unit (90m, 12h, 2d): TrainConfig reads both
              max_duration=(float | str | None, Field(
                  None, description=TrainConfig.model_fields["max_duration"].description)))
TrainOnly = Train
Tracking = _pick("Tracking", TrackingConfig,
                 ["tracking_uri", "experiment", "registered_model", "promote_metric",
                  "promote_direction", "ui_url", "plot_curves"],
                 "Where runs and models are recorded (MLflow), and how a new model is promoted.")
TrainTracking = _pick("Tracking", TrackingConfig, ["tracking_uri", "experiment", "ui_url"],
                      "Where runs are recorded (MLflow).")
ServerTracking = _pick(
    "ServerTracking", TrackingConfig, ["experiment", "registered_model", "promote_metric",
                                       "promote_direction", "ui_url", "plot_curves"],
    "Where runs and models are recorded (MLflow), and how a new model is promoted.",
    tracking_uri=(str, Field(description="MLflow tracking server URL (http://host:port) that the "
                             "training containers log to.", pattern=r"^https?://")))
Retry = _pick("Retry", RetryConfig, ["max_preemptions", "max_infra_failures", "max_user_errors"],
              "How many times an attempt is resumed, per way it can end.")
Docker = _pick("Docker", DockerLauncherConfig, ["image", "nnodes", "gpus", "shm_size"],
               "The training containers (one per node) on this Docker host.")
Slurm = _pick("Slurm", SlurmLauncherConfig, ["nodes", "gpus_per_node", "time_limit_min",
                                             "partition", "account", "qos"],
              "The batch job of each attempt: one Stoker launcher per node (srun).")


class _JobForm(_DeploymentForm):
    """Fields every training deployment shares; subclasses add their groups."""

    work_dir: Path = PipelineConfig.model_fields["work_dir"]
    job_id: str | None = PipelineConfig.model_fields["job_id"]
    overrides: list[str] = Field(default_factory=list, description=OVERRIDES_HELP)

    def _values(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"overrides"})

    def to_config(self) -> PipelineConfig:
        """The validated full configuration.

        Raises:
            ConfigError: an override is malformed or a value is invalid (named, e.g.
                ``train.lr: must be > 0, got -1``).
        """
        return _merged(PipelineConfig, self._values(), self.overrides)


class PipelineForm(_JobForm):
    """Pull the dataset, train on this machine (torchrun), register the model in MLflow."""

    data: Data = Data()
    train: Train = Train()
    tracking: Tracking = Tracking()
    retry: Retry = Retry()


class TrainForm(_JobForm):
    """Pull the dataset and train on this machine (torchrun); no registration."""

    data: Data = Data()
    train: TrainOnly = TrainOnly()
    tracking: TrainTracking = TrainTracking()
    retry: Retry = Retry()


class DockerPipelineForm(_JobForm):
    """Pull the dataset, train in the training image's containers, register the model."""

    data: Data = Data()
    train: Train = Train()
    docker: Docker = Docker()
    tracking: ServerTracking
    retry: Retry = Retry()

    def _values(self) -> dict[str, Any]:
        values = super()._values()
        values["launcher"] = {"kind": "docker", "docker": values.pop("docker")}
        return values


class SlurmPipelineForm(_JobForm):
    """Pull the dataset, train as a Slurm batch job across nodes, register the model."""

    data: Data = Data()
    train: Train = Train()
    slurm: Slurm = Slurm()
    tracking: ServerTracking
    retry: Retry = Retry()

    def _values(self) -> dict[str, Any]:
        values = super()._values()
        values["launcher"] = {"kind": "slurm", "slurm": values.pop("slurm")}
        return values


Policy = _pick("Policy", GuardPolicy, list(GuardPolicy.model_fields),
               "When a GPU counts as idle or a job as stalled, and what may be stopped.")


class CostGuardForm(_DeploymentForm):
    """One cost-guard sweep of this host: what it reads, how it decides, what it may stop."""

    work_dir: Path = CostGuardConfig.model_fields["work_dir"]
    dry_run: bool = CostGuardConfig.model_fields["dry_run"]
    capacity_type: CapacityType = CostGuardConfig.model_fields["capacity_type"]
    policy: Policy = Policy()
    overrides: list[str] = Field(default_factory=list, description=(
        "Any other setting, one per line as field=value (e.g. docker.enabled=false, "
        "ec2.instance_id=i-0123456789abcdef0, read_mlflow=false); applied "
        "last. Every field is listed in the configuration reference."))

    def to_config(self) -> CostGuardConfig:
        """The validated sweep configuration (ConfigError names a bad field)."""
        return _merged(CostGuardConfig, self.model_dump(mode="json", exclude={"overrides"}),
                       self.overrides)


def _merged(model: type[BaseModel], values: dict[str, Any], overrides: list[str]):
    """``values`` with ``field=value`` overrides on top, validated as ``model``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    lines = [line.strip() for line in overrides if line.strip()]
    for line in lines:
        if "=" not in line:
            raise ConfigError(f"overrides: expected field=value, e.g. train.epochs=3, got {line!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.create(values), OmegaConf.from_dotlist(lines))
        plain = OmegaConf.to_container(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"overrides: {e}") from None
    return validate(model, plain)
