"""Datasets and the global data order.

The order of samples is a function of (seed, epoch) alone; each optimizer step takes the next
``global_batch_size`` samples of that order and splits them into equal contiguous shards, one per
rank (and micro-batch). The position in the data is therefore just the global step, and a job can
resume at another world size without repeating or skipping a sample.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, TensorDataset


class DataError(RuntimeError):
    """The dataset folder cannot be read as the configured dataset."""


@dataclass(frozen=True)
class Splits:
    """Train and validation datasets; items are ``(x: float32 [C,H,W], y: int64 [])``."""

    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    classes: tuple[str, ...] = ()


def load_image_folder(root: Path) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Read ``root/<class>/<file>.png`` as grayscale images.

    Returns:
        images: float32 tensor [N, 1, H, W] scaled to [0, 1]; labels: int64 [N]; class names
        (sorted folder names; label i is classes[i]).

    Raises:
        DataError: no class folders, an unreadable image, or images of different sizes (named).
    """
    from PIL import Image, UnidentifiedImageError

    classes = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not classes:
        raise DataError(f"{root}: no class folders (expected <class>/<image> files)")
    arrays, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted((root / name).iterdir()):
            try:
                with Image.open(file) as image:
                    arrays.append(np.asarray(image.convert("L"), dtype=np.uint8))
            except (UnidentifiedImageError, OSError) as e:
                raise DataError(f"{file}: not a readable image ({e})") from None
            if arrays[-1].shape != arrays[0].shape:
                raise DataError(
                    f"{file}: size {arrays[-1].shape} differs from {arrays[0].shape}"
                )
            labels.append(label)
    images = torch.from_numpy(np.stack(arrays)).unsqueeze(1).float().div_(255.0)
    return images, torch.tensor(labels, dtype=torch.int64), classes


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/validation split of ``range(n)``: (train_idx, val_idx), both sorted."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * val_fraction))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def image_folder(data_dir: str, seed: int, val_fraction: float) -> Splits:
    """Built-in dataset factory: an ImageFolder of same-size images, split by seed."""
    images, labels, classes = load_image_folder(Path(data_dir))
    train_idx, val_idx = split_indices(len(labels), val_fraction, seed)
    return Splits(
        train=TensorDataset(images[train_idx], labels[train_idx]),
        val=TensorDataset(images[val_idx], labels[val_idx]),
        num_classes=len(classes),
        input_shape=tuple(images.shape[1:]),
        classes=tuple(classes),
    )


def build_splits(factory: str, data_dir: str, seed: int, val_fraction: float) -> Splits:
    """Resolve ``factory`` ("image_folder" or "module:callable") and build the splits."""
    if factory == "image_folder":
        return image_folder(data_dir, seed, val_fraction)
    module, _, attr = factory.partition(":")
    if not attr:
        raise DataError(f"train.dataset {factory!r}: expected 'image_folder' or 'module:callable'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise DataError(f"train.dataset {factory!r}: cannot import ({e})") from None
    return fn(data_dir, seed, val_fraction)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The global sample order of ``epoch``: a permutation of range(n) fixed by (seed, epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class StepBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches for the steps ``start_step..steps_per_epoch-1`` of one
    epoch. Each step's global batch is split into ``world_size * grad_accum_steps`` equal
    contiguous shards; this rank gets shards ``rank*accum .. rank*accum+accum-1``.
    """

    def __init__(self, n: int, seed: int, epoch: int, start_step: int, global_batch_size: int,
                 grad_accum_steps: int, rank: int, world_size: int):
        self.order = epoch_order(n, seed, epoch)
        self.start_step = start_step
        self.global_batch = global_batch_size
        self.accum = grad_accum_steps
        self.rank = rank
        self.world = world_size
        self.steps_per_epoch = n // global_batch_size
        self.micro = global_batch_size // (world_size * grad_accum_steps)

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.accum

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.steps_per_epoch):
            batch = self.order[step * self.global_batch:(step + 1) * self.global_batch]
            for k in range(self.accum):
                shard = self.rank * self.accum + k
                yield batch[shard * self.micro:(shard + 1) * self.micro].tolist()


def check_divisible(global_batch_size: int, grad_accum_steps: int, world_size: int) -> None:
    """Refuse a world size that cannot split the global batch into equal shards.

    Raises:
        DataError: naming train.global_batch_size, the world size and the accumulation steps.
    """
    if global_batch_size % (world_size * grad_accum_steps):
        raise DataError(
            f"train.global_batch_size={global_batch_size} cannot be split evenly over world size "
            f"{world_size} x grad_accum_steps {grad_accum_steps}; pick a world size that divides "
            f"{global_batch_size // grad_accum_steps} (the data order is defined per global batch)"
        )
