"""Typed, validated configuration for the pipeline and the training runtime.

Every model is frozen; defaults run on a laptop CPU. A config comes from defaults, then an optional
YAML file, then dotted command-line overrides (``train.epochs=3``), merged by OmegaConf and
validated by pydantic. Errors name the field: ``train.lr: must be > 0, got -1``.

This module imports no Prefect: the training runtime uses it inside the training container.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from stoker.runtime.listing import control_characters
from stoker.tracking.pricing import PriceTable

_SCP_LIKE = re.compile(r"^[\w.-]+@[\w.-]+:")  # git@github.com:owner/repo.git


def is_local(url: str) -> bool:
    """Whether ``url`` names a local path (not ``scheme://`` nor ``user@host:path``)."""
    return "://" not in url and not _SCP_LIKE.match(url)


def resolve_repo_url(url: str, cwd: Path | None = None) -> str:
    """An absolute path for a local repository path (``src``, ``./src``, ``~/repo``,
    ``file:///abs``, ``file://localhost/abs``; percent-escapes decoded), resolved against ``cwd``
    (default: the current directory); URLs unchanged.

    Raises:
        ValueError: a ``file://`` URL that names another host (``file://nope/x``) or no path.
    """
    if url.startswith("file://"):
        parts = urlparse(url)
        if parts.netloc not in ("", "localhost"):  # git would read file://nope as the cwd
            raise ValueError(f"a file URL must not name a host (here {parts.netloc!r}): give "
                             "file:///absolute/path or a plain path")
        if not parts.path:
            raise ValueError("a file URL without a path: give file:///absolute/path")
        return str(Path(unquote(parts.path)).resolve())
    if not is_local(url):
        return url
    return str((Path(cwd or os.getcwd()) / Path(url).expanduser()).resolve())


DEMO_MODEL = "stoker-digits"


def dataset_model_name(repo_url: str, path: str) -> str:
    """``<repository name>-<path>`` with characters other than letters, digits, ``._-`` as ``-``:
    ``/home/me/flowers.git`` + ``data/images`` -> ``flowers-data-images``."""
    repo = repo_url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].removesuffix(".git")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{repo}-{path}").strip("-.") or DEMO_MODEL


class ConfigError(ValueError):
    """A configuration value is invalid; the message names each offending field."""


def _takes_numbers_not_bools(annotation: Any) -> bool:
    """Whether a field typed ``annotation`` takes an int or float but no bool."""
    found: set[Any] = set()
    stack = [annotation]
    while stack:
        kind = stack.pop()
        found.add(kind)
        stack.extend(typing.get_args(kind))
    return bool(found & {int, float}) and not found & {bool, Any}


class _Frozen(BaseModel):
    # No inf/NaN floats: `train.lr=inf` must be refused, not train to NaN.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info) -> Any:
        """``train.epochs=true`` is refused (pydantic would read it as 1)."""
        if isinstance(value, bool) and _takes_numbers_not_bools(
                cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


class DataConfig(_Frozen):
    """Where the dataset lives: a git repository with DVC-tracked data, pinned to a revision."""

    repo_url: str | None = Field(
        None,
        description="Git URL or path of the data repository; a relative path is resolved "
        "against the directory the config is loaded in. Empty: the demo digits repository "
        "that Stoker creates (once) inside the work directory.",
    )
    rev: str = Field("v1", description="Git revision (tag, branch or commit) to pull.")
    path: str = Field("data/digits", description="DVC-tracked directory inside the repository.")
    remote: str | None = Field(None, description="DVC remote name; empty: the repository default.")

    @field_validator("rev", "path")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("path")
    @classmethod
    def _inside_the_repository(cls, value: str) -> str:
        """``data/fruit/``, ``./data/fruit`` and ``data/fruit.dvc`` (its DVC file) all name
        ``data/fruit``; an absolute path or one that climbs out with ``..`` is refused."""
        raw = value.strip()
        path = PurePosixPath(raw)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError("not inside the repository: give the DVC-tracked directory "
                             "relative to the repository's root (e.g. data/images)")
        text = str(path)  # drops a trailing slash and ./ segments
        if path.suffix == ".dvc" and path.name != ".dvc":
            text = text.removesuffix(".dvc")  # the tracked directory's DVC file: the same data
        if text in ("", "."):
            raise ValueError("must name a DVC-tracked directory, not the repository's root")
        return text

    @field_validator("repo_url")
    @classmethod
    def _absolute_repo(cls, value: str | None) -> str | None:
        # Resolved here, in the user's process: Prefect may run the pull in another directory.
        if value is None or not value.strip():
            return None
        return resolve_repo_url(value.strip())

    # The value as given, before _absolute_repo resolved it: whether it was a relative path
    # (for the hint of a missing folder). Not a field: not dumped, not in the forms.
    _repo_url_given: str | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_the_given_repo_url(cls, data: Any, handler):
        model = handler(data)
        given = data.get("repo_url") if isinstance(data, dict) else None
        if isinstance(given, str):
            model._repo_url_given = given.strip()
        return model

    @property
    def repo_url_was_relative(self) -> bool:
        """Whether ``repo_url`` was given as a relative local path (``src``, ``../repo``), in
        this process; False for an absolute path, ``~/…``, a URL, or a value only known
        resolved (a config read back from Prefect's parameters)."""
        given = self._repo_url_given
        return bool(given) and is_local(given) and not given.startswith("~") \
            and not Path(given).is_absolute()


class HangConfig(_Frozen):
    """How the launcher finds a hung attempt (see docs/explanation/hangs.md); seconds."""

    enabled: bool = Field(True, description="Watch the ranks' heartbeats; a hang ends the "
                          "attempt as an infrastructure failure (137), retried from the last "
                          "committed checkpoint.")
    step_factor: float = Field(10.0, gt=1, description="A step hangs once no rank progressed "
                               "for this many observed step times (at least step_floor_s).")
    step_floor_s: float = Field(120.0, gt=0, description="The least time without progress "
                                "that counts as a hung step, s.")
    startup_s: float = Field(900.0, gt=0, description="Time allowed without progress before "
                             "the first steps (imports, data, resume), s.")
    eval_s: float = Field(600.0, gt=0, description="Time allowed for one evaluation, s.")
    checkpoint_s: float = Field(600.0, gt=0, description="Time allowed for one checkpoint "
                                "save, s.")
    warmup_steps: int = Field(3, gt=0, description="Steps seen before step times count.")


class TrainConfig(_Frozen):
    """How to train. Batch sizes are global (summed over ranks) so that a job can resume at
    another world size on the same data order."""

    model: str = Field(
        "small_cnn",
        description="Built-in model name (small_cnn; resnet18, resnet34, resnet50 need "
        "torchvision: the vision extra) or 'module:callable' returning a torch.nn.Module given "
        "num_classes.",
    )
    dataset: str = Field(
        "image_folder",
        description="Dataset factory: image_folder (class folders of images, streamed) or "
        "'module:callable' taking (data_dir, seed, val_fraction) and returning Splits.",
    )
    channels: Literal["auto", 1, 3] = Field(
        "auto", description="Image channels for image_folder: 1 (grayscale), 3 (RGB), or auto "
        "(3 if any image is in colour, else 1). Stored with the registered model.",
    )
    image_size: int | None = Field(
        None, gt=0, description="image_folder: square input size in pixels (images are "
        "resized, or randomly cropped when random_resized_crop is set); empty: the images' own "
        "size, which they must then share. Stored with the registered model.")
    image_mean: tuple[float, ...] | None = Field(
        None, description="image_folder: per-channel mean subtracted after scaling to [0, 1] "
        "(e.g. [0.485, 0.456, 0.406]); empty: 0. Stored with the registered model.")
    image_std: tuple[float, ...] | None = Field(
        None, description="image_folder: per-channel divisor after the mean; empty: 1.")
    random_resized_crop: tuple[float, float] | None = Field(
        None, description="image_folder training augmentation: random crop of this area range "
        "(e.g. [0.08, 1.0]) resized to image_size; empty: off. Never applied to validation.")
    horizontal_flip: bool = Field(
        False, description="image_folder training augmentation: random horizontal flip.")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in backward (built-in models)."
    )
    channels_last: bool = Field(False, description="Channels-last memory format (CUDA convs).")
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP gradient compression hook."
    )
    epochs: int = Field(12, gt=0, description="Passes over the training split.")
    global_batch_size: int = Field(
        64, gt=0, description="Samples per optimizer step, over all ranks and micro-batches."
    )
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (one-cycle schedule).")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    seed: int = Field(0, ge=0, description="Seed for the split, the data order and the init.")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Share of samples held out.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision; fp16 adds a gradient scaler (CUDA only)."
    )
    deterministic: bool = Field(
        True, description="Deterministic kernels (bitwise-exact resume); slower on GPU."
    )
    nproc_per_node: int | Literal["auto"] = Field(
        "auto", description="Processes per node; auto: one per GPU, or 2 on a CPU-only machine."
    )
    checkpoint_every_steps: int | None = Field(50, gt=0, description="Save every N steps.")
    checkpoint_every_s: float | None = Field(None, gt=0, description="Save every T seconds.")
    keep_latest_k: int = Field(3, gt=0, description="Committed checkpoints kept.")
    keep_best_metric: str | None = Field(
        None, description="Also keep the committed checkpoint with the best value of this "
        "validation metric (e.g. val_accuracy), beyond the latest k.")
    keep_best_direction: Literal["max", "min"] = Field(
        "max", description="Whether larger or smaller keep_best_metric values are better.")
    on_no_usable_checkpoint: Literal["restart", "refuse"] = Field(
        "restart", description="When checkpoint folders exist but none can be loaded: restart "
        "from step 0 (warned loudly, tagged on the MLflow run) or refuse (exit 2).")
    async_checkpoint: bool = Field(
        False, description="Write checkpoints in a background thread after a host copy."
    )
    log_every_steps: int = Field(
        1, gt=0, description="Write a progress event (loss, lr, throughput of that step) every "
        "N optimizer steps (and at the last).")
    metrics_every_steps: int = Field(
        10, gt=0, description="Send MLflow train_loss (the mean over the steps since its last "
        "value), lr and samples_per_s every N optimizer steps (and at the last); 1: a value per "
        "step. Each value costs rank 0 about 0.08 ms of CPU with the sqlite store.")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    max_cost_usd: float | None = Field(
        None, gt=0, description="Job-wide budget in USD (all attempts and runs of the job, at "
        "cost.prices): near it (within one progress interval) the job commits a checkpoint and "
        "stops (exit 5); rerun with a higher value to resume. Empty: no limit.")
    max_duration: float | None = Field(
        None, gt=0, description="Job-wide billed wall time, in seconds or with a unit (90m, "
        "12h, 2d), over all attempts and runs of the job: near it the job commits a checkpoint "
        "and stops (exit 5). Empty: no limit.")
    data_timeout_s: float = Field(
        300.0, ge=0, description="Seconds a rank waits for one batch from its DataLoader "
        "workers (num_workers > 0) before it kills them and the attempt ends as an "
        "infrastructure failure, retried from the last checkpoint: a hung or frozen worker does "
        "not freeze the job. 0: wait forever.")
    preemption_grace_s: float = Field(
        25.0, gt=0, description="Seconds the runtime has to save after SIGTERM before torchrun "
        "kills it (torchrun --shutdown-timeout)."
    )
    hang: HangConfig = Field(default_factory=HangConfig, description="Hang detection: "
                             "per-section timeouts of the launcher's watchdog.")
    preemption_notice_url: str | None = Field(
        None, description="Cloud preemption-notice endpoint to poll (AWS spot instance-action)."
    )
    preemption_notice_interval_s: float = Field(
        5.0, gt=0, description="Seconds between polls of preemption_notice_url."
    )
    profile_steps: int | None = Field(
        None, gt=0, description="Record a torch.profiler trace of this many steps (after 5 "
        "warm-up steps) on every rank, saved for Perfetto/TensorBoard and logged to MLflow."
    )
    fail_at_step: int | None = Field(
        None, gt=0, description="Testing aid: raise a RuntimeError at this step (simulated bug)."
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        builtin = ("small_cnn", "resnet18", "resnet34", "resnet50")
        module, _, attr = value.partition(":")
        if value not in builtin and not (module and attr):
            raise ValueError(f"unknown model {value!r}: use {', '.join(builtin)} or "
                             "'module:callable'")
        return value

    @field_validator("max_duration", mode="before")
    @classmethod
    def _duration_s(cls, value: Any) -> Any:
        """``90m``, ``12h``, ``2d``, ``3600s`` as seconds; a number stays as it is."""
        if isinstance(value, str) and (m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*",
                                                         value)):
            return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"expected seconds or a duration like 90m, 12h, 2d, got "
                                 f"{value!r}") from None
        return value

    @field_validator("image_std")
    @classmethod
    def _positive_std(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if value is not None and any(v <= 0 for v in value):
            raise ValueError(f"must be > 0 per channel, got {list(value)}")
        return value

    @field_validator("random_resized_crop")
    @classmethod
    def _crop_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0 < value[0] <= value[1] <= 1:
            raise ValueError(f"must be [min, max] with 0 < min <= max <= 1, got {list(value)}")
        return value

    @field_validator("nproc_per_node")
    @classmethod
    def _positive_nproc(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"must be > 0 or 'auto', got {value}")
        return value

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainConfig:
        if self.checkpoint_every_steps is None and self.checkpoint_every_s is None:
            raise ValueError("checkpoint_every_steps: set it or checkpoint_every_s (or both)")
        check_batch(self.global_batch_size, self.grad_accum_steps,
                    self.nproc_per_node if isinstance(self.nproc_per_node, int) else 1)
        return self


def check_batch(global_batch_size: int, grad_accum_steps: int, world_size: int) -> None:
    """The global batch must split evenly over ranks and micro-batches.

    Raises:
        ValueError: ``global_batch_size: must be a multiple of ...`` naming both factors.
    """
    per_step = grad_accum_steps * world_size
    if global_batch_size % per_step:
        factors = f"grad_accum_steps ({grad_accum_steps})"
        if world_size > 1:
            factors += f" x processes ({world_size}) = {per_step}"
        raise ValueError(f"global_batch_size: must be a multiple of {factors}, "
                         f"got {global_batch_size}")


class TrackingConfig(_Frozen):
    """MLflow tracking and model registry settings."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; empty: sqlite:///<work_dir>/mlflow.db."
    )
    experiment: str | None = Field(
        None, description="MLflow experiment name; empty: one experiment per registered model, "
        "named after it.")
    registered_model: str | None = Field(
        None, description="Registered model name; empty: derived from the dataset "
        "(<repository>-<path>, e.g. flowers-data-images), stoker-digits for the demo data.")
    promote_metric: str = Field("val_accuracy", description="Metric the promotion gate compares.")
    promote_direction: Literal["max", "min"] = Field(
        "max", description="Whether larger or smaller values of promote_metric are better."
    )
    ui_url: str | None = Field(
        None, description="MLflow UI base URL for links in reports; empty: the tracking URI when "
        "it is http(s)."
    )
    system_metrics_interval_s: float | None = Field(
        10.0, gt=0, description="MLflow system metrics sampling period; empty: off."
    )

    @field_validator("experiment", "registered_model", "promote_metric")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        if value is not None and (char := control_characters(value)) is not None:
            raise ValueError(f"contains the control character {char}")
        return value

    @field_validator("tracking_uri", "ui_url")
    @classmethod
    def _known_scheme(cls, value: str | None, info) -> str | None:
        if value is None:
            return value
        scheme = value.partition("://")[0].split("+")[0].lower() if "://" in value else ""
        allowed = TRACKING_SCHEMES if info.field_name == "tracking_uri" else ("http", "https")
        if scheme not in allowed and not (scheme == "" and info.field_name == "tracking_uri"):
            raise ValueError(f"unsupported scheme {scheme or 'none'!r} (use "
                             f"{', '.join(s + '://' for s in allowed)})")
        return value


# Stores MLflow's client opens by URI scheme (``postgresql+psycopg2://`` counts as postgresql);
# a plain path is a local file store.
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file",
                    "databricks")


class RetryConfig(_Frozen):
    """Separate retry budgets per way an attempt can end."""

    max_preemptions: int = Field(20, ge=0, description="Preempted attempts resumed (exit 75).")
    max_infra_failures: int = Field(2, ge=0, description="Attempts killed (SIGKILL/137) resumed.")
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
    gpus: str = Field("all", description="GPUs per container: 'all', a count, or '0' for CPU.")
    shm_size: str = Field("16g", description="/dev/shm size per container.")
    user: str | None = Field(None, description="uid:gid in the container; empty: yours.")
    docker_host: str | None = Field(None, description="Docker Engine URL; empty: DOCKER_HOST "
                                    "or the local socket.")
    rdzv_port: int = Field(29400, gt=0, lt=65536, description="c10d rendezvous port (node 0).")


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


class PipelineConfig(_Frozen):
    """The whole main job: data, training, tracking. The deployments' forms (stoker/forms.py)
    hold a grouped subset of it and build it."""

    work_dir: Path = Field(
        Path("work"), description="Where datasets, checkpoints and the embedded stores live."
    )
    job_id: str | None = Field(
        None, description="Name of the job (a folder under work_dir/jobs): resumed if it "
        "exists (with its own dataset and trajectory), else a new job of that name; empty: "
        "resume the unfinished job of the same config, or start a new one.",
    )
    checkpoint_dir: str | None = Field(
        None, description="Durable home of every job (path or fsspec URL, e.g. "
        "s3://bucket/jobs; credentials from the environment): committed checkpoints, the "
        "attempt record, the MLflow run id and the run spec, per job. The job folders in "
        "work_dir become a cache, so a job resumes on another machine. Empty: "
        "<work_dir>/jobs.")
    job_lease_s: float = Field(
        60.0, ge=3, description="Seconds a job stays owned by a flow run that stopped renewing "
        "its lease (the run died): after that another run may take the job over, and the "
        "job's training processes and containers stop (checkpoint, exit 75).")
    train_timeout_s: float | None = Field(
        None, gt=0, description="Fail the train task after this many seconds (all attempts); "
        "the whole torchrun process tree is terminated."
    )
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    retry: RetryConfig = RetryConfig()
    cost: CostConfig = CostConfig()
    launcher: LauncherConfig = LauncherConfig()

    @model_validator(mode="after")
    def _containers_need_a_server(self) -> PipelineConfig:
        kind = self.launcher.kind
        if kind != "local" and not self.tracking_uri().startswith(("http://", "https://")):
            raise ValueError(
                f"tracking.tracking_uri: launcher.kind={kind} logs from containers or nodes to "
                "an MLflow tracking server over HTTP (they cannot reach a sqlite file): start one "
                "(`mlflow server --host 127.0.0.1`) and set tracking.tracking_uri=http://…")
        return self

    def registered_model(self) -> str:
        """The registered model name: the configured one, else one derived from the dataset
        (repository + path) so that a user's model never lands in the demo's entry."""
        if self.tracking.registered_model:
            return self.tracking.registered_model
        if self.data.repo_url is None:
            return DEMO_MODEL
        return dataset_model_name(self.data.repo_url, self.data.path)

    def experiment(self) -> str:
        """The MLflow experiment: the configured one, else the registered model's name (one
        experiment per model lineage, so its runs are compared side by side)."""
        return self.tracking.experiment or self.registered_model()

    @field_validator("job_id")
    @classmethod
    def _job_folder_name(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", value):
            raise ValueError("not a folder name: use letters, digits, '.', '_' or '-' (at most "
                             "128, starting with a letter or digit)")
        return value

    @field_validator("checkpoint_dir")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        if "://" not in value:  # a path: absolute, so that every process reads the same one
            return str(Path(value).expanduser().resolve())
        scheme = value.split("://", 1)[0]
        if not re.match(r"^[a-z][a-z0-9+.-]*$", scheme):
            raise ValueError(f"not a path or URL: {value!r}")
        return value.rstrip("/")

    def job_store_url(self) -> str | None:
        """``checkpoint_dir`` when set (None: job state lives in ``<work_dir>/jobs`` only)."""
        return self.checkpoint_dir

    def tracking_uri(self) -> str:
        """The MLflow tracking URI, defaulting to a sqlite store in the work directory."""
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        return f"sqlite:///{self.work_dir.resolve() / 'mlflow.db'}"


_FIELD_MESSAGE = re.compile(r"^([a-z_][a-z0-9_.]*): (.+)$", re.S)


def _field_names(model: type[BaseModel] | None, path: tuple) -> list[str]:
    """The field names of the model found at ``path`` inside ``model`` ([] when unknown)."""
    for part in path:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return []
        options = [field.annotation, *typing.get_args(field.annotation)]
        model = next((t for t in options if isinstance(t, type) and issubclass(t, BaseModel)),
                     None)
    return list(getattr(model, "model_fields", {}))


def _unknown_field(model: type[BaseModel] | None, loc: tuple) -> str:
    close = difflib.get_close_matches(str(loc[-1]), _field_names(model, loc[:-1]), n=1)
    return f"unknown field; did you mean {close[0]!r}?" if close else "unknown field"


def format_validation_error(error: ValidationError, prefix: str = "",
                            model: type[BaseModel] | None = None) -> str:
    """Render a pydantic error as one line per field: ``train.lr: must be > 0, got -1``;
    with ``model``, an unknown field names the closest known one (``did you mean 'epochs'?``)."""
    lines = []
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"] if part != "__root__")
        name = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "config"
        message = item["msg"].removeprefix("Value error, ")
        named = _FIELD_MESSAGE.match(message) if item["type"] == "value_error" else None
        if named:  # a model validator naming its field: `train.` + `global_batch_size: ...`
            name = f"{name}.{named[1]}" if loc else f"{prefix}{named[1]}"
            message = named[2]
        elif (item["type"] not in ("missing", "extra_forbidden") and "input" in item and loc
              and "got " not in message and not isinstance(item["input"], dict | list)):
            message = f"{message}, got {item['input']!r}"
        if item["type"] == "extra_forbidden":
            message = _unknown_field(model, item["loc"])
        elif item["type"] == "string_type" and isinstance(item.get("input"), int | float | bool):
            kind = "boolean" if isinstance(item["input"], bool) else "number"
            message += f" (YAML read it as a {kind}: quote it, e.g. " \
                       f"{name}=\"'{item['input']}'\")"
        line = f"{name}: {message}"
        if line not in lines:  # a union field reports once per member
            lines.append(line)
    return "; ".join(lines)


def validate(model: type[BaseModel], values: dict[str, Any], prefix: str = ""):
    """Build ``model`` from plain values, raising ConfigError that names each bad field."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix, model)) from None


def load_pipeline_config(
    config_file: Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Merge defaults, a YAML file and ``a.b=value`` overrides into a validated PipelineConfig.

    Raises:
        ConfigError: the file is missing or not a mapping, an override is malformed, or a value
            fails validation (the message names the field).
    """
    return load_config(PipelineConfig, config_file, overrides)


def load_config(model: type[BaseModel], config_file: Path | None = None,
                overrides: list[str] | None = None):
    """Merge ``model``'s defaults, a YAML file and ``a.b=value`` overrides into a validated model.

    Raises:
        ConfigError: the file is missing or not a mapping, an override is malformed, or a value
            fails validation (the message names the field).
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = []
    if config_file is not None:
        if not Path(config_file).is_file():
            raise ConfigError(f"config file {config_file}: not found")
        try:
            loaded = OmegaConf.load(config_file)
        except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"config file {config_file}: not valid YAML: {e}") from None
        if not OmegaConf.is_dict(loaded):
            raise ConfigError(f"config file {config_file}: must hold a mapping of fields")
        layers.append(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected field=value, e.g. train.epochs=3")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides or [])))
        merged = OmegaConf.to_container(OmegaConf.merge(*layers) if layers else OmegaConf.create())
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: {e}") from None
    return validate(model, merged)
