"""The streaming ImageFolder: files listed once, decoded per sample, seeded augmentation.

Memory per rank holds the file list (two numpy arrays, no per-file Python objects, so
DataLoader workers do not copy it page by page through reference counts) and never the pixels.
Each sample is decoded by Pillow in the DataLoader worker that asks for it, converted to the
training mode (``L`` or ``RGB``), cropped/resized to ``(height, width)``, optionally flipped,
scaled to [0, 1] and normalised.

Exactness: a training sample's random crop and flip come from a generator keyed by
``(seed, epoch, file index)`` alone (:class:`SampleRandom`), never from a worker's RNG stream, so
which worker decodes a sample, how many workers there are, the world size and the step an attempt
resumes at do not change its pixels.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import struct
from dataclasses import dataclass, replace
from hashlib import blake2b
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from stoker.runtime.listing import (
    GRAY_MODES,
    DataError,
    class_folders,
    control_characters,
    image_files,
)
from stoker.runtime.pixels import to_model_mode

log = logging.getLogger("stoker.runtime")

LIST_VERSION = 1
DVC_DIR = re.compile(r"^[0-9a-f]{32}(\.dir)?$")  # a pulled dataset: <datasets>/<md5>/


@dataclass(frozen=True)
class FileList:
    """The samples of an ImageFolder.

    Attributes:
        root: the dataset folder.
        files: bytes array [N] of paths relative to ``root`` (``<class>/<file>``).
        labels: int64 [N]; label i is ``classes[i]``.
        classes: class folder names, sorted.
        size: (height, width) shared by every image, or None when sizes differ.
        colour: whether any image is in colour (auto channels: 3).
    """

    root: Path
    files: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...]
    size: tuple[int, int] | None
    colour: bool

    def path(self, index: int) -> Path:
        return self.root / self.files[index].decode("utf-8", "surrogateescape")

    def location(self, index: int) -> str:
        """:meth:`path` as a string, built without a ``Path`` (per sample: ~0.2 µs, not ~2)."""
        return self._prefix + self.files[index].decode("utf-8", "surrogateescape")

    @functools.cached_property
    def _prefix(self) -> str:
        return os.path.join(self.root, "")


def _probe(file: Path) -> tuple[tuple[int, int], str]:
    """(height, width) and mode from the image header (nothing decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as image:
            return (image.height, image.width), image.mode
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{file}: not a readable image ({e})") from None


def scan_image_folder(root: Path, probe: bool = True) -> dict:
    """List ``root/<class>/<file>`` (hidden entries ignored); with ``probe`` also read each
    image's header (size and mode, nothing decoded).

    Returns:
        The JSON-able listing: ``classes`` ([{name, files}]), ``probed``, and when probed
        ``size`` ([H, W] shared by all, or None) and ``colour`` (bool).

    Raises:
        DataError: no class folders, an empty class, an unreadable image header (named).
    """
    folders = class_folders(root)
    if not folders:
        raise DataError(f"{root}: no class folders (expected <class>/<image> files)")
    classes, sizes, colour = [], set(), False
    for folder in folders:
        if (char := control_characters(folder.name)) is not None:
            raise DataError(f"{folder.parent}/{folder.name!r}: class name contains the control "
                            f"character {char}; rename the folder")
        files = image_files(folder)
        if not files:
            raise DataError(f"{folder}: empty class (no image files)")
        for file in files if probe else ():
            size, mode = _probe(file)
            sizes.add(size)
            colour = colour or mode not in GRAY_MODES
        classes.append({"name": folder.name, "files": [f.name for f in files]})
    size = list(next(iter(sizes))) if len(sizes) == 1 else None
    return {"version": LIST_VERSION, "classes": classes, "probed": probe, "size": size,
            "colour": colour}


def list_cache_path(root: Path, job_dir: Path | None) -> Path | None:
    """Where the file list of ``root`` is cached.

    A pulled dataset (``<datasets>/<md5>/``) is immutable: its list sits beside it as
    ``<datasets>/<md5>.files.json``. Another folder may change, so its list goes to the job
    folder keyed by the folder's path and its class folders' modification times.
    """
    root = root.resolve()
    if DVC_DIR.match(root.name) and os.access(root.parent, os.W_OK):
        return root.parent / f"{root.name.removesuffix('.dir')}.files.json"
    if job_dir is None:
        return None
    stamp = hashlib.sha1(str(root).encode())
    for folder in class_folders(root):
        stamp.update(f"{folder.name}:{folder.stat().st_mtime_ns}".encode())
    return job_dir / "data" / f"files-{stamp.hexdigest()[:16]}.json"


def _read_listing(cache: Path) -> dict | None:
    try:
        listing = json.loads(cache.read_text())
    except (OSError, ValueError):  # absent, or torn by a crash mid-write: list again
        return None
    ok = isinstance(listing, dict) and listing.get("version") == LIST_VERSION
    return listing if ok and isinstance(listing.get("classes"), list) else None


def save_listing(cache: Path, listing: dict) -> None:
    """Write a listing (as :func:`scan_image_folder` returns it) to ``cache`` atomically."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")  # ranks may race: both win
    tmp.write_text(json.dumps(listing))
    tmp.replace(cache)


def load_file_list(root: Path, job_dir: Path | None = None, probe: bool = True) -> FileList:
    """The file list of ``root``, from its cache when there is one (else scanned and cached).

    Args:
        probe: whether the common size and colour are needed (auto size or channels): then
            every header is read once, when the list is first made. Without, only the names
            are listed and ``size`` is None, ``colour`` False.

    Raises:
        DataError: as :func:`scan_image_folder`.
    """
    cache = list_cache_path(root, job_dir)
    listing = _read_listing(cache) if cache is not None else None
    if listing is None or (probe and not listing.get("probed", True)):
        listing = scan_image_folder(root, probe)
        if cache is not None:
            save_listing(cache, listing)
    labels = np.concatenate([np.full(len(c["files"]), i, dtype=np.int64)
                             for i, c in enumerate(listing["classes"])])
    size = tuple(listing["size"]) if listing["size"] else None
    classes = tuple(c["name"] for c in listing["classes"])
    # UTF-8 bytes (any file name, also one that is not valid UTF-8, round-trips): a numpy
    # array rather than a list of str keeps workers from copying it through refcounts. One
    # class at a time, emptied as it goes, so the peak is the listing plus one array.
    parts = []
    for c in listing["classes"]:
        prefix = f"{c['name']}/"
        parts.append(np.array([(prefix + f).encode("utf-8", "surrogateescape")
                               for f in c["files"]], dtype=np.bytes_))
        c["files"] = None
    width = max(p.dtype.itemsize for p in parts)
    encoded = np.concatenate([p.astype(f"S{width}") for p in parts])
    return FileList(root, encoded, labels, classes, size, bool(listing["colour"]))


@dataclass(frozen=True)
class Preprocessing:
    """How a file becomes a float32 [C, H, W] sample.

    Attributes:
        height, width: output size in pixels.
        channels: 1 (``L``) or 3 (``RGB``).
        mean, std: per-channel normalisation after scaling to [0, 1].
        crop_scale: random resized crop area range (fractions of the image) for training, or
            None (resize the whole image).
        crop_ratio: aspect-ratio range of the random crop.
        hflip: random horizontal flip (p = 0.5) for training.
    """

    height: int
    width: int
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = False

    @property
    def random(self) -> bool:
        return self.crop_scale is not None or self.hflip

    @functools.cached_property
    def normalises(self) -> bool:
        return any(m != 0.0 for m in self.mean) or any(s != 1.0 for s in self.std)

    @functools.cached_property
    def mean_tensor(self) -> torch.Tensor:
        return torch.tensor(self.mean, dtype=torch.float32)[:, None, None]

    @functools.cached_property
    def std_tensor(self) -> torch.Tensor:
        return torch.tensor(self.std, dtype=torch.float32)[:, None, None]

    def evaluation(self) -> Preprocessing:
        """The same without augmentation (validation, serving)."""
        return replace(self, crop_scale=None, hflip=False)


_EIGHT_WORDS = struct.Struct("<8Q")


class SampleRandom:
    """The draws of one sample's augmentation: a function of ``(seed, epoch, index)`` alone.

    A counter-mode stream: block k is the BLAKE2b digest (64 bytes, eight 64-bit words) of the
    key and k. Creating one costs about a microsecond; seeding a Mersenne Twister
    (``random.Random``) costs ~5 µs, 4 % of decoding a small PNG, paid for every sample. Offers
    the three draws :func:`crop_box` and the flip use, with ``random.Random``'s meaning.
    """

    __slots__ = ("_key", "_block", "_words", "_next")

    def __init__(self, seed: int, epoch: int, index: int):
        self._key = f"{seed}:{epoch}:{index}:".encode()
        self._block = 0
        self._words = _EIGHT_WORDS.unpack(blake2b(self._key + b"0", digest_size=64).digest())
        self._next = 0

    def _word(self) -> int:
        if self._next == 8:  # a crop that needed several tries: the next block
            self._block += 1
            self._words = _EIGHT_WORDS.unpack(
                blake2b(self._key + str(self._block).encode(), digest_size=64).digest())
            self._next = 0
        self._next += 1
        return self._words[self._next - 1]

    def random(self) -> float:
        """Uniform in [0, 1), 53 bits."""
        return (self._word() >> 11) * 2.0 ** -53

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.random()

    def randint(self, a: int, b: int) -> int:
        """Uniform integer in [a, b] (both included; bias below 2**-40 for spans < 2**24)."""
        return a + self._word() % (b - a + 1)


def sample_rng(seed: int, epoch: int, index: int) -> SampleRandom:
    """The generator of one sample's augmentation (distinct for every (seed, epoch, index))."""
    return SampleRandom(seed, epoch, index)


def crop_box(rng: SampleRandom | random.Random, width: int, height: int, scale: tuple[float, float],
             ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """A random crop (left, top, right, bottom) of area ``scale`` and aspect ``ratio`` (the
    Inception/RandomResizedCrop rule: 10 tries, then the largest centred crop within ratio)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = rng.randint(0, width - w)
            top = rng.randint(0, height - h)
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


@functools.cache
def _pillow():
    """(``PIL.Image``, ``PIL.UnidentifiedImageError``), imported on first use (not per sample)."""
    from PIL import Image, UnidentifiedImageError

    return Image, UnidentifiedImageError


def open_image(path: Path | str, channels: int):
    """One image file, decoded and converted to ``L`` (1 channel) or ``RGB`` (3): a PIL image,
    upright, by :func:`stoker.runtime.pixels.to_model_mode` (the rule training, ``stoker predict``
    and the served model share).

    Raises:
        DataError: the file is not a readable image (named).
    """
    image_module, unidentified = _pillow()
    try:
        with image_module.open(path) as image:
            return to_model_mode(image, channels)
    except (unidentified, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable image ({e})") from None


def transform(image, prep: Preprocessing, rng: SampleRandom | random.Random | None
              ) -> torch.Tensor:
    """A decoded image -> float32 [C, H, W] (``rng`` drives crop/flip; None: no augmentation)."""
    Image = _pillow()[0]  # noqa: N806 - the module's usual name

    size = (prep.width, prep.height)
    if rng is not None and prep.crop_scale is not None:
        box = crop_box(rng, image.width, image.height, prep.crop_scale, prep.crop_ratio)
        image = image.resize(size, Image.Resampling.BILINEAR, box=box)
    elif image.size != size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    if rng is not None and prep.hflip and rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).reshape(
        prep.height, prep.width, prep.channels).copy())
    x = pixels.permute(2, 0, 1).float().div_(255.0)
    if prep.normalises:
        x.sub_(prep.mean_tensor).div_(prep.std_tensor)
    return x


def decode(path: Path | str, prep: Preprocessing,
           rng: SampleRandom | random.Random | None = None) -> torch.Tensor:
    """One image file -> float32 [C, H, W]: :func:`open_image` then :func:`transform`.

    Raises:
        DataError: the file is not a readable image (named).
    """
    return transform(open_image(path, prep.channels), prep, rng)


class StreamingImageFolder(Dataset):
    """A split of a :class:`FileList`; items are ``(x: float32 [C, H, W], y: int)``.

    Args:
        files: the dataset's file list.
        indices: int64 [n] file indices of this split.
        prep: preprocessing; its augmentation applies only when ``augment``.
        seed, epoch: seed the augmentation of each sample with (seed, epoch, file index).
        memo: by file index, the samples (or, augmented, the decoded images), kept across epochs
            in the main process, so a small dataset read without workers (the demo) decodes
            each file once; None: off. One dict per split.
    """

    def __init__(self, files: FileList, indices: np.ndarray, prep: Preprocessing,
                 augment: bool = False, seed: int = 0, epoch: int = 0,
                 memo: dict | None = None):
        self.files, self.indices, self.prep = files, np.asarray(indices, dtype=np.int64), prep
        self.augment, self.seed, self.epoch, self.memo = augment and prep.random, seed, epoch, memo

    def for_epoch(self, epoch: int) -> StreamingImageFolder:
        """The same split with the augmentation of ``epoch``."""
        return StreamingImageFolder(self.files, self.indices, self.prep, self.augment,
                                    self.seed, epoch, self.memo)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        index = int(self.indices[i])
        label = int(self.files.labels[index])
        # Only the main process memoises: each worker would keep its own copy, for the samples
        # it happens to get, until the attempt ends.
        memo = self.memo if self.memo is not None and get_worker_info() is None else None
        if memo is not None and index in memo:
            kept = memo[index]  # the sample itself, or (augmented) the decoded image
            if not self.augment:
                return kept, label
            return transform(kept, self.prep, sample_rng(self.seed, self.epoch, index)), label
        image = open_image(self.files.location(index), self.prep.channels)
        rng = sample_rng(self.seed, self.epoch, index) if self.augment else None
        x = transform(image, self.prep, rng)
        if memo is not None:
            memo[index] = image if self.augment else x
        return x, label
