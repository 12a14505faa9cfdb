"""How an ImageFolder is listed: its class folders and their image files, without torch.

The trainer (``stoker.runtime.data``) and the orchestrator's dataset check
(``stoker.data.validate``) list a dataset the same way; here, so that the check before a pull
imports no torch.
"""

from __future__ import annotations

from pathlib import Path

IGNORED_NAMES = frozenset({"__MACOSX", "Thumbs.db", "desktop.ini"})
GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})


class DataError(RuntimeError):
    """The dataset folder cannot be read as the configured dataset."""


def visible(path: Path) -> bool:
    """Whether a folder entry takes part in an ImageFolder: hidden names (``.ipynb_checkpoints``,
    ``.DS_Store``, ``.keep``) and OS litter (``__MACOSX``, ``Thumbs.db``) do not."""
    return not path.name.startswith(".") and path.name not in IGNORED_NAMES


def class_folders(root: Path) -> list[Path]:
    """The class folders of an ImageFolder root, sorted by name (label i is the i-th)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and visible(p)), key=lambda p: p.name)


def image_files(folder: Path) -> list[Path]:
    """The candidate image files of one class folder, sorted by name (hidden files skipped)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and visible(p))


def control_characters(value: str) -> str | None:
    """The first control character in ``value`` as an escape (``'\\x1b'``), None when none.

    A class or model name is printed in terminals, logs, the MLflow UI and tags: an escape
    sequence in it could rewrite what a reader sees.

    Args:
        value: a name (a class folder, a registered model).

    Returns:
        ``repr`` of the first character below U+0020, U+007F..U+009F, or None.
    """
    for char in value:
        if ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F:
            return repr(char)
    return None
