"""Dataset tasks: create the demo data repository, pull a dataset through DVC."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stoker.config import PipelineConfig
from stoker.data.demo import ensure_demo_repo
from stoker.data.pull import DatasetRef, pull_dataset


@task(name="pull-dataset", cache_policy=NO_CACHE)
def pull(config: PipelineConfig) -> DatasetRef:
    """Pull ``config.data`` at its pinned revision (creating the demo repository if no
    ``data.repo_url`` is set). Fails before training if the remote lacks any file."""
    logger = get_run_logger()
    repo_url = config.data.repo_url
    if repo_url is None:
        demo = ensure_demo_repo(config.work_dir / "demo-data")
        logger.info("%s demo data repository %s (DVC remote %s)",
                    "created" if demo.created else "reusing", demo.repo, demo.remote)
        repo_url = str(demo.repo)
    ref = pull_dataset(repo_url, config.data.rev, config.data.path,
                       Path(config.work_dir) / "datasets", remote=config.data.remote)
    logger.info("dataset %s@%s (commit %s): %s, %d files -> %s", ref.path, ref.rev,
                ref.commit[:12], ref.md5, ref.nfiles, ref.local_path)
    return ref
