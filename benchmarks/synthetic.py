"""A synthetic image dataset for the GPU benchmark, usable as ``train.dataset``.

``train.dataset: benchmarks.synthetic:imagenet_like`` with ``data_dir`` pointing at a folder
that holds ``synthetic.json``::

    {"train_samples": 12800, "val_samples": 512, "image_size": 224, "num_classes": 1000}

Items are float32 [3, S, S] images drawn from a small pool of random tensors (so a large
dataset costs little memory) with labels ``i % num_classes``. The data path (DataLoader,
collation, host-to-device copy) is the runtime's own; only the files are missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

from stoker.runtime.data import DataError, Splits

POOL = 64  # distinct random images; item i is pool[i % POOL]


class SyntheticImages(Dataset):
    """``n`` items ``(x: float32 [3, size, size], y: int64 [])``, deterministic in ``seed``."""

    def __init__(self, n: int, size: int, num_classes: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(min(n, POOL), 3, size, size, generator=generator)
        self.n, self.num_classes = n, num_classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool[i % len(self.pool)], torch.tensor(i % self.num_classes)


def write_config(data_dir: Path, train_samples: int, val_samples: int, image_size: int,
                 num_classes: int) -> Path:
    """Write ``data_dir/synthetic.json`` and return ``data_dir``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "synthetic.json").write_text(json.dumps(
        {"train_samples": train_samples, "val_samples": val_samples, "image_size": image_size,
         "num_classes": num_classes}))
    return data_dir


def imagenet_like(data_dir: str, seed: int, val_fraction: float) -> Splits:
    """Dataset factory (``module:callable`` form): splits described by ``synthetic.json``.

    ``val_fraction`` is ignored: the file gives both sizes.

    Raises:
        DataError: ``synthetic.json`` is missing or lacks a field (named).
    """
    path = Path(data_dir) / "synthetic.json"
    try:
        conf = json.loads(path.read_text())
        size, classes = int(conf["image_size"]), int(conf["num_classes"])
        train = SyntheticImages(int(conf["train_samples"]), size, classes, seed)
        val = SyntheticImages(int(conf["val_samples"]), size, classes, seed + 1)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: not a synthetic dataset description ({e!r})") from None
    return Splits(train=train, val=val, num_classes=classes, input_shape=(3, size, size),
                  classes=tuple(str(c) for c in range(classes)))
