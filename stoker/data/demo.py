"""The demo data repository: UCI handwritten digits as a git + DVC repository with a local remote.

The digits (1,797 images of 8x8 pixels, 10 classes) ship inside scikit-learn, so the demo needs no
download. They are exported as an ImageFolder (``data/digits/<class>/<index>.png``), tracked with
DVC, pushed to a local DVC remote and tagged ``v1``. Creation is idempotent: the repository is built
in a temporary folder and moved into place only when complete, so an interrupted first run leaves
nothing half-made behind and the next run starts over cleanly.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stoker.data.git import git

DEMO_TAG = "v1"
DEMO_PATH = "data/digits"


@dataclass(frozen=True)
class DemoRepo:
    """Paths of the demo data repository and its DVC remote."""

    repo: Path
    remote: Path
    created: bool


DIGITS_SHAPE = (1797, 65)  # 64 pixels (0..16) and the class of each image


def load_digits_arrays():
    """The UCI digits as ``(images, labels)``: float64 [1797, 8, 8] with values 0..16, and int
    [1797]; the same arrays as ``sklearn.datasets.load_digits()``.

    Read from scikit-learn's own data file (``sklearn/datasets/data/digits.csv.gz``) without
    importing scikit-learn, whose import costs about 2.5 CPU-s on every first run; through
    ``load_digits`` when the file is not there or not of that shape (another layout).
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    origin = Path(spec.origin).parent if spec is not None and spec.origin else None
    path = origin / "datasets" / "data" / "digits.csv.gz" if origin else None
    if path is not None and path.is_file():
        data = np.loadtxt(path, delimiter=",")
        if data.shape == DIGITS_SHAPE:
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def export_digits(root: Path) -> int:
    """Write the scikit-learn digits as PNG files under ``root/<class>/<index>.png``.

    Pixel values 0..16 are scaled to 0..255 (uint8, mode "L").

    Returns:
        The number of images written (1,797).
    """
    import numpy as np
    from PIL import Image

    images, labels = load_digits_arrays()
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(np.rint(image * (255.0 / 16.0)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"{index:04d}.png")
    return len(images)


def demo_repo_exists(base: Path) -> bool:
    """Whether the demo data repository under ``base`` is complete (git and its ``.dvc``)."""
    repo_dir = Path(base) / "repo"
    return (repo_dir / ".git").is_dir() and (repo_dir / f"{DEMO_PATH}.dvc").is_file()


def ensure_demo_repo(base: Path) -> DemoRepo:
    """Create the demo data repository under ``base`` unless it already exists.

    Args:
        base: folder that will hold ``repo/`` (git + DVC) and ``remote/`` (the DVC remote).

    Returns:
        DemoRepo with absolute paths; ``created`` tells whether this call built it.

    Raises:
        RuntimeError: git or DVC failed while building (nothing is left at ``base/repo``).
    """
    from dvc.repo import Repo

    base = base.resolve()
    repo_dir, remote_dir = base / "repo", base / "remote"
    if demo_repo_exists(base):
        return DemoRepo(repo_dir, remote_dir, created=False)

    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".repo-", dir=base))
    try:
        git(staging, "init", "-q", "-b", "main")
        init_log = logging.getLogger("dvc.repo.init")  # its INFO lines reach two handlers
        level, init_log.level = init_log.level, logging.WARNING
        try:
            dvc = Repo.init(str(staging))
        finally:
            init_log.setLevel(level)
        with dvc.config.edit() as conf:
            conf["remote"]["local"] = {"url": str(remote_dir)}
            conf["core"]["remote"] = "local"
            conf["core"]["analytics"] = False
            conf["core"]["autostage"] = True  # dvc add stages its files: no "git add" hint
        dvc.close()
        dvc = Repo(str(staging))  # re-read the config just written
        export_digits(staging / DEMO_PATH)
        dvc.add(str(staging / DEMO_PATH))
        dvc.push()
        dvc.close()
        (staging / "README.md").write_text(
            "# Stoker demo data\n\nUCI handwritten digits (from scikit-learn) as an ImageFolder, "
            "tracked with DVC.\n"
        )
        git(staging, "add", "-A")
        git(staging, "commit", "-q", "-m", "Add UCI digits as an ImageFolder tracked by DVC")
        git(staging, "tag", DEMO_TAG)
        if repo_dir.exists():  # a leftover without the .dvc file: an earlier failed attempt
            shutil.rmtree(repo_dir)
        staging.rename(repo_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return DemoRepo(repo_dir, remote_dir, created=True)
