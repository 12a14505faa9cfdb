"""The pull step as a plain function: demo repository or the user's, pull, validate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stoker.config import PipelineConfig
from stoker.data.demo import demo_repo_exists, ensure_demo_repo
from stoker.data.pull import DatasetError, DatasetRef, pull_dataset
from stoker.data.validate import FolderSummary, validate_image_folder


@dataclass(frozen=True)
class PreparedDataset:
    """A pulled dataset and, for the built-in image_folder factory, what it holds."""

    ref: DatasetRef
    summary: FolderSummary | None

    def input_shape(self, channels: int | str = "auto", image_size: int | None = None
                    ) -> tuple[int, int, int] | None:
        """[C, H, W] the model will see (``channels``, ``image_size`` as in ``train.*``).

        Raises:
            DatasetError: the images differ in size and ``image_size`` is not set.
        """
        if self.summary is None:
            return None
        depth = self.summary.channels if channels == "auto" else int(channels)
        if image_size is not None:
            return depth, image_size, image_size
        if self.summary.height is None or self.summary.width is None:
            examples = "; ".join(self.summary.size_examples)
            raise DatasetError(
                f"{dataset_name(self.ref)}: images have different sizes"
                + (f" ({examples})" if examples else "") + "; set train.image_size (square side "
                "in pixels) to resize them")
        return depth, self.summary.height, self.summary.width


def dataset_name(ref) -> str:
    """``dataset data/colours@v1 of /home/me/colours``: a dataset as its user named it (not its
    md5 folder), for error messages."""
    return f"dataset {ref.path}@{ref.rev} of {ref.repo_url}"


def prepare_dataset(config: PipelineConfig, log: Callable[[str], None] = print
                    ) -> PreparedDataset:
    """Pull ``config.data`` (the demo repository when ``data.repo_url`` is empty) and, for the
    image_folder factory, validate every class and file before any job folder or process exists
    (once per DVC hash: a later pull of the same hash reuses the verdict and reads no file).

    Raises:
        DatasetError: the pull failed or the folder is not a usable ImageFolder (each bad file or
            class named in one message).
    """
    repo_url = config.data.repo_url
    if repo_url is None:
        base = Path(config.work_dir) / "demo-data"
        if not demo_repo_exists(base):  # git, DVC and 1797 images: seconds, said before
            log(f"creating the demo data repository (once): {base.resolve() / 'repo'}")
        demo = ensure_demo_repo(base)
        log(f"{'created' if demo.created else 'reusing'} demo data repository {demo.repo} "
            f"(DVC remote {demo.remote})")
        repo_url = str(demo.repo)
    ref = pull_dataset(repo_url, config.data.rev, config.data.path,
                       Path(config.work_dir) / "datasets", remote=config.data.remote)
    log(f"dataset {ref.path}@{ref.rev} (commit {ref.commit[:12]}): {ref.md5}, {ref.nfiles} "
        f"files -> {ref.local_path}")
    summary = None
    if config.train.dataset == "image_folder":
        summary = validate_image_folder(Path(ref.local_path), ref.md5, name=dataset_name(ref))
        size = f"{summary.width}x{summary.height} px" if summary.height else "mixed sizes"
        log(f"{len(summary.classes)} classes {list(summary.classes)}, {size}, "
            f"{summary.channels} channel(s)")
    return PreparedDataset(ref, summary)
