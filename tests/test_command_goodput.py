"""Goodput as the user waits for it: useful step time over the whole ``stoker run``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from local_servers import embedded_env
from mlflow import MlflowClient
from test_startup_gc import imports_then_settled, probed_env, records

from stoker.tracking.command_goodput import command_goodput


def test_command_goodput_is_useful_time_over_the_command_wall_time():
    assert command_goodput(30.0, 1000.0, 1100.0) == 0.3
    assert command_goodput(5.0, 1000.0, 1000.0) == 0.0  # no wall time: no share
    with pytest.raises(ValueError, match="ended_at >= started_at"):
        command_goodput(5.0, 1000.0, 999.0)


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
