"""Goodput as the user waits for it: useful step time over the whole ``stoker run``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from local_servers import embedded_env, stop_local_servers
from mlflow import MlflowClient
from test_startup_gc import imports_then_settled, probed_env, records
from test_stopping import wait_for_training

from stoker.runtime.progress import read_events
from stoker.tracking.command_goodput import command_goodput, command_useful_train_s


def test_command_goodput_is_useful_time_over_the_command_wall_time():
    assert command_goodput(30.0, 1000.0, 1100.0) == 0.3
    assert command_goodput(5.0, 1000.0, 1000.0) == 0.0  # no wall time: no share
    with pytest.raises(ValueError, match="ended_at >= started_at"):
        command_goodput(5.0, 1000.0, 999.0)


def test_a_command_counts_the_step_time_its_own_attempts_committed():
    """A resumed job's earlier commands trained what its checkpoint holds (new-user trial: a
    resumed run showed 1.0, the job's 91.9 s of steps over an 87.1 s command)."""
    earlier = {"event": "start", "time": 900.0, "resumed": False, "train_time_s": 0.0}
    resumed = {"event": "start", "time": 1010.0, "resumed": True, "train_time_s": 60.5}
    retried = {"event": "start", "time": 1050.0, "resumed": True, "train_time_s": 75.0}
    steps = [{"event": "step", "time": 1020.0, "step": 3}]
    assert command_useful_train_s([earlier, resumed, *steps, retried], 91.9, 1000.0) == 31.4
    assert command_useful_train_s([earlier], 91.9, 800.0) == 91.9  # a fresh job: all of it
    assert command_useful_train_s([earlier], 91.9, 1000.0) is None  # found it done: no attempt
    older = {"event": "start", "time": 1010.0, "resumed": True}  # a runtime image before this
    assert command_useful_train_s([earlier, older], 91.9, 1000.0) is None
    assert command_useful_train_s([{**older, "resumed": False}], 9.0, 1000.0) == 9.0
    assert command_useful_train_s([{"event": "start", "time": "x"}, resumed], 60.0, 0) == 0.0


@pytest.mark.integration
def test_a_resumed_stoker_run_counts_only_its_own_steps(tmp_path):
    """Ctrl-C after some steps, then the same command to the end: the second command's
    ``command_goodput`` is the steps it committed over its own wall time, not the job's."""
    work = tmp_path / "work"
    command = [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}", "train.epochs=3",
               "tracking.system_metrics_interval_s=null"]
    env = embedded_env(work)
    try:
        first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / "stoker-run.log", "w"),  # noqa: SIM115
                                 start_new_session=True)
        job_dir = wait_for_training(work, first)
        while not [e for e in read_events(job_dir) if e["event"] == "step" and e["step"] >= 30]:
            assert first.poll() is None, (tmp_path / "stoker-run.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGINT)
        assert first.wait(timeout=120) == 130, (tmp_path / "stoker-run.log").read_text()[-3000:]
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert second.returncode == 0, second.stderr[-3000:]
    finally:
        stop_local_servers(tmp_path)
    summary = json.loads(second.stdout[second.stdout.index("{"):])
    [_, resumed] = [e for e in read_events(job_dir) if e["event"] == "start"]
    assert resumed["resumed"] and resumed["train_time_s"] > 0
    metrics = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(
        summary["run_id"]).data.metrics
    own_s = metrics["useful_train_s"] - resumed["train_time_s"]
    assert metrics["command_useful_train_s"] == pytest.approx(own_s, abs=2e-3)
    assert metrics["command_goodput"] == pytest.approx(own_s / metrics["command_wall_s"],
                                                       abs=1e-3)
    assert summary["cost"]["command_useful_train_s"] == metrics["command_useful_train_s"]
    # Beside the job's goodput, at its last step (trial: at step 0).
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    [goodput] = client.get_metric_history(summary["run_id"], "goodput")
    [own] = client.get_metric_history(summary["run_id"], "command_goodput")
    assert own.step == goodput.step > 0


@pytest.mark.integration
def test_stoker_run_logs_its_command_goodput_beside_the_jobs(tmp_path):
    """New-user finding: the logged goodput (0.81) billed the attempt only, after imports the
    standby launcher had paid; over the `stoker run` the user waited for, useful step time was
    0.3-0.5. Both are logged now, and the command's is the smaller."""
    work = tmp_path / "work"
    probes = tmp_path / "gc"
    probes.mkdir()
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}", "train.epochs=2",
         "tracking.system_metrics_interval_s=null"], env=probed_env(probes, embedded_env(work)),
        capture_output=True, text=True, timeout=900)
    waited_s = time.time() - started
    assert result.returncode == 0, result.stderr[-3000:]
    # The command, its forked standby launcher and the ranks forked from that imported
    # MLflow, Prefect and torch without a full cyclic collection (stoker.runtime.startup_gc).
    command = [r for r in records(probes) if r["argv"][0].endswith("stoker/cli.py")]
    assert len(command) == 4 and all(imports_then_settled(r) for r in command), command
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    metrics = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(
        summary["run_id"]).data.metrics
    assert 0 < metrics["command_goodput"] < metrics["goodput"] <= 1
    assert metrics["command_wall_s"] <= waited_s and metrics["command_wall_s"] > \
        metrics["useful_train_s"]
    assert metrics["command_goodput"] == pytest.approx(
        metrics["useful_train_s"] / metrics["command_wall_s"], abs=1e-3)
    assert summary["cost"]["command_goodput"] == metrics["command_goodput"]
