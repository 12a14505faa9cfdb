"""Check a pulled ImageFolder before any job exists: every class and every file, one error.

Training reads the same folder with ``stoker.runtime.data.image_folder`` (streaming); both use
the same listing rules (hidden folders and files are not classes nor samples), so the classes
found here are the classes the model is trained on. Sizes may differ (``train.image_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stoker.data.pull import DatasetError
from stoker.runtime.data import GRAY_MODES, class_folders, image_files

MAX_NAMED = 20  # problems named in one message; the count says how many there are in all


@dataclass(frozen=True)
class FolderSummary:
    """What an ImageFolder holds.

    Attributes:
        classes: class names, sorted (label i is classes[i]).
        counts: images per class, in the order of ``classes``.
        height, width: image size in pixels when all images share it, else None (training then
            needs ``train.image_size``).
        channels: 1 if every image is grayscale, else 3.
    """

    classes: tuple[str, ...]
    counts: tuple[int, ...]
    height: int | None
    width: int | None
    channels: int


def _inspect(file: Path) -> tuple[tuple[int, int], str]:
    """(height, width) and mode of an image, fully decoded (a truncated file fails here)."""
    from PIL import Image

    with Image.open(file) as image:
        image.load()
        return (image.height, image.width), image.mode


def validate_image_folder(root: Path) -> FolderSummary:
    """Check that ``root`` is an ImageFolder of readable images (sizes may differ).

    Raises:
        DatasetError: one message naming each problem: no class folders, an empty class (holding
            nothing or only hidden files such as ``.keep``), an unreadable image.
    """
    from PIL import UnidentifiedImageError

    folders = class_folders(root)
    if not folders:
        raise DatasetError(f"{root}: no class folders (expected <class>/<image> files)")
    problems: list[str] = []
    counts, sizes, modes = [], {}, set()
    for folder in folders:
        files = image_files(folder)
        counts.append(len(files))
        if not files:
            problems.append(f"class {folder.name!r}: empty class (no image files)")
        for file in files:
            try:
                size, mode = _inspect(file)
            except (UnidentifiedImageError, OSError) as e:
                problems.append(f"{folder.name}/{file.name}: not a readable image ({e})")
                continue
            sizes.setdefault(size, f"{folder.name}/{file.name}")
            modes.add(mode)
    if problems:
        raise DatasetError(
            f"{root}: {len(problems)} problem(s) in the dataset: " + "; ".join(problems[:MAX_NAMED])
            + (f"; ... and {len(problems) - MAX_NAMED} more" if len(problems) > MAX_NAMED else ""))
    height, width = next(iter(sizes)) if len(sizes) == 1 else (None, None)
    return FolderSummary(tuple(f.name for f in folders), tuple(counts), height, width,
                         1 if modes <= GRAY_MODES else 3)
