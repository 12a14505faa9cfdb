"""`stoker jobs`, `stoker status` and `stoker logs` over job folders as the pipeline leaves them:
done, training (a live lease), stopped, unfinished with a torn record; odd values are tolerated."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stoker.cli import app
from stoker.launch.attempts import AttemptLog
from stoker.launch.job import mark_done
from stoker.launch.stop_request import request_stop
from stoker.runtime.records import append_jsonl, write_json


def make_job(jobs: Path, name: str, steps: int, total: int = 100) -> Path:
    job = jobs / name
    job.mkdir(parents=True)
    t0 = time.time() - 60
    append_jsonl(job / "progress.jsonl", {"event": "start", "step": 0, "time": t0,
                                          "total_steps": total})
    for s in range(1, steps + 1):
        append_jsonl(job / "progress.jsonl", {"event": "step", "step": s, "time": t0 + s,
                                              "samples_per_s": 64.0})
    write_json(job / "heartbeat.json", {"time": time.time() - 5, "step": steps})
    (job / "mlflow_run_id").write_text(f"run-{name}\n")
    log = AttemptLog(job)
    log.start(1, "spot")
    log.end(1, {"exit_code": 75, "outcome": "preempted", "started": t0, "duration_s": 30.0})
    return job


@pytest.fixture
def work(tmp_path) -> Path:
    jobs = tmp_path / "jobs"
    done = make_job(jobs, "aaaa1111-done", 100)
    mark_done(done, {"cost": {"cost_usd": 0.125}})
    training = make_job(jobs, "bbbb2222-training", 40)
    write_json(training / "lease.json", {"token": "t", "host": socket.gethostname(),
                                         "pid": os.getpid(), "expires": time.time() + 60})
    (training / "train.log").write_text("attempt 1 on spot capacity\n[rank0] step 40\n"
                                        "[rank1] half a li")
    stopped = make_job(jobs, "cccc3333-stopped", 20)
    request_stop(stopped, "cost-guard", "stalled")
    torn = make_job(jobs, "dddd4444-torn", 10)
    with open(torn / "progress.jsonl", "a") as f:
        f.write('{"event": "step", "step": 11, "ti')  # a crash mid-write
    write_json(torn / "lease.json", {"host": socket.gethostname(), "pid": 4294967295,
                                     "expires": time.time() + 60})  # garbled: not alive
    return tmp_path


def test_jobs_lists_every_job_with_its_state(work):
    result = CliRunner().invoke(app, ["jobs", "--work-dir", str(work)])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[2:]}
    assert rows["aaaa1111-done"][1:3] == ["done", "100/100"] and "$0.1250" in rows[
        "aaaa1111-done"]
    assert rows["bbbb2222-training"][1:6] == ["training", "40/100", "1", "1", "-"]
    assert rows["cccc3333-stopped"][1] == "stopped"
    assert rows["dddd4444-torn"][1:3] == ["unfinished", "10/100"]
    assert "run-bbbb2222-training" in rows["bbbb2222-training"]
    assert result.output.splitlines()[1].split()[:3] == ["JOB", "STATE", "STEP"]


def test_status_of_one_job_by_prefix(work):
    result = CliRunner().invoke(app, ["status", "bbbb", "--work-dir", str(work)])
    assert result.exit_code == 0, result.output
    assert f"training (host {socket.gethostname()} pid {os.getpid()})" in result.output
    assert "step 40/100 (attempt 1)" in result.output and "ETA" in result.output
    assert "attempt 1: preempted (exit 75) after 30.0 s on spot capacity" in result.output
    unfinished = CliRunner().invoke(app, ["status", "dddd4444-torn", "--work-dir", str(work)])
    assert "resume it: run the same command again" in unfinished.output


def test_status_shows_an_attempt_left_open_as_jobs_counts_it(work):
    """QA: after `kill -9` of `stoker run`, `jobs` counted the open attempt and `status` listed
    none; now both show it, as running while a live run owns the job, else as left open."""
    torn = work / "jobs" / "dddd4444-torn"
    AttemptLog(torn).start(2, "on_demand")
    training = work / "jobs" / "bbbb2222-training"
    AttemptLog(training).start(2, "spot")
    rows = CliRunner().invoke(app, ["jobs", "--work-dir", str(work)]).output
    assert {line.split()[0]: line.split()[3] for line in rows.splitlines()[2:]}[
        "dddd4444-torn"] == "2"
    left = CliRunner().invoke(app, ["status", "dddd", "--work-dir", str(work)]).output
    assert "attempt 2: left open by a run that died (started 0 s ago); it is closed and " \
        "billed when the job resumes" in left
    live = CliRunner().invoke(app, ["status", "bbbb", "--work-dir", str(work)]).output
    assert "attempt 2: running for 0 s on spot capacity" in live


def test_logs_prints_whole_lines_and_unknown_jobs_are_one_line(work):
    result = CliRunner().invoke(app, ["logs", "bbbb2222-training", "--work-dir", str(work)])
    assert result.exit_code == 0
    assert result.output == "attempt 1 on spot capacity\n[rank0] step 40\n"  # no torn line
    missing = CliRunner().invoke(app, ["logs", "nope", "--work-dir", str(work)])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1
    assert "job 'nope': no such job" in missing.output
    empty = CliRunner().invoke(app, ["jobs", "--work-dir", str(work / "elsewhere")])
    assert empty.exit_code == 0 and "no jobs in" in empty.output


def test_predict_from_another_folder_creates_nothing_and_says_where_it_looked(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["predict", "x.png"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: no MLflow store at work/mlflow.db: tracking URI sqlite:///work/mlflow.db (from "
        f"{tmp_path}); point --tracking-uri at your store"]
    assert list(tmp_path.iterdir()) == []  # no stray work/mlflow.db, no work/.prefect


def test_predict_names_a_missing_model_in_one_line(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_registered_model("shapes-data")  # the store, with another model
    image = tmp_path / "x.png"
    image.write_bytes(b"not read: the model fails first")
    result = CliRunner().invoke(app, ["predict", str(image), "--tracking-uri", uri,
                                      "--model-uri", "models:/nope@champion"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error: models:/nope@champion: ")
    assert f"tracking URI {uri}" in result.output
    # what the store holds, so that a user of their own data finds their model's name
    assert "registered models there: shapes-data" in result.output
    assert "--model-uri models:/shapes-data@champion" in result.output

    missing = CliRunner().invoke(app, ["predict", str(tmp_path / "nope.png"), "--tracking-uri",
                                       uri, "--model-uri", "models:/nope@champion"])
    assert missing.exit_code == 2  # named before the model is looked up
    assert missing.output.strip() == (f"error: no such image file or folder: "
                                      f"{tmp_path / 'nope.png'}")
    # QA: an absolute store's URI was said to be "(from <cwd>)"
    assert "(from " not in result.output
    empty = tmp_path / "photos"
    (empty / ".ipynb_checkpoints").mkdir(parents=True)
    (empty / ".ipynb_checkpoints" / "x.png").write_bytes(b"hidden")
    folder = CliRunner().invoke(app, ["predict", str(empty), "--tracking-uri", uri])
    assert folder.exit_code == 2  # QA: a folder read "no such image file"
    assert folder.output.strip() == (f"error: {empty}: a folder with no image file in it or its "
                                     "subfolders")


def test_status_and_logs_without_a_job_show_the_newest_one(work):
    """New-user trial: `stoker status` needed a job argument. Without one it shows the job
    `stoker jobs` lists first (the newest folder); with no job at all, one line, exit 2."""
    jobs = work / "jobs"
    for age_s, name in enumerate(["dddd4444-torn", "cccc3333-stopped", "aaaa1111-done",
                                  "bbbb2222-training"]):
        stamp = time.time() - 100 * age_s
        os.utime(jobs / name, (stamp, stamp))  # the torn job is the newest, then stopped, ...
    rows = CliRunner().invoke(app, ["jobs", "--work-dir", str(work)]).output.splitlines()
    assert rows[2].split()[0] == "dddd4444-torn"
    result = CliRunner().invoke(app, ["status", "--work-dir", str(work)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].split() == ["job", "dddd4444-torn"]
    os.utime(jobs / "bbbb2222-training")  # now it is the newest
    logs = CliRunner().invoke(app, ["logs", "--work-dir", str(work)])
    assert logs.exit_code == 0 and logs.output == "attempt 1 on spot capacity\n[rank0] step 40\n"
    for command in ("status", "logs"):
        none = CliRunner().invoke(app, [command, "--work-dir", str(work / "elsewhere")])
        assert none.exit_code == 2 and none.output.count("\n") == 1, none.output
        assert none.output.startswith("error: no jobs in ")


def test_status_of_a_stopped_job_says_who_stopped_it(work):
    """New-user trial: after Ctrl-C `stoker status` said only `attempt 1: interrupted`; the
    record's `stopped_by` is shown, and a stop request's author as before."""
    job = work / "jobs" / "eeee5555-ctrl-c"
    job.mkdir()
    log = AttemptLog(job)
    log.start(1, "on_demand")
    log.close_interrupted(stopped_by="SIGINT (Ctrl-C)")
    result = CliRunner().invoke(app, ["status", "eeee", "--work-dir", str(work)])
    assert result.exit_code == 0, result.output
    assert "state      stopped (stopped by SIGINT (Ctrl-C))" in result.output
    assert "attempt 1: interrupted (stopped by SIGINT (Ctrl-C)) after " in result.output
    assert "resume it: run the same command again" in result.output
    guard = CliRunner().invoke(app, ["status", "cccc", "--work-dir", str(work)]).output
    assert "state      stopped (stopped by cost-guard: stalled)" in guard


def test_jobs_and_status_name_the_work_folder_they_read(work, monkeypatch):
    """New-user trial: run from another folder, `stoker jobs` listed an older session's jobs
    under ./work without saying so. Its first line names the folder it read (absolute), as the
    empty case's `no jobs in ...` does; `stoker status` names the job's folder in it."""
    monkeypatch.chdir(work.parent)
    result = CliRunner().invoke(app, ["jobs", "--work-dir", work.name])
    assert result.exit_code == 0, result.output
    first, header = result.output.splitlines()[:2]
    assert first == f"jobs in {work.resolve() / 'jobs'}"
    assert header.split()[:2] == ["JOB", "STATE"]
    status = CliRunner().invoke(app, ["status", "aaaa", "--work-dir", work.name])
    assert status.exit_code == 0, status.output
    assert f"folder     {work.resolve() / 'jobs' / 'aaaa1111-done'}" in status.output.splitlines()
