"""Stops that leave something behind, with ``stoker run`` as a user runs it (real Prefect server,
torchrun, gloo ranks, MLflow sqlite): the steps a stop that did not commit lost are counted, and
a job the cost guard stopped for a stall is not resumed into the same stall without saying so."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import events, launcher_of, rank_processes
from mlflow import MlflowClient
from prefect_server import PrefectServer

from stoker.jobs.attempts import AttemptLog, committed_step
from stoker.jobs.status import job_summary
from stoker.jobs.stop_request import read_stop_request, request_stop
from stoker.launch.local import terminate_tree

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-stop")) as running:
        yield running


def stoker(server: PrefectServer, *args: str) -> subprocess.Popen:
    env = {**server.env, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "stoker.cli", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout_s: float = 600) -> tuple[int, str]:
    try:
        out, err = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            terminate_tree(process.pid, grace_s=5)
    return process.returncode, out + err


def training(process: subprocess.Popen, work: Path, min_step: int, timeout_s: float = 300
             ) -> tuple[Path, psutil.Process]:
    """The job folder and torchrun's process once rank 0 reported step ``min_step``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        for job in (work / "jobs").glob("*") if (work / "jobs").is_dir() else []:
            if any(e["event"] == "step" and e["step"] >= min_step for e in events(job)) and (
                    job / "mlflow_run_id").is_file():  # the MLflow run opens in the background
                launcher = launcher_of(psutil.Process(process.pid))
                if launcher is not None:
                    return job, launcher
        time.sleep(0.05)
    raise AssertionError("training never started")


def test_a_stop_that_does_not_commit_counts_the_steps_it_lost(server, tmp_path):
    """Input 5: torchrun gets SIGTERM and rank 0 dies before its stop checkpoint commits (the
    grace ran out mid-save). The attempt is an infrastructure failure whose lost steps (last
    step reached minus last committed step) are in its attempt record, the job's summary,
    ``stoker status`` and the job's MLflow run."""
    work = tmp_path / "work"
    process = stoker(server, "run", f"work_dir={work}", "train.epochs=50",
                     "train.checkpoint_every_steps=1000", "retry.max_infra_failures=0",
                     "tracking.system_metrics_interval_s=null")
    job, torchrun = training(process, work, min_step=3)
    rank0 = rank_processes(torchrun)[0]
    torchrun.send_signal(signal.SIGTERM)
    rank0.kill()
    code, output = finish(process)
    assert code == 1, output[-3000:]
    # The last line says why no attempt followed (new-user trial: it did not name the budget).
    assert output.rstrip().splitlines()[-1].endswith(
        "; no retry left (1 infrastructure_failure attempt, more than "
        "retry.max_infra_failures=0); once its cause is fixed, the same command resumes from "
        f"the last checkpoint (its output: stoker logs {job.name})"), output[-3000:]
    # Trial: the attempt's lines were WARNINGs as for a retried one, though none followed.
    assert re.search(r"\| ERROR +\| .*Finished in state InfrastructureFailure\('exit [^']*: "
                     r"infrastructure_failure, no retry left'", output), output[-3000:]
    assert not re.search(r"\| WARNING +\| .*InfrastructureFailure", output), output[-3000:]
    # Trial: the TrainingFailed text was printed 4 times; the last line says it once.
    assert output.count("did not complete") == 1, output[-3000:]
    assert "Finished in state Failed (TrainingFailed: see the error line)" in output

    (attempt,) = AttemptLog(job).history()
    assert attempt["outcome"] == "infrastructure_failure", attempt
    reached = max(max(e["step"] for e in events(job)),
                  json.loads((job / "heartbeat.json").read_text())["step"])
    committed = committed_step(str(job / "checkpoints"))
    assert attempt["steps_lost"] == reached - committed > 0, (attempt, reached, committed)
    assert job_summary(job).steps_lost == attempt["steps_lost"]

    run_id = (job / "mlflow_run_id").read_text().strip()
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "steps_lost")
    assert [m.value for m in history] == [attempt["steps_lost"]]
    assert client.get_run(run_id).info.status == "KILLED"

    status = subprocess.run([sys.executable, "-m", "stoker.cli", "status", job.name,
                             "--work-dir", str(work)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert f"steps lost {attempt['steps_lost']}" in status.stdout, status.stdout + status.stderr


def test_a_ctrl_c_whose_stop_does_not_commit_logs_the_steps_it_lost(server, tmp_path):
    """New-user trial: Ctrl-C while the ranks could not save (a frozen data worker) lost 48
    steps; the record, the last line and the final figure said so, but the ``steps_lost``
    metric was only logged by attempts that ended on their own, not by a stop."""
    work = tmp_path / "work"
    process = stoker(server, "run", f"work_dir={work}", "train.epochs=50",
                     "train.checkpoint_every_steps=1000", "train.preemption_grace_s=2",
                     "tracking.system_metrics_interval_s=null")
    job, torchrun = training(process, work, min_step=3)
    ranks = list(rank_processes(torchrun).values())
    for rank in ranks:  # they cannot commit a stop checkpoint within the grace
        rank.suspend()
    try:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        code, output = finish(process, timeout_s=120)
    finally:
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.kill()
    assert code == 130, output[-3000:]
    (attempt,) = AttemptLog(job).history()
    assert attempt["stopped_by"] == "SIGINT (Ctrl-C)" and attempt["steps_lost"] > 0, attempt
    assert f"{attempt['steps_lost']} step(s) lost" in output.rstrip().splitlines()[-1]
    run_id = (job / "mlflow_run_id").read_text().strip()
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "steps_lost")
    assert [(m.step, m.value) for m in history] == [(attempt["reached_step"],
                                                     attempt["steps_lost"])]
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_second_ctrl_c_leaves_a_stopped_job_whose_lost_steps_the_next_run_logs(server,
                                                                                 tmp_path):
    """Second new-user trial: after a second Ctrl-C (no stop checkpoint) the last line named no
    job and no way on, ``stoker status`` said ``unfinished`` (as after a crash), and the steps
    it lost reached MLflow only when the job completed. Now the job reads as stopped by the
    Ctrl-C, and the run that resumes it logs ``steps_lost`` at once."""
    work = tmp_path / "work"
    args = ("run", f"work_dir={work}", "train.epochs=50", "train.checkpoint_every_steps=1000",
            "tracking.system_metrics_interval_s=null")
    process = stoker(server, *args)
    job, torchrun = training(process, work, min_step=3)
    for rank in rank_processes(torchrun).values():  # no stop checkpoint can commit
        rank.suspend()
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(1)
    os.killpg(process.pid, signal.SIGINT)  # the second: at once
    code, output = finish(process, timeout_s=60)
    assert code == 130, output[-3000:]
    assert output.rstrip().splitlines()[-1] == (
        "stoker run: stopped at once (second signal), without waiting for the stop "
        "checkpoint; run the same command to resume from the last committed checkpoint")
    summary = job_summary(job)
    assert summary.state == "stopped" and summary.stopped_by == "stopped by SIGINT (Ctrl-C)", \
        summary

    again = stoker(server, *args)  # resumes; it closes the attempt left open first
    try:
        run_id = (job / "mlflow_run_id").read_text().strip()
        client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
        deadline = time.monotonic() + 120
        while not (history := client.get_metric_history(run_id, "steps_lost")):
            assert again.poll() is None and time.monotonic() < deadline, "no steps_lost"
            time.sleep(0.2)
        first = AttemptLog(job).history()[0]
        assert first["stopped_by"] == "SIGINT (Ctrl-C)" and first["steps_lost"] > 0, first
        assert [(m.step, m.value) for m in history] == [(first["reached_step"],
                                                         first["steps_lost"])]
    finally:
        os.killpg(again.pid, signal.SIGINT)  # a clean stop of the resumed run
        finish(again, timeout_s=120)


def test_stoker_stop_stops_a_training_job_on_purpose(server, tmp_path):
    """Second new-user trial: the docs named ``stoker stop``, which did not exist; a user stop
    took Python (``request_stop``) and a signal to a pid the docs did not name. Now: the ranks
    commit a stop checkpoint and name who stopped them, the attempt is stopped (not retried),
    ``stoker run`` exits 3, the MLflow run is KILLED, and ``stoker stop`` says what it left."""
    work = tmp_path / "work"
    process = stoker(server, "run", f"work_dir={work}", "train.epochs=50",
                     "tracking.system_metrics_interval_s=null")
    job, _torchrun = training(process, work, min_step=3)
    # A reason is said on one line everywhere (trial: a newline split stoker stop's line).
    reason = 'main tenance "now"'
    stop = subprocess.run([sys.executable, "-m", "stoker.cli", "stop", job.name[:8],
                           "--reason", 'main\ntenance "now"', "--work-dir", str(work)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**server.env, "PYTHONPATH": str(REPO)})
    code, output = finish(process, timeout_s=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr + output[-3000:]
    assert code == 3, output[-3000:]
    end = [e for e in events(job) if e["event"] == "end"][-1]
    assert end["outcome"] == "preempted"  # the ranks committed their stop checkpoint
    assert committed_step(str(job / "checkpoints")) == end["step"]
    assert stop.stdout.startswith(f"job {job.name} stopped: stopped by user: {reason}; "
                                  "not running: reached step "), stop.stdout
    assert stop.stdout.rstrip().endswith(
        f"resumes at step {end['step']} (run the same command)"), stop.stdout
    assert f"stop requested (SIGTERM: stopped by user: {reason}): checkpoint committed at " \
        f"step {end['step']}" in output, output[-3000:]
    assert [a["outcome"] for a in AttemptLog(job).history()] == ["stopped"]
    # Where `stoker stop` looks for the ranks: the started record names the launcher.
    assert [r.get("launcher") for r in AttemptLog(job).records()] == ["local"]
    # `stoker status` says who stopped the attempt, as for a Ctrl-C (trial: "stopped (exit 75)")
    assert AttemptLog(job).history()[-1]["stopped_by"] == f"user: {reason}"
    # On the terminal too a stop, not an ERROR with a traceback and "Failed" (second trial).
    assert "stopped on request: recorded as Cancelled" in output, output[-3000:]
    # A stop someone asked for is no warning (trial: WARNING here, INFO after a Ctrl-C).
    assert [line for line in output.splitlines() if "attempt 1 ended: stopped" in line
            and "| INFO " in line], output[-3000:]
    # ... and the flow run's last Prefect line says Cancelled, as after a Ctrl-C (trial: none).
    flow_lines = [line for line in output.splitlines() if "| Flow run '" in line]
    assert flow_lines[-1].endswith(
        f"Finished in state Cancelled('job {job.name} stopped by user: {reason}; run the "
        "same command to resume it')"), output[-3000:]
    assert not [line for line in flow_lines if "stopped on request" in line], output[-3000:]
    assert not [line for line in output.splitlines()
                if "TrainingStopped" in line or "| ERROR" in line
                or line.startswith("Traceback")], output[-3000:]
    run_id = (job / "mlflow_run_id").read_text().strip()
    assert MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run_id).info.status == \
        "KILLED"
    again = subprocess.run([sys.executable, "-m", "stoker.cli", "stop", job.name,
                            "--work-dir", str(work)], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env={**server.env, "PYTHONPATH": str(REPO)})
    assert again.returncode == 0 and again.stdout.strip() == \
        f"job {job.name} is not training (stopped); nothing to stop"
    unknown = subprocess.run([sys.executable, "-m", "stoker.cli", "stop", "nope",
                              "--work-dir", str(work)], capture_output=True, text=True,
                             timeout=120, cwd=REPO, env={**server.env, "PYTHONPATH": str(REPO)})
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: job 'nope'")


def test_a_stalled_job_is_not_resumed_into_the_stall_without_the_override(server, tmp_path):
    """Input 6 (tail): the guard stops a stalled job; the next ``stoker run`` of it refuses in
    one line (exit 3) naming the step, who and the override, and changes nothing;
    ``--resume-stalled`` resumes it from the stop checkpoint to the end."""
    work = tmp_path / "work"
    # Enough epochs that the stop lands mid-training: on a loaded machine (two test workers on
    # two cores) 3 epochs could end before rank 0's MLflow run (opened in the background) was
    # there for training() to see, and the job was then done, not stalled.
    command = ["run", f"work_dir={work}", "train.epochs=15",
               "tracking.system_metrics_interval_s=null"]
    process = stoker(server, *command)
    job, torchrun = training(process, work, min_step=5)
    request = request_stop(job, "cost-guard", "stalled: no progress for 600 s",
                           verdict="stalled")  # what the guard writes, then docker stop
    torchrun.send_signal(signal.SIGTERM)
    code, output = finish(process)
    assert code == 3, output[-3000:]
    assert not (job / "result.json").exists(), "training ended before the stop reached it"
    assert request.step is not None and request.step >= 5
    stop_step = [e for e in events(job) if e["event"] == "end"][-1]["step"]
    records = (job / "attempts.jsonl").read_text()

    code, output = finish(stoker(server, *command))
    assert code == 3, output[-3000:]
    refusal = output.strip().splitlines()[-1]  # the command's own last line
    assert refusal.startswith(f"stoker run: job {job.name} stalled at step {request.step} "
                              "and was stopped by cost-guard"), output[-3000:]
    assert "--resume-stalled" in refusal
    assert (job / "attempts.jsonl").read_text() == records  # nothing launched
    assert read_stop_request(job) is not None  # still stopped
    assert sum(e["event"] == "start" for e in events(job)) == 1

    code, output = finish(stoker(server, *command, "--resume-stalled"))
    assert code == 0, output[-3000:]
    starts = [e for e in events(job) if e["event"] == "start"]
    assert len(starts) == 2 and starts[-1]["resumed"] and starts[-1]["step"] == stop_step
    assert (job / "pipeline_done.json").exists()
    assert read_stop_request(job) is None
