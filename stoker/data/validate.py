"""Check a pulled ImageFolder before any job exists: every class and every file, one error.

Training reads the same folder with ``stoker.runtime.data.image_folder`` (streaming); both use
the same listing rules (hidden folders and files are not classes nor samples), so the classes
found here are the classes the model is trained on. Sizes may differ (``train.image_size``).

Cost: a file is opened lazily by Pillow (its header gives size and mode) and its structure is
checked without decoding a pixel: a PNG's chunks and CRCs to the end (``Image.verify()``), a
JPEG's end-of-image marker, so a truncated file fails; other formats (and a JPEG without its end
marker) are decoded once. Files are read by a thread pool. A pulled dataset is immutable under its
DVC hash, so the verdict is cached beside it (``<datasets>/<md5>.valid.json``, holding the hash)
and a later pull of the same hash validates nothing. A verdict is only ever read for the hash it
names; a failing dataset is not cached (it is checked again, and named again, each time).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from stoker.data.pull import DatasetError
from stoker.runtime.listing import GRAY_MODES, class_folders, image_files
from stoker.runtime.records import read_json, write_json

MAX_NAMED = 20  # problems named in one message; the count says how many there are in all
VERDICT_VERSION = 1  # bump when the rules change: older verdicts are then not trusted
READERS = min(8, 2 * (os.cpu_count() or 1))  # threads: file reads wait on the disk, not the GIL
BATCH = 256  # files per task of the pool


@dataclass(frozen=True)
class FolderSummary:
    """What an ImageFolder holds.

    Attributes:
        classes: class names, sorted (label i is classes[i]).
        counts: images per class, in the order of ``classes``.
        height, width: image size in pixels when all images share it, else None (training then
            needs ``train.image_size``).
        channels: 1 if every image is grayscale, else 3.
        size_examples: when sizes differ, one file of each of two sizes, as
            ``"32x24 px: <class>/<file>"`` (width x height); empty otherwise.
    """

    classes: tuple[str, ...]
    counts: tuple[int, ...]
    height: int | None
    width: int | None
    channels: int
    size_examples: tuple[str, ...] = ()


JPEG_END = b"\xff\xd9"  # EOI: cannot occur inside a JPEG's entropy-coded data (0xFF is stuffed)
TAIL_BYTES = 1024  # how far from the end a JPEG's EOI may sit (some writers pad after it)


def _jpeg_ends(file: Path) -> bool:
    """Whether the file's last ``TAIL_BYTES`` hold a JPEG end-of-image marker."""
    with file.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
        return JPEG_END in f.read()


def _inspect(file: Path) -> tuple[tuple[int, int], str]:
    """(height, width) and mode of an image from its header, and its structure checked without
    decoding a pixel where the format allows: a PNG's chunks and CRCs to its end
    (``verify()``), a JPEG's end-of-image marker. Any other format, or a JPEG without its end
    marker (truncated, or with data appended), is decoded once to be sure."""
    from PIL import Image

    with Image.open(file) as image:
        size, mode = (image.height, image.width), image.mode
        if image.format == "PNG":
            image.verify()
        elif image.format != "JPEG" or not _jpeg_ends(file):
            image.load()
    return size, mode


@dataclass
class _Tally:
    """What files showed: up to two distinct sizes (one says "all share it"), each with the
    first file that had it, whether any is in colour, the first ``MAX_NAMED`` problems and how
    many there are."""

    sizes: dict[tuple[int, int], str]
    colour: bool
    problems: list[str]
    count: int = 0

    def problem(self, text: str) -> None:
        self.count += 1
        if len(self.problems) < MAX_NAMED:
            self.problems.append(text)

    def merge(self, other: _Tally) -> None:
        for size, example in other.sizes.items():
            if len(self.sizes) < 2:
                self.sizes.setdefault(size, example)
        self.colour = self.colour or other.colour
        self.problems += other.problems[:MAX_NAMED - len(self.problems)]
        self.count += other.count


def _check(folder: Path, names: list[str]) -> _Tally:
    """Inspect ``folder/<name>`` for each name (one task of the pool: a few hundred files, so
    a million files make a few thousand tasks, not a million futures)."""
    from PIL import UnidentifiedImageError

    tally = _Tally({}, False, [])
    for name in names:
        try:
            size, mode = _inspect(folder / name)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # PNG: Syntax
            tally.problem(f"{folder.name}/{name}: not a readable image ({e})")
            continue
        if len(tally.sizes) < 2:
            tally.sizes.setdefault(size, f"{folder.name}/{name}")
        tally.colour = tally.colour or mode not in GRAY_MODES
    return tally


def verdict_path(root: Path, dataset_hash: str) -> Path:
    """Where the verdict of a pulled dataset ``<datasets>/<md5>/`` is cached."""
    return root.parent / f"{dataset_hash.removesuffix('.dir')}.valid.json"


def _cached(root: Path, dataset_hash: str | None) -> FolderSummary | None:
    """The cached summary of ``dataset_hash``, if a verdict for exactly that hash exists."""
    if dataset_hash is None:
        return None
    verdict = read_json(verdict_path(root, dataset_hash))  # absent or torn: None
    if not isinstance(verdict, dict) or verdict.get("version") != VERDICT_VERSION \
            or verdict.get("md5") != dataset_hash or not isinstance(verdict.get("summary"), dict):
        return None
    try:
        s = verdict["summary"]
        return FolderSummary(tuple(s["classes"]), tuple(s["counts"]), s["height"], s["width"],
                             s["channels"], tuple(s.get("size_examples", ())))
    except (KeyError, TypeError):
        return None


def validate_image_folder(root: Path, dataset_hash: str | None = None,
                          name: str | None = None) -> FolderSummary:
    """Check that ``root`` is an ImageFolder of readable images (sizes may differ).

    Args:
        root: the dataset folder.
        dataset_hash: the DVC hash (``<md5>.dir``) ``root`` was pulled at; with it the verdict
            is cached beside ``root`` and reused for this hash only (no file read then).
        name: how errors name the dataset (``dataset data/x@v1 of <repo>``); default ``root``.

    Raises:
        DatasetError: one message naming each problem: no class folders, an empty class (holding
            nothing or only hidden files such as ``.keep``), an unreadable or truncated image.
    """
    cached = _cached(root, dataset_hash)
    if cached is not None:
        return cached
    folders = class_folders(root)
    if not folders:
        raise DatasetError(f"{name or root}: no class folders (expected <class>/<image> files)")
    listed = [(folder, [p.name for p in image_files(folder)]) for folder in folders]
    tally = _Tally({}, False, [])
    for folder, names in listed:
        if not names:
            tally.problem(f"class {folder.name!r}: empty class (no image files)")
    batches = ((folder, names[i:i + BATCH]) for folder, names in listed
               for i in range(0, len(names), BATCH))
    with ThreadPoolExecutor(READERS, thread_name_prefix="stoker-validate") as pool:
        for part in pool.map(lambda batch: _check(*batch), batches):
            tally.merge(part)
    if tally.count:
        more = tally.count - len(tally.problems)
        raise DatasetError(
            f"{name or root}: {tally.count} problem(s) in the dataset: " + "; ".join(tally.problems)
            + (f"; ... and {more} more" if more else ""))
    height, width = next(iter(tally.sizes)) if len(tally.sizes) == 1 else (None, None)
    examples = () if len(tally.sizes) < 2 else tuple(
        f"{w}x{h} px: {example}" for (h, w), example in tally.sizes.items())
    summary = FolderSummary(tuple(f.name for f in folders), tuple(len(n) for _, n in listed),
                            height, width, 3 if tally.colour else 1, examples)
    if dataset_hash is not None:
        _save(root, dataset_hash, summary, listed, tally.colour)
    return summary


def _save(root: Path, dataset_hash: str, summary: FolderSummary,
          listed: list[tuple[Path, list[str]]], colour: bool) -> None:
    """Cache the verdict, and the training's file list when it has none yet (so the first
    attempt lists and probes nothing: the same listing rules, the same headers)."""
    from stoker.runtime.imagefolder import LIST_VERSION, list_cache_path, save_listing

    listing = list_cache_path(root, None)
    if listing is not None and not listing.is_file():
        size = [summary.height, summary.width] if summary.height else None
        save_listing(listing, {
            "version": LIST_VERSION, "probed": True, "size": size, "colour": colour,
            "classes": [{"name": f.name, "files": names} for f, names in listed]})
    write_json(verdict_path(root, dataset_hash), {
        "version": VERDICT_VERSION, "md5": dataset_hash, "summary": asdict(summary)})
