"""The run spec: everything one training job needs, written by the orchestrator as a YAML file."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field

from stoker.config import ConfigError, TrainConfig, _Frozen, validate
from stoker.runtime import private

# Train fields that define the run's trajectory: a checkpoint written under other values cannot
# be continued exactly, so resuming with a change is refused (the trainer, and the orchestrator
# before anything starts). Here, not in the trainer, so that the orchestrator reads them without
# importing torch.
TRAJECTORY_FIELDS = ("model", "dataset", "epochs", "global_batch_size", "grad_accum_steps", "lr",
                     "weight_decay", "seed", "val_fraction", "precision", "image_size",
                     "image_mean", "image_std", "random_resized_crop", "horizontal_flip")

class RunSpec(_Frozen):
    """One training job. The same spec file both starts and resumes the job.

    Paths are absolute; ``checkpoint_dir`` may be any fsspec URL (``s3://bucket/job``).
    """

    train: TrainConfig = TrainConfig()
    data_dir: str = Field(description="Local dataset folder (an ImageFolder for built-ins).")
    job_dir: str = Field(description="Local folder for progress, heartbeat and results.")
    checkpoint_dir: str | None = Field(
        None, description="Checkpoint location (path or fsspec URL); empty: <job_dir>/checkpoints."
    )
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; empty: no tracking.")
    experiment: str = "stoker"
    artifact_location: str | None = Field(
        None, description="Artifact root for a newly created experiment (embedded store only)."
    )
    run_name: str | None = None
    system_metrics_interval_s: float | None = Field(
        10.0, gt=0, description="Sample MLflow system metrics (CPU, memory, GPU via NVML) this "
        "often; empty: off.")
    tags: dict[str, str] = Field(default_factory=dict, description="Lineage tags for the run.")
    log_model: bool = Field(
        False, description="With tracking: rank 0 logs the completed job's model to its MLflow "
        "run as a pyfunc (registered by the pipeline). The orchestrator turns it on where the "
        "ranks run its own Python environment (local, Slurm); off: the orchestrator logs it.")
    lease_token: str | None = Field(
        None, description="Token of the job lease this run trains under; the runtime stops "
        "(checkpoint, exit 75) once <job_dir>/lease.json no longer holds it. Empty: no watch.")

    @property
    def checkpoint_location(self) -> str:
        return self.checkpoint_dir or str(Path(self.job_dir) / "checkpoints")

    def dump(self, path: Path) -> None:
        """Write the spec as YAML (atomically: a reader never sees half a file)."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        private.write_text(tmp, yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        """Read and validate a spec file.

        Raises:
            ConfigError: the file is missing, not YAML, or a field is invalid (named).
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"run spec {path}: not found")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"run spec {path}: not valid YAML: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"run spec {path}: must hold a mapping of fields")
        return validate(cls, values)
