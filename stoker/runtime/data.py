"""Datasets and the global data order.

The order of samples is a function of (seed, epoch) alone; each optimizer step takes the next
``global_batch_size`` samples of that order and splits them into equal contiguous shards, one per
rank (and micro-batch). The position in the data is therefore just the global step, and a job can
resume at another world size without repeating or skipping a sample.
"""

from __future__ import annotations

import importlib
import math
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

# The listing (no torch): also what the orchestrator's dataset check reads.
from stoker.runtime.listing import (  # noqa: F401 - re-exported
    GRAY_MODES,
    IGNORED_NAMES,
    DataError,
    class_folders,
    image_files,
    visible,
)
from stoker.runtime.split import split_sizes, steps_per_epoch


@dataclass(frozen=True)
class Splits:
    """Train and validation datasets; items are ``(x: float32 [C,H,W], y: int64 [])``."""

    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    classes: tuple[str, ...] = ()


MEMO_BYTES = 64 * 2**20  # decoded images kept per process for a small dataset (see image_folder)
def read_image(file: Path, channels: int | None) -> np.ndarray:
    """One image as uint8 [H, W, C]: C = ``channels``, or for None 1 (gray) / 3 (colour) by mode.

    Raises:
        OSError, PIL.UnidentifiedImageError: not a readable image.
    """
    from PIL import Image

    from stoker.runtime.pixels import to_model_mode

    with Image.open(file) as image:
        gray = channels == 1 or (channels is None and image.mode in GRAY_MODES)
        image = to_model_mode(image, 1 if gray else 3)
        return np.asarray(image, dtype=np.uint8).reshape(image.height, image.width,
                                                         1 if gray else 3)


def load_image_folder(root: Path, channels: int | Literal["auto"] = "auto"
                      ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Decode a whole small ImageFolder at once (tools and tests; training streams instead),
    through the same listing and decoding as :func:`image_folder`.

    Args:
        channels: 1 (grayscale), 3 (RGB), or "auto": 3 if any image is in colour, else 1.

    Returns:
        images: float32 tensor [N, C, H, W] scaled to [0, 1]; labels: int64 [N]; class names
        (sorted folder names; label i is classes[i]).

    Raises:
        DataError: no class folders, an empty class, an unreadable image, or images of
            different sizes (named).
    """
    from stoker.runtime.imagefolder import Preprocessing, decode, load_file_list

    files = load_file_list(Path(root))
    if files.size is None:
        raise DataError(f"{root}: images have different sizes")
    depth = (3 if files.colour else 1) if channels == "auto" else int(channels)
    prep = Preprocessing(*files.size, depth, (0.0,) * depth, (1.0,) * depth)
    images = torch.stack([decode(files.path(i), prep, None) for i in range(len(files.labels))])
    return images, torch.from_numpy(files.labels), list(files.classes)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/validation split of ``range(n)``: (train_idx, val_idx), both sorted."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    _, n_val = split_sizes(n, val_fraction)  # the orchestrator's check counts the same way
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def image_folder(data_dir: str, seed: int, val_fraction: float,
                 channels: int | Literal["auto"] = "auto", *, image_size: int | None = None,
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                 crop_scale: tuple[float, float] | None = None, hflip: bool = False,
                 job_dir: str | None = None) -> Splits:
    """Built-in dataset factory: a streaming ImageFolder split by seed (nothing decoded here).

    Args:
        channels: 1, 3, or "auto" (3 if any image is in colour).
        image_size: square output size; None: the images' own size (all must share it).
        mean, std: per-channel normalisation (None: 0 and 1).
        crop_scale, hflip: training augmentation (random resized crop area range, flip).
        job_dir: where the file list is cached when the dataset is not a pulled DVC folder.

    Raises:
        DataError: the folder is not an ImageFolder, sizes differ without ``image_size``,
            or mean/std do not have one value per channel (named).
    """
    from stoker.runtime.imagefolder import Preprocessing, StreamingImageFolder, load_file_list

    # Headers are read (once, then cached) only when size or channels are left to the data.
    probe = image_size is None or channels == "auto"
    files = load_file_list(Path(data_dir), Path(job_dir) if job_dir else None, probe)
    depth = (3 if files.colour else 1) if channels == "auto" else int(channels)
    if image_size is not None:
        height = width = int(image_size)
    elif files.size is not None:
        height, width = files.size
    else:
        raise DataError(f"{data_dir}: images have different sizes; set train.image_size "
                        "(square side in pixels) to resize them")
    for name, values in (("image_mean", mean), ("image_std", std)):
        if values is not None and len(values) != depth:
            raise DataError(f"train.{name} has {len(values)} value(s) for {depth} channel(s)")
    prep = Preprocessing(height, width, depth, tuple(mean or (0.0,) * depth),
                         tuple(std or (1.0,) * depth), crop_scale, hflip=hflip)
    train_idx, val_idx = split_indices(len(files.labels), val_fraction, seed)
    # A dataset whose decoded images fit in MEMO_BYTES is decoded once (without workers): the
    # demo keeps its speed; anything larger streams, and memory stays bounded either way.
    pixels = math.prod(files.size or (2**31, 1)) + height * width  # a decoded image, a sample
    small = len(files.labels) * pixels * depth * 4 <= MEMO_BYTES
    return Splits(
        train=StreamingImageFolder(files, train_idx.numpy(), prep, augment=True, seed=seed,
                                   memo={} if small else None),
        val=StreamingImageFolder(files, val_idx.numpy(), prep.evaluation(),
                                 memo={} if small else None),
        num_classes=len(files.classes),
        input_shape=(depth, height, width),
        classes=files.classes,
    )


def build_splits(factory: str, data_dir: str, seed: int, val_fraction: float,
                 channels: int | Literal["auto"] = "auto", **image_options) -> Splits:
    """Resolve ``factory`` ("image_folder" or "module:callable") and build the splits
    (``channels`` and ``image_options`` apply to image_folder, see :func:`image_folder`)."""
    if factory == "image_folder":
        return image_folder(data_dir, seed, val_fraction, channels, **image_options)
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
        self.steps_per_epoch = steps_per_epoch(n, global_batch_size)
        self.micro = global_batch_size // (world_size * grad_accum_steps)

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.accum

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.steps_per_epoch):
            batch = self.order[step * self.global_batch:(step + 1) * self.global_batch]
            for k in range(self.accum):
                shard = self.rank * self.accum + k
                yield batch[shard * self.micro:(shard + 1) * self.micro].tolist()


TRAIN, VAL = "train", "val"
VAL_BATCH_SIZE = 512  # validation samples per batch (evaluation needs no gradients)


def val_batches(n: int, rank: int, world_size: int,
                batch_size: int = VAL_BATCH_SIZE) -> list[list[int]]:
    """This rank's validation batches: every ``world_size``-th sample of ``n`` from ``rank``, in
    batches of up to ``batch_size`` (none where the rank has no sample)."""
    mine = list(range(rank, n, world_size))
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


class AttemptBatches(Sampler[list[tuple[str, int, int]]]):
    """Every batch one rank reads in one attempt, in the order the trainer reads them: from
    ``start_step`` on, each step's ``grad_accum_steps`` micro-batches (as
    :class:`StepBatchSampler`), and after an epoch's last step that epoch's validation batches
    (:func:`val_batches`). Items are lists of :class:`AttemptData` keys: ``("train", epoch, i)``
    and ``("val", epoch, i)``.

    One DataLoader iterator over it serves the whole attempt, so its worker processes are forked
    once, when the attempt starts, not again for every epoch and every evaluation: a fork in a
    rank whose other threads are busy can hang the child forever (CPython gh-112275, before
    3.11.8), and a trial saw one hang in about 1,900 such forks.
    """

    def __init__(self, n_train: int, n_val: int, seed: int, start_step: int, epochs: int,
                 global_batch_size: int, grad_accum_steps: int, rank: int, world_size: int):
        self.n_train, self.n_val, self.seed, self.epochs = n_train, n_val, seed, epochs
        self.start_step, self.global_batch, self.accum = start_step, global_batch_size, \
            grad_accum_steps
        self.rank, self.world = rank, world_size
        self.steps_per_epoch = steps_per_epoch(n_train, global_batch_size)
        self.val = val_batches(n_val, rank, world_size)

    def __len__(self) -> int:
        epoch, first = divmod(self.start_step, self.steps_per_epoch)
        epochs_left = max(0, self.epochs - epoch)
        return max(0, self.epochs * self.steps_per_epoch - self.start_step) * self.accum \
            + epochs_left * len(self.val)

    def __iter__(self) -> Iterator[list[tuple[str, int, int]]]:
        epoch, first = divmod(self.start_step, self.steps_per_epoch)
        for e in range(epoch, self.epochs):
            steps = StepBatchSampler(self.n_train, self.seed, e, first if e == epoch else 0,
                                     self.global_batch, self.accum, self.rank, self.world)
            for batch in steps:
                yield [(TRAIN, e, i) for i in batch]
            for batch in self.val:
                yield [(VAL, e, i) for i in batch]


class AttemptData(Dataset):
    """The train and validation splits behind :class:`AttemptBatches`' keys. A training sample
    of epoch ``e`` comes from ``train.for_epoch(e)`` where the split has that method (its
    augmentation is seeded by (seed, epoch, sample)), else from ``train`` itself."""

    def __init__(self, train: Dataset, val: Dataset):
        self.train, self.val = train, val
        self._epoch: int | None = None
        self._view = train

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    def __getitem__(self, key: tuple[str, int, int]):
        split, epoch, i = key
        if split == VAL:
            return self.val[i]
        if epoch != self._epoch and hasattr(self.train, "for_epoch"):
            self._view, self._epoch = self.train.for_epoch(epoch), epoch
        return self._view[i]


class DataStall(RuntimeError):
    """No batch came from the DataLoader workers within ``train.data_timeout_s``: a worker hangs
    or is frozen (or the storage under it stalls). The attempt ends as an infrastructure
    failure."""


class DataWatchdog:
    """Ends a rank's wait for a batch that does not come.

    The rank marks each wait (:meth:`next_batch`); a thread checks about once a second, and a
    wait longer than ``timeout_s`` SIGKILLs the rank's child processes (its DataLoader workers),
    which breaks the wait wherever it blocks: on the batch queue, or in the read of a shared
    tensor's file descriptor from a worker, which a frozen worker (SIGSTOP, a cgroup freezer)
    never answers and which the DataLoader's own ``timeout`` does not cover. :meth:`next_batch`
    then raises :class:`DataStall`, whatever the DataLoader raised. Start it after the workers
    are forked (a thread that exists at a fork is what gh-112275 needs).

    Args:
        timeout_s: seconds one wait may take (``train.data_timeout_s``); 0: no watchdog.
    """

    def __init__(self, timeout_s: float):
        import threading

        self.timeout_s = timeout_s
        self.stalled = False  # it fired: the workers were killed for a stalled wait
        self._since: float | None = None  # when the current wait began (monotonic s)
        self._closed = threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="data-watchdog",
                                            daemon=True)
            self._thread.start()

    def next_batch(self, batches: Iterator):
        """``next(batches)``, watched.

        Raises:
            DataStall: the wait took longer than ``timeout_s`` (names train.data_timeout_s).
            StopIteration: ``batches`` is exhausted.
        """
        import time

        self._since = time.monotonic()
        try:
            return next(batches)
        except Exception:
            if self.stalled:
                raise self.error() from None
            raise
        finally:
            self._since = None

    def error(self) -> DataStall:
        return DataStall(
            f"no batch from the DataLoader workers in {self.timeout_s:g} s "
            "(train.data_timeout_s): a data worker hangs or is frozen, or the storage it reads "
            "from stalls")

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        import time

        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self.stalled = True
                kill_children()
                return


def kill_children() -> None:
    """SIGKILL this process's descendants (a rank's DataLoader workers): a worker that hangs in
    ``fork()`` has the stop signals held and no watchdog of its own, and a frozen one takes
    nothing else, so either would outlive the rank."""
    import contextlib

    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()


def loader_workers(batches: object) -> list:
    """The worker processes (``multiprocessing.Process``: ``pid``, ``exitcode``) of a DataLoader
    iterator, read from torch's ``_workers``; [] for one without workers, or None."""
    return list(getattr(batches, "_workers", None) or [])


def data_worker_killed(error: BaseException, workers: list | tuple = ()) -> str | None:
    """``"DataLoader worker (pid N) was killed by SIGKILL"`` when ``error`` is the DataLoader's
    report of a worker killed by SIGKILL (the OOM killer's usual victim, or a ``kill -9``);
    None for anything else (a worker that raised, or died of another signal).

    The DataLoader says so in one of two ways: its SIGCHLD report ("is killed by signal:
    Killed"), perhaps as the cause of "exited unexpectedly"; or "DataLoader worker (pid(s) N)
    exited unexpectedly" alone, when the death broke the transfer of a batch (CI: a
    ConnectionRefusedError of the worker's shared-memory handle came first). That one names no
    signal: the exit code of worker N among ``workers`` (:func:`loader_workers` of the rank's
    iterator) says whether it was SIGKILL.
    """
    codes = {getattr(w, "pid", None): getattr(w, "exitcode", None) for w in workers}
    seen = set()
    while error is not None and id(error) not in seen:  # its causes too: killed mid-wait, the
        seen.add(id(error))  # DataLoader raises "exited unexpectedly" from the SIGCHLD report
        found = re.search(r"DataLoader worker \(pid (\d+)\) is killed by signal: Killed",
                          str(error))
        if found:
            return f"DataLoader worker (pid {found[1]}) was killed by SIGKILL"
        if found := re.search(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly",
                              str(error)):
            for pid in (int(p) for p in found[1].split(",") if p.strip()):
                if codes.get(pid) == -signal.SIGKILL:
                    return f"DataLoader worker (pid {pid}) was killed by SIGKILL"
        error = error.__cause__ or error.__context__
    return None


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
