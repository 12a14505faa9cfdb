"""The pipeline config's ``train`` section: the model, data shape, optimisation, precision,
checkpoint cadence, hang and straggler detection and budgets. Part of :mod:`stoker.config`, which
re-exports every model here; the training runtime reads it inside the image."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stoker.config_base import _Frozen


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


class StragglerConfig(_Frozen):
    """How rank 0 finds a slow rank (see docs/explanation/hangs.md#slow-ranks-stragglers)."""

    enabled: bool = Field(True, description="Measure each rank's own step time and data wait, "
                          "log them to MLflow and warn about a slow rank (world size > 1).")
    threshold: float = Field(1.5, gt=1, description="A rank is a straggler when its own step "
                             "time is at least this many times the ranks' (lower) median.")
    window_steps: int = Field(50, gt=0, description="Steps per window: the per-rank times are "
                              "means over a window, logged and checked when it closes.")
    windows: int = Field(2, gt=0, description="Consecutive windows a rank must be over the "
                         "threshold before it is reported (one noisy window is not enough).")
    min_window_s: float = Field(30.0, ge=0, description="A window also lasts at least this many "
                                "seconds: on fast steps, 50 steps are a second or two, where "
                                "another process's burst reads as a slow rank.")


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
        64, gt=0, description="Samples per optimizer step, over all ranks and micro-batches; "
        "at most the dataset's training split (checked before the pull for a repository on "
        "this machine, from its .dvc file's file count, and right after the pull)."
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
    keep_latest_k: int = Field(
        3, gt=0, description="Committed checkpoints kept (on the local disk, plus one spare "
        "shared.pt that the next save overwrites).")
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
    straggler: StragglerConfig = Field(default_factory=StragglerConfig, description="Slow "
                                       "ranks: per-rank step times and the straggler warning.")
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
