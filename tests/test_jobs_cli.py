"""`stoker jobs`, `stoker status` and `stoker logs` over job folders as the pipeline leaves them:
done, training (a live lease), stopped, unfinished with a torn record; odd values are tolerated."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stoker.cli import app
from stoker.jobs.attempts import AttemptLog
from stoker.jobs.job import mark_done
from stoker.jobs.stop_request import request_stop
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
    # A done job's heartbeat is its last, not a sign of life (trial: "HEARTBEAT 27 s ago").
    assert result.output.splitlines()[1].split()[-2:] == ["LAST", "HEARTBEAT"]


def test_status_of_one_job_by_prefix(work):
    result = CliRunner().invoke(app, ["status", "bbbb", "--work-dir", str(work)])
    assert result.exit_code == 0, result.output
    assert f"training (host {socket.gethostname()} pid {os.getpid()})" in result.output
    assert "step 40/100 (attempt 1)" in result.output and "ETA" in result.output
    assert "attempt 1: preempted (exit 75) after 30.0 s on spot capacity" in result.output
    assert re.search(r"^heartbeat  \d+ s ago$", result.output, re.M), result.output  # alive
    unfinished = CliRunner().invoke(app, ["status", "dddd4444-torn", "--work-dir", str(work)])
    assert "resume it: run the same command again" in unfinished.output
    assert "(its last: nothing trains an unfinished job)" in unfinished.output
    # A done job's heartbeat is its last, not a sign of life (new-user trial).
    done = CliRunner().invoke(app, ["status", "aaaa", "--work-dir", str(work)]).output
    assert re.search(r"^heartbeat  \d+ s ago \(its last: nothing trains a done job\)$", done,
                     re.M), done


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
    # A run stopped at once by a second Ctrl-C: the job is stopped, so its open attempt is not
    # said to be a dead run's (trial: "stopped" above "left open by a run that died").
    from stoker.runtime.preemption import SENDER_PREFIX, mark_stopped_at_once, record_stop_sender

    stopped = work / "jobs" / "eeee5555-stopped"
    stopped.mkdir()
    AttemptLog(stopped).start(1, "spot")
    record_stop_sender(stopped, f"{SENDER_PREFIX}SIGINT (Ctrl-C)")
    mark_stopped_at_once(stopped)
    twice = CliRunner().invoke(app, ["status", "eeee", "--work-dir", str(work)]).output
    assert re.search(r"^state +stopped \(stopped by SIGINT \(Ctrl-C\)\)", twice, re.M), twice
    assert "attempt 1: left open by a run that was stopped before it could close it (started " \
        "0 s ago); it is closed and billed when the job resumes" in twice, twice


def left_by_a_killed_run(jobs: Path, name: str, reached: int, stop_checkpoint: bool) -> Path:
    """A job whose `stoker run` got `kill -9` in attempt 1, as the runtime's own writer leaves
    it: steps from a resume at step 6300 up to ``reached``, a committed checkpoint, and (when its
    ranks got the parent-death signal in time) the stop checkpoint and `end` outcome preempted;
    then a torn last line (rank 0 killed mid-write). train.log stops where its run died."""
    from stoker.runtime.progress import ProgressWriter

    job = jobs / name
    log = AttemptLog(job)
    job.mkdir(parents=True)
    log.start(1, "on_demand", "flow-run-1")
    (job / "train.log").write_text("attempt 1 on on_demand capacity\n"
                                   "[rank0] 2026-12-01 11:17:12,374 INFO stoker.runtime: resumed "
                                   "at step 6300\n")
    progress = ProgressWriter(job, world_size=2)
    progress.event("start", 6300, total_steps=8000, resumed=True)
    checkpoint = reached if stop_checkpoint else 6350
    for step in range(6301, reached + 1):
        progress.event("step", step, epoch=3, loss=0.1, lr=0.01, samples_per_s=900.0)
        if step == checkpoint:
            (job / "checkpoints" / f"step-{step:09d}").mkdir(parents=True)
            (job / "checkpoints" / f"step-{step:09d}" / "COMMITTED").touch()
            progress.event("checkpoint", step, path=str(job / "checkpoints"))
    if stop_checkpoint:
        progress.event("end", reached, outcome="preempted")
    progress.close()
    with open(job / "progress.jsonl", "a") as f:
        f.write('{"event": "step", "step": 63')
    return job


def test_status_resumes_at_the_last_committed_marker_not_the_last_checkpoint_event(tmp_path):
    """New-user trial (issue 49): on a node that has only the bucket, `stoker status` took the
    resume step from the progress events, which reach the bucket every few seconds, while the
    COMMITTED markers are written through: it showed an older step than a resume starts at."""
    job = left_by_a_killed_run(tmp_path / "jobs", "jjjj0000-lagging", 6372, False)
    marker = job / "checkpoints" / "step-000006370"  # committed; its event not synced yet
    marker.mkdir()
    (marker / "COMMITTED").touch()
    shown = CliRunner().invoke(app, ["status", "jjjj", "--work-dir", str(tmp_path)]).output
    assert "reached step 6372/8000, resumes at step 6370" in shown, shown


def test_a_job_stopped_at_once_counts_its_lost_steps_and_is_not_said_to_have_died(tmp_path):
    """New-user trial, a double Ctrl-C: `stoker status` said `steps lost 0` beside `reached
    step 705/1449, resumes at step 700` (the open attempt's steps counted only once the next
    run closed it); and once closed, the attempt read both `interrupted (stopped by SIGINT
    (Ctrl-C))` and `its run's process died`."""
    from stoker.launch.supervisor import close_left_open
    from stoker.runtime.preemption import SENDER_PREFIX, mark_stopped_at_once, record_stop_sender

    killed = left_by_a_killed_run(tmp_path / "jobs", "iiii9999-killed", 6372, False)
    record_stop_sender(killed, f"{SENDER_PREFIX}SIGINT (Ctrl-C)")  # then kill -9, no second
    killed_status = CliRunner().invoke(app, ["status", "iiii", "--work-dir",
                                             str(tmp_path)]).output
    assert re.search(r"^state +unfinished", killed_status, re.M), killed_status  # trial
    [closed] = close_left_open(AttemptLog(killed), str(killed / "checkpoints"), lambda _: None)
    assert "stopped_by" not in closed
    assert "the run that started it died" in (killed / "train.log").read_text()

    job = left_by_a_killed_run(tmp_path / "jobs", "hhhh8888-twice", 6372, False)
    record_stop_sender(job, f"{SENDER_PREFIX}SIGINT (Ctrl-C)")  # the first Ctrl-C's record
    mark_stopped_at_once(job)  # and the second's
    before = CliRunner().invoke(app, ["status", "hhhh", "--work-dir", str(tmp_path)]).output
    assert re.search(r"^state +stopped \(stopped by SIGINT \(Ctrl-C\)\)", before, re.M), before
    assert "reached step 6372/8000, resumes at step 6350" in before, before
    assert "steps lost 22" in before.splitlines(), before
    [closed] = close_left_open(AttemptLog(job), str(job / "checkpoints"), lambda line: None)
    assert closed["stopped_by"] == "SIGINT (Ctrl-C)" and closed["steps_lost"] == 22
    # Trial: train.log's line said "the run that started it died" here too.
    note = (job / "train.log").read_text().splitlines()[-1]
    assert ("attempt 1 closed as interrupted by this run: the run that started it was stopped "
            "at once (a second signal after SIGINT (Ctrl-C)), so no one recorded its end") in \
        note and "died" not in note, note
    after = CliRunner().invoke(app, ["status", "hhhh", "--work-dir", str(tmp_path)]).output
    assert "steps lost 22" in after.splitlines(), after
    assert "its run's process died" not in after, after
    assert ("its run was stopped at once, without waiting to record the attempt's end (the "
            "next run closed it); its ranks recorded no end: reached step 6372") in after, after


def test_status_says_why_a_left_open_attempt_was_closed_and_what_its_ranks_did(tmp_path):
    """New-user trial: after `kill -9` of `stoker run`, the next run closed the attempt and
    `stoker status` said only `interrupted after 10.7 s`, though its ranks had committed a stop
    checkpoint at step 6372 (in progress.jsonl, not in train.log: no one read their output).
    Now status says why it was closed and what the ranks did, and train.log says so too."""
    from stoker.launch.supervisor import close_left_open

    jobs = tmp_path / "jobs"
    for name, reached, stop in (("ffff6666-stopped-ranks", 6372, True),
                                ("gggg7777-killed-ranks", 6372, False)):
        job = left_by_a_killed_run(jobs, name, reached, stop)
        forwarded: list[str] = []
        [closed] = close_left_open(AttemptLog(job), str(job / "checkpoints"), forwarded.append)
        assert closed["number"] == 1 and closed["left_open"]
        result = CliRunner().invoke(app, ["status", name[:4], "--work-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("attempt 1: "))
        assert lines[head].startswith("attempt 1: interrupted after ")
        why = "its run's process died (no one recorded the attempt's end; the next run closed it)"
        did = ("its ranks committed a stop checkpoint at step 6372" if stop else
               "its ranks recorded no end: reached step 6372, last checkpoint at step 6350, "
               "22 step(s) lost")
        assert lines[head + 1].strip() == f"{why}; {did}"
        assert f"steps lost {0 if stop else 22}" in lines
        log = (job / "train.log").read_text().splitlines()
        assert len(log) == 3 and log[-1].endswith(
            f"attempt 1 closed as interrupted by this run: the run that started it died, so no "
            f"one recorded its end and its output after that is not in this log; in "
            f"progress.jsonl, {did} (billed {closed['duration_s']:.1f} s)")
        assert forwarded == [log[-1][-len(forwarded[0]):]]  # the Prefect log says it too
        assert close_left_open(AttemptLog(job), str(job / "checkpoints"), print) == []


def test_logs_prints_whole_lines_and_unknown_jobs_are_one_line(work):
    result = CliRunner().invoke(app, ["logs", "bbbb2222-training", "--work-dir", str(work)])
    assert result.exit_code == 0
    assert result.output == "attempt 1 on spot capacity\n[rank0] step 40\n"  # no torn line
    missing = CliRunner().invoke(app, ["logs", "nope", "--work-dir", str(work)])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1
    assert "job 'nope': no such job" in missing.output
    empty = CliRunner().invoke(app, ["jobs", "--work-dir", str(work / "elsewhere")])
    assert empty.exit_code == 0 and "no jobs in" in empty.output


def test_a_prefix_several_jobs_share_lists_them_and_a_name_is_never_a_pattern(tmp_path):
    """New-user trial: jobs of the same settings share their first 12 characters, and
    `stoker status 8bce` said "no such job" although three jobs start with it."""
    jobs = tmp_path / "jobs"
    names = [f"8bce16e300c7-20261203T1322{i}7629950Z" for i in range(3)]
    for name in names:
        (jobs / name).mkdir(parents=True)
    (jobs / "other").mkdir()
    for command in ("status", "logs", "stop"):
        result = CliRunner().invoke(app, [command, "8bce", "--work-dir", str(tmp_path)])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            f"error: job '8bce' matches 3 jobs in {jobs}: {', '.join(names)}; give more of "
            "the name"], command
    one = CliRunner().invoke(app, ["logs", names[1][:27], "--work-dir", str(tmp_path)])
    assert one.exit_code == 0, one.output
    for pattern in ("*", "8bce*", "[8]bce", "..", "../jobs", ""):  # untrusted: never a glob
        result = CliRunner().invoke(app, ["logs", pattern, "--work-dir", str(tmp_path)])
        assert result.exit_code == 2 and "no such job" in result.output, (pattern, result.output)


def test_predict_from_another_folder_creates_nothing_and_says_where_it_looked(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["predict", "x.png"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: no MLflow store at work/mlflow.db: tracking URI sqlite:///work/mlflow.db (from "
        f"{tmp_path}); point --work-dir or --tracking-uri at your store"]
    assert list(tmp_path.iterdir()) == []  # no stray work/mlflow.db, no work/.prefect
    # Trial: every job command took --work-dir but predict; it reads that folder's store.
    elsewhere = CliRunner().invoke(app, ["predict", "x.png", "--work-dir", str(tmp_path / "w")])
    assert elsewhere.exit_code == 2
    assert elsewhere.output.strip().splitlines() == [
        f"error: no MLflow store at {tmp_path / 'w' / 'mlflow.db'}: tracking URI "
        f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}; point --work-dir or --tracking-uri at your "
        "store"]
    assert list(tmp_path.iterdir()) == []


def test_predict_names_a_tracking_server_that_does_not_answer_in_seconds(tmp_path):
    """Trial: `stoker predict --tracking-uri http://127.0.0.1:9` (nothing listening) took 249 s
    of MLflow's retries, then printed their whole message; `stoker run` refuses it at once."""
    from PIL import Image

    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "stoker.cli", "predict", str(image),
                             "--tracking-uri", f"http://127.0.0.1:{port}"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert time.monotonic() - started < 30
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --tracking-uri: no MLflow server answers at "
                           f"http://127.0.0.1:{port} ("), line


def test_predict_names_a_missing_model_in_one_line(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_registered_model("shapes-data")  # the store, with another model
    from PIL import Image

    image = tmp_path / "x.png"  # a readable image: what is refused is the model
    Image.new("RGB", (8, 8)).save(image)
    result = CliRunner().invoke(app, ["predict", str(image), "--tracking-uri", uri,
                                      "--model-uri", "models:/nope@champion"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error: models:/nope@champion: ")
    assert f"tracking URI {uri}" in result.output
    # what the store holds, so that a user of their own data finds their model's name
    assert "registered models there: shapes-data" in result.output
    assert "--model-uri models:/shapes-data@champion" in result.output

    # No --model-uri, several models and not the demo's: which one is not guessed.
    MlflowClient(uri).create_registered_model("colours-data")
    several = CliRunner().invoke(app, ["predict", str(image), "--tracking-uri", uri])
    assert several.exit_code == 2 and several.output.strip().splitlines() == [
        "error: no --model-uri, and the store holds 2 registered models: colours-data, "
        f"shapes-data; e.g. --model-uri models:/colours-data@champion (tracking URI {uri}; "
        "point --work-dir or --tracking-uri at your store)"]

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


def test_a_stopped_hung_attempt_is_billed_until_its_run_closed_it(work, monkeypatch):
    """New-user trial: an attempt whose data worker hung wrote nothing for 110 s, then Ctrl-C:
    it was billed 23.7 s (start to its last trace) for 134 s held. The run that stops an
    attempt was there until the end and bills it to then; an attempt left open by a dead run
    is still billed to its last trace (nothing else is known)."""
    import json
    import time

    for name, left_open in (("ffff6666-hung", False), ("ffff7777-dead", True)):
        job = work / "jobs" / name
        job.mkdir()
        log = AttemptLog(job)
        monkeypatch.setattr(time, "time", lambda: 1_000.0)
        log.start(1, "on_demand")
        (job / "progress.jsonl").write_text(json.dumps(
            {"event": "step", "step": 5, "time": 1_020.0, "attempt": 1}) + "\n")
        monkeypatch.setattr(time, "time", lambda: 1_134.0)
        (closed,) = log.close_interrupted(stopped_by=None if left_open else "SIGINT (Ctrl-C)",
                                          left_open=left_open)
        assert closed["duration_s"] == (20.0 if left_open else 134.0), name


def test_an_attempt_ended_by_a_lost_data_worker_is_not_called_a_failure():
    """Second trial: Ctrl-C while a data worker was frozen; the ranks ended the attempt as
    infrastructure (the stall), and the line said "its ranks failed at step 30"."""
    from stoker.jobs.attempts import describe_interrupted

    record = {"interrupted": True, "runtime_outcome": "infrastructure_failure",
              "runtime_end_step": 30, "reached_step": 30, "committed_step": 30,
              "steps_lost": 0}
    assert describe_interrupted(record) == (
        "its ranks ended at step 30 without a stop checkpoint (a data worker or a peer rank was "
        "lost), last checkpoint at step 30, 0 step(s) lost")


def test_a_checkpoint_newer_than_the_last_progress_record_is_not_a_contradiction():
    """A bucket's copy of progress.jsonl lags its checkpoints (synced every few seconds): the
    next node read "reached step 200, last checkpoint at step 222" after a kill -9 (trial)."""
    from stoker.jobs.attempts import describe_interrupted

    record = {"interrupted": True, "runtime_outcome": None, "runtime_end_step": None,
              "reached_step": 200, "committed_step": 222, "steps_lost": 0}
    assert describe_interrupted(record) == (
        "its ranks recorded no end: their last progress record says step 200, and a "
        "checkpoint of step 222 committed after it (the last one), no step lost")
