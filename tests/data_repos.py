"""Build small git + DVC data repositories the way a user would: an ImageFolder of PNGs, a local
DVC remote written relative to the repository (``dvc remote add -d store ../storage``), tags."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from stoker.data.git import git


def write_images(root: Path, classes: dict[str, int], size: int = 8, mode: str = "L",
                 seed: int = 0) -> None:
    """``root/<class>/<i>.png``: ``classes[name]`` random images per class (name -> count)."""
    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    for label, (name, count) in enumerate(sorted(classes.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 60, shape) + label * 60  # a class is a brightness band
            Image.fromarray(pixels.astype(np.uint8), mode=mode).save(folder / f"{i:03d}.png")


def make_repo(base: Path, versions: dict[str, dict[str, int]], path: str = "data/images",
              size: int = 8, mode: str = "L", remote: str = "../../storage") -> Path:
    """``base/repo`` with a remote at ``base/storage`` (relative in ``.dvc/config``); one commit
    and tag per ``versions`` entry (tag -> class counts; each version's pixels differ);
    ``remote`` is the URL as written in ``.dvc/config``."""
    from dvc.repo import Repo

    repo = base / "repo"
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    Repo.init(str(repo)).close()
    # What `dvc remote add -d store ../storage` writes (relative to .dvc/).
    (repo / ".dvc" / "config").write_text(
        "[core]\n    remote = store\n    autostage = true\n"
        f"['remote \"store\"']\n    url = {remote}\n")
    for seed, (tag, classes) in enumerate(versions.items()):
        shutil.rmtree(repo / path, ignore_errors=True)
        write_images(repo / path, classes, size, mode, seed)
        with Repo(str(repo)) as dvc:
            dvc.add(str(repo / path))
            dvc.push()
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"data {tag}")
        git(repo, "tag", tag)
    return repo
