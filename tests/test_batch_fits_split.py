"""Issue 43/44 follow-up: a global batch larger than the dataset's training split is refused
right after the pull, before any job is queued or any training process starts (it was found by
the ranks, after a Slurm queue wait or a container start): one line naming
train.global_batch_size, the split's size and the world size, exit 2, no attempt, no MLflow run
left RUNNING. The orchestrator and the ranks count the split with the same function."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from local_servers import marked_processes

from stoker.config import ConfigError, load_pipeline_config

DEMO_IMAGES = 1797  # the demo repository's digits; train.val_fraction 0.2 holds out 359
DEMO_TRAIN = 1438


@pytest.mark.parametrize("n", [1, 2, 5, 10, 99, DEMO_IMAGES])
@pytest.mark.parametrize("val_fraction", [0.01, 0.2, 0.5, 0.9])
def test_the_ranks_and_the_orchestrator_count_the_split_alike(n, val_fraction):
    from stoker.runtime.data import split_indices
    from stoker.runtime.split import split_sizes

    train_idx, val_idx = split_indices(n, val_fraction, seed=3)
    assert split_sizes(n, val_fraction) == (len(train_idx), len(val_idx))


def _prepared(dataset):
    from stoker.data.prepare import PreparedDataset
    from stoker.data.validate import validate_image_folder

    return PreparedDataset(dataset, validate_image_folder(Path(dataset.local_path), dataset.md5))


def test_the_check_after_the_pull_names_the_batch_the_split_and_the_world(dataset):
    from stoker.orchestration.batch_fit import check_batch_fits

    prepared = _prepared(dataset)
    assert sum(prepared.summary.counts) == DEMO_IMAGES
    config = load_pipeline_config(None, ["train.global_batch_size=1440",
                                         "train.nproc_per_node=2"], environ={})
    with pytest.raises(ConfigError) as refused:
        check_batch_fits(config, prepared)
    line = str(refused.value)
    assert line.startswith("train.global_batch_size: 1440 samples per step (world size 2: 720 "
                           f"per process) is more than the {DEMO_TRAIN} samples of the "
                           "training split of dataset data/digits@v1 of "), line
    assert f"({DEMO_IMAGES} images; train.val_fraction=0.2 holds out 359)" in line
    assert line.endswith(f"give at most {DEMO_TRAIN} (a multiple of 2)") and "\n" not in line
    fits = load_pipeline_config(None, [f"train.global_batch_size={DEMO_TRAIN}",
                                       "train.nproc_per_node=2"], environ={})
    check_batch_fits(fits, prepared)  # one step per epoch: trains


def test_a_split_smaller_than_the_shards_of_a_step_says_so():
    from stoker.runtime.split import batch_exceeds_split

    line = batch_exceeds_split(8, 2, 3, 4, "dataset d")
    assert line.startswith("train.global_batch_size: 8 samples per step (world size 4: 1 per "
                           "process and micro-batch (grad_accum_steps 2)) is more than the 3 ")
    assert line.endswith("fewer samples than the 8 shards of a step: add data or lower "
                         "train.val_fraction")
    assert batch_exceeds_split(8, 1, 8, 2, "dataset d") is None


def test_a_local_repository_is_checked_before_the_pull_from_its_dvc_file(demo_repo, tmp_path):
    """Trial: batch 128 on a 90-image repository on this machine was refused only after the
    pull, behind 30 s of Prefect lines. The `.dvc` file's file count bounds the images: a
    batch larger than that split is refused before the pull; one that fits it passes on to
    the check after the pull."""
    from stoker.launch.factory import check_before_pull

    def config(batch: int):
        return load_pipeline_config(None, [
            f"work_dir={tmp_path / 'work'}", f"data.repo_url={demo_repo.repo}",
            f"train.global_batch_size={batch}", "train.nproc_per_node=2"], environ={})

    with pytest.raises(ConfigError) as refused:
        check_before_pull(config(1440))
    line = str(refused.value)
    assert line.startswith("train.global_batch_size: 1440 samples per step (world size 2: 720 "
                           f"per process) is more than the {DEMO_TRAIN} samples of the "
                           f"training split of data/digits@v1 of {demo_repo.repo} (its "
                           f"{DEMO_IMAGES} files, each counted as an image; "
                           "train.val_fraction=0.2 holds out 359)"), line
    check_before_pull(config(DEMO_TRAIN))
    assert not (tmp_path / "work").exists()  # nothing pulled, nothing written


def test_stoker_run_refuses_it_before_the_pull_and_any_attempt(demo_repo, tmp_path):
    """A real `stoker run` (local Prefect server): exit 2 on the refusal's line; nothing
    pulled, no attempt recorded, no MLflow run RUNNING, no training process left."""
    from mlflow import MlflowClient
    from prefect_server import seed_prefect_home

    work = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    mark = {"STOKER_TEST_MARK": str(tmp_path)}  # inherited by every process the command starts
    seed_prefect_home(tmp_path / "prefect")
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}",
         f"data.repo_url={demo_repo.repo}", "train.global_batch_size=1440",
         "train.nproc_per_node=2", "train.epochs=1"], capture_output=True, text=True,
        timeout=400, env={**env, "PREFECT_HOME": str(tmp_path / "prefect"), **mark})
    assert result.returncode == 2, result.stderr[-3000:]
    assert list(work.glob("jobs/*/attempts.jsonl")) == []  # no attempt started
    assert not (work / "datasets").exists()  # refused before the pull (trial: after it)
    if (work / "mlflow.db").exists():
        client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
        ids = [e.experiment_id for e in client.search_experiments()]
        assert [r.info.status for r in client.search_runs(ids)] == []
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train.global_batch_size: 1440 samples per step (world size "
                           f"2: 720 per process) is more than the {DEMO_TRAIN} samples"), last
    assert "Traceback" not in result.stderr
    assert marked_processes(str(tmp_path)) == []


def test_the_ranks_check_again_with_the_same_line(make_spec):
    """The runtime's own check stays (a world size that changes at launch, a custom dataset
    factory) and says the same line, with the world size the ranks see."""
    import torch

    from stoker.runtime.data import DataError
    from stoker.runtime.distributed import DistEnv
    from stoker.runtime.preemption import StopFlag
    from stoker.runtime.spec import RunSpec
    from stoker.runtime.trainer import Trainer

    spec = RunSpec.load(make_spec(tracking=False, global_batch_size=1440))
    with pytest.raises(DataError) as refused:
        Trainer(spec, DistEnv(0, 0, 1, torch.device("cpu"), None), StopFlag())
    assert str(refused.value).startswith(
        "train.global_batch_size: 1440 samples per step (world size 1: 1440 per process) is "
        f"more than the {DEMO_TRAIN} samples of the training split of {spec.data_dir}, ")
