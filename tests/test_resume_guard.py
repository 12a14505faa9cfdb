"""A job named by ``job_id`` goes on only with its own data and trajectory; bad input that only
the ranks can see is still one line and exit code 2 (new-user QA findings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from local_servers import embedded_env, stop_local_servers

from stoker.config import ConfigError, PipelineConfig
from stoker.jobs.job import check_resumable
from stoker.runtime.spec import RunSpec

pytestmark = pytest.mark.integration


def test_a_job_refuses_other_data_or_another_trajectory(make_spec, dataset):
    spec = make_spec("mine", seed=3, epochs=2)
    job_dir = spec.parent
    same = PipelineConfig(train=RunSpec.load(spec).train.model_dump())
    check_resumable(job_dir, same, dataset.md5)  # its own data and settings: accepted
    with pytest.raises(ConfigError) as other_data:
        check_resumable(job_dir, same, "0123456789abcdef0123456789abcdef.dir")
    assert f"job {job_dir.name} cannot go on with other data" in str(other_data.value)
    assert f"dataset: data@? ({dataset.md5.removesuffix('.dir')}) -> " in str(other_data.value)
    assert "(0123456789abcdef0123456789abcdef)" in str(other_data.value)
    other_seed = PipelineConfig(train={**same.train.model_dump(), "seed": 4})
    with pytest.raises(ConfigError, match=r"train\.seed: 3 -> 4") as info:
        check_resumable(job_dir, other_seed, dataset.md5)
    assert str(spec) in str(info.value) and "leave job_id out" in str(info.value)
    check_resumable(job_dir.parent / "new-job", other_seed, dataset.md5)  # no spec: a new job


def stoker_run(work: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = embedded_env(work)
    return subprocess.run([sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}",
                           "tracking.system_metrics_interval_s=null", *overrides],
                          capture_output=True, text=True, timeout=600, env=env)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def full_disk_run(work: Path, disk: Path) -> subprocess.CompletedProcess:
    """``stoker run`` with ``checkpoint_dir`` on a 1 MB tmpfs (the demo's first checkpoint does
    not fit); needs root, and fails under CI=true without it."""
    from image_support import skip_or_fail

    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        skip_or_fail(f"cannot mount a small tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        return stoker_run(work, "train.epochs=1", "train.checkpoint_every_steps=5",
                          f"checkpoint_dir={disk}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def attempt_states(work: Path) -> dict[str, tuple[str, str]]:
    """``attempt-N`` task run -> (state type, state name) on the work folder's local Prefect
    server (the last flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stoker.local_server import LocalServer

    record = LocalServer(work / ".prefect").running()
    assert record is not None, "the local Prefect server is not running"
    with temporary_settings({PREFECT_API_URL: record["api_url"]}), \
            get_client(sync_client=True) as client:
        [last] = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        runs = client.read_task_runs()
    return {t.name: (t.state.type.value, t.state.name) for t in runs
            if t.flow_run_id == last.id and t.name.startswith("attempt-")}


def test_job_id_with_other_settings_and_a_rank_named_error_exit_2_in_one_line(tmp_path):
    work = tmp_path / "work"
    try:
        # The ranks find it (the channels are known once the data is read): exit 2, their line.
        bad_mean = stoker_run(work, "train.epochs=1", "train.image_mean=[0.5,0.5]")
        assert bad_mean.returncode == 2, bad_mean.stderr[-3000:]
        assert last_line(bad_mean).startswith(
            "error: train.image_mean has 2 value(s) for 1 channel(s)"), bad_mean.stderr[-3000:]
        assert "stoker logs " in last_line(bad_mean)
        # A full disk at a checkpoint: no config error but an outcome of its own, in every
        # place that names it (trial: `UserError('exit 2: user_error')`, `ConfigError: see
        # the error line`, and torchrun's `failed (exitcode: 2)` in the terminal).
        full = full_disk_run(work, tmp_path / "small-disk")
        assert full.returncode == 2, full.stderr[-3000:]
        assert last_line(full).startswith("error: checkpoint "), full.stderr[-3000:]
        assert "could not write it (No space left on device)" in last_line(full)
        assert "Finished in state Failed (CheckpointWriteError: see the error line)" in \
            full.stderr, full.stderr[-3000:]
        assert "attempt 1 ended: storage_error (exit 74)" in full.stderr, full.stderr[-3000:]
        assert "user_error" not in full.stderr and "ConfigError" not in full.stderr
        assert "failed (exitcode:" not in full.stderr, full.stderr[-3000:]
        assert attempt_states(work)["attempt-1"] == ("FAILED", "StorageError")
        # A user error raised in a flow task is said once on the terminal (QA: five times:
        # the task's exception and end, the flow's exception and end, then the error line).
        unreachable = stoker_run(work, "data.repo_url=http://127.0.0.1:9/repo.git")
        assert unreachable.returncode == 2, unreachable.stderr[-3000:]
        said = [line for line in unreachable.stderr.splitlines() if "127.0.0.1:9" in line]
        assert said == [last_line(unreachable)], unreachable.stderr[-3000:]
        assert said[0].startswith("error: data.repo_url http://127.0.0.1:9/repo.git: cannot "
                                  "clone: fatal: ")
        assert "Finished in state Failed (DatasetError: see the error line)" in \
            unreachable.stderr
        assert "cancel_stopped_flow_run" not in unreachable.stderr
        # A job left unfinished (a failure), then named by job_id with another seed: refused
        # before any process starts, naming the field; its checkpoints stay as they were.
        failed = stoker_run(work, "job_id=mine", "train.epochs=1", "train.fail_at_step=12")
        assert failed.returncode == 1, failed.stderr[-3000:]
        checkpoints = sorted(p.name for p in (work / "jobs/mine/checkpoints").iterdir())
        other = stoker_run(work, "job_id=mine", "train.epochs=1", "train.seed=5")
        assert other.returncode == 2, other.stderr[-3000:]
        assert last_line(other).startswith(
            "error: job mine cannot go on with other data or settings (train.seed: 0 -> 5)")
        assert sorted(p.name for p in (work / "jobs/mine/checkpoints").iterdir()) == checkpoints
        assert "attempt 2" not in other.stderr  # no torchrun started
    finally:
        stop_local_servers(tmp_path)


def test_job_id_is_a_whole_folder_name(tmp_path, monkeypatch):
    """A shortened id (what `stoker status` accepts) must not start a new job; an id that is no
    folder name is refused at config time; a new name says a new job starts."""
    from typer.testing import CliRunner

    from stoker.cli import app
    from stoker.config import load_pipeline_config
    from stoker.jobs.job import new_job_notice

    monkeypatch.chdir(tmp_path)
    (tmp_path / "work/jobs/2f9e48a557d2-20261201T073141196842Z").mkdir(parents=True)
    short = CliRunner().invoke(app, ["run", "job_id=2f9e48"])
    assert short.exit_code == 2
    assert short.output.strip() == (
        f"error: job_id 2f9e48: no such job under {tmp_path / 'work/jobs'}; did you mean "
        "2f9e48a557d2-20261201T073141196842Z? (job_id takes the whole name)")
    with pytest.raises(ConfigError, match=r"^job_id: not a folder name"):
        load_pipeline_config(None, ["job_id=../elsewhere"])
    fresh = load_pipeline_config(None, ["job_id=nightly-1"])
    assert new_job_notice(fresh) == (
        f"job_id nightly-1: no job of that name under {tmp_path / 'work/jobs'}: starting a new "
        "job")
    whole = load_pipeline_config(None, ["job_id=2f9e48a557d2-20261201T073141196842Z"])
    assert new_job_notice(whole) is None


@pytest.mark.parametrize(("override", "message"), [
    ("data.rev=no-such-rev", "error: data.rev 'no-such-rev': not found in {repo}"),
    ("data.path=data/digitz",
     "error: data.path data/digitz: no data/digitz.dvc at commit {commit}; DVC tracks "
     "data/digits there"),
])
@pytest.mark.parametrize("job_id", [[], ["job_id=nightly-1"]], ids=["no-job-id", "new-job-id"])
def test_a_missing_revision_or_path_of_a_local_repository_is_named_before_the_pull(
        demo_repo, tmp_path, monkeypatch, override, message, job_id):
    """Found in the repository itself before Prefect starts or anything is cloned (was: after
    the pull task started, the message repeated five times and a Failed flow run). With a new
    ``job_id`` too: its "starting a new job" notice comes only once the input passed (was: a
    second line before the error)."""
    from typer.testing import CliRunner

    from stoker.cli import app
    from stoker.data.git import git

    monkeypatch.chdir(tmp_path)
    repo = str(demo_repo.repo)
    commit = git(demo_repo.repo, "rev-parse", "v1^{commit}")[:12]
    result = CliRunner().invoke(app, ["run", f"data.repo_url={repo}", "data.rev=v1",
                                      "data.path=data/digits", override, *job_id])
    assert result.exit_code == 2
    assert result.output.strip() == message.format(repo=repo, commit=commit)
    assert not (tmp_path / "work").exists()  # no Prefect home, no clone, no dataset
