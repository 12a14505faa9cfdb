"""A job's files are its owner's only (issue 44): after a real training run every file in the
job folder is 0600 at most and every folder 0700 at most, under the usual umask and under a
umask of 0; the work folder, its ``jobs`` folder and the local MLflow store too. Files and
folders an older Stoker left wider are narrowed when written again; a shared store root is not."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import fsspec
import pytest
from mlflow import MlflowClient

from stoker.config import PipelineConfig
from stoker.jobs import Job
from stoker.jobs.store import JobStore
from stoker.orchestration.training import FlowRunHooks, TrainingRun
from stoker.runtime import private
from stoker.runtime.records import append_jsonl, write_json


def too_wide(root: Path) -> list[str]:
    """Every file under ``root`` wider than 0600 and every folder (``root`` too) wider than
    0700, as ``<mode> <path>``."""
    found = []
    for folder, dirs, files in os.walk(root):
        for path in [Path(folder)] * (folder == str(root)) + [Path(folder) / n for n in dirs]:
            if stat.S_IMODE(path.lstat().st_mode) & ~0o700:
                found.append(f"{oct(stat.S_IMODE(path.lstat().st_mode))} {path}/")
        for path in (Path(folder) / n for n in files):
            if stat.S_IMODE(path.lstat().st_mode) & ~0o600:
                found.append(f"{oct(stat.S_IMODE(path.lstat().st_mode))} {path}")
    return found


def train_one_job(config: PipelineConfig, dataset) -> Path:
    """Train ``config``'s job for real (torchrun, 2 CPU ranks) as the train task does."""

    def run_attempt(number: int, capacity: str, body) -> int:
        return body(logging.getLogger("attempt")).code

    hooks = FlowRunHooks(logger=logging.getLogger("train"), flow_run_id=None, flow_run_url=None,
                         emit=lambda **event: None, run_attempt=run_attempt,
                         stopped_by=lambda error: None, crash_orphan=lambda run: None)
    with Job.claim(config) as claim:
        job_dir = claim.bind(dataset.md5)
        result = TrainingRun(config, dataset, None, job_dir, hooks).run(
            lambda: lambda percent, message: None)
    run = MlflowClient(config.tracking_uri()).get_run(result.run_id)
    assert run.info.status == "FINISHED"
    return job_dir


@pytest.mark.integration
@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask-022", "umask-0"])
def test_a_trained_job_leaves_nothing_wider_than_its_owner(dataset, tmp_path, umask):
    config = PipelineConfig.model_validate({
        "work_dir": str(tmp_path / "work"), "job_id": "private",
        "train": {"epochs": 1, "checkpoint_every_steps": 10, "profile_steps": 1}})
    before = os.umask(umask)  # the ranks and torchrun inherit it
    try:
        job_dir = train_one_job(config, dataset)
    finally:
        os.umask(before)
    written = {p.relative_to(job_dir).as_posix() for p in job_dir.rglob("*")}
    # The run wrote what the check must cover: lease lock, records, logs, spec, checkpoints.
    assert {".lease.lock", "attempts.jsonl", "progress.jsonl", "heartbeat.json", "train.log",
            "spec.yaml", "mlflow_run_id", "result.json", "final/model.pt"} <= written, written
    assert any(p.endswith("/COMMITTED") for p in written), written
    assert any(p.startswith("profile/trace-rank") for p in written), written  # torch's writer
    assert too_wide(job_dir) == []
    work = tmp_path / "work"
    assert too_wide(work / "jobs") == []
    for path in (work, work / "mlartifacts"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in (work / "mlflow.db", work / "mlflow.db.lock"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_an_older_jobs_wide_files_and_folder_are_narrowed_when_written_again(tmp_path):
    job = tmp_path / "job"
    job.mkdir(mode=0o755)
    os.chmod(job, 0o755)
    for name in ("progress.jsonl", "heartbeat.json"):
        (job / name).write_text("")
        os.chmod(job / name, 0o644)
    before = os.umask(0)
    try:
        private.make_dir(job)
        append_jsonl(job / "progress.jsonl", {"event": "start", "step": 0})
        write_json(job / "heartbeat.json", {"step": 0})
        private.write_text(job / "mlflow_run_id", "abc")
    finally:
        os.umask(before)
    assert too_wide(job) == []
    assert (job / "progress.jsonl").read_text().count("\n") == 1  # appended, nothing lost


def test_a_shared_store_root_keeps_its_mode_and_a_jobs_records_in_it_are_private(tmp_path):
    root = tmp_path / "team-store"
    root.mkdir()
    os.chmod(root, 0o775)  # shared with the team's group on purpose
    store = JobStore(str(root))
    before = os.umask(0)
    try:
        store.check()
        store.put(f"{store.root}/job-1/attempts.jsonl", b"{}\n")
    finally:
        os.umask(before)
    assert stat.S_IMODE(root.stat().st_mode) == 0o775
    assert too_wide(root / "job-1") == []


def test_an_object_store_gets_no_modes(tmp_path):
    fs = fsspec.filesystem("memory")
    private.fs_make_dir(fs, "/bucket/job/checkpoints")
    with private.fs_open(fs, "/bucket/job/checkpoints/COMMITTED") as f:
        f.write(b"{}")
    assert fs.cat_file("/bucket/job/checkpoints/COMMITTED") == b"{}"


def test_a_pulled_datasets_folders_are_their_owners(demo_repo, tmp_path):
    """The work folder, ``datasets/`` and the repository cache a pull creates are 0700 (trial:
    0755 with a remote Prefect server, from the cache folder's mkdir)."""
    import stat

    from stoker.data.pull import pull_dataset

    work = tmp_path / "work"
    old = os.umask(0o022)
    try:
        pull_dataset(str(demo_repo.repo), "v1", "data/digits", work / "datasets")
    finally:
        os.umask(old)
    for folder in (work, work / "datasets", work / "datasets" / ".repos"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
