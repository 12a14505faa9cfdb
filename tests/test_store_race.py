"""Input 8: first runs started together on a fresh work folder must not race on creating the
embedded MLflow store (real processes, real sqlite)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.integration

FIRST_RUN = """
import sys, time
from pathlib import Path
from stoker.runtime.tracking import RunTracker
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
tracker = RunTracker(sys.argv[1], f"experiment-{sys.argv[3]}", run_name=f"run-{sys.argv[3]}")
tracker.end("FINISHED")
"""


def test_first_runs_at_once_all_create_their_runs(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_RUN, uri, str(go), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(4)]
    time.sleep(8)  # every process has imported MLflow and waits for the signal
    go.touch()
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-1500:] for o in outputs)
    client = MlflowClient(uri)
    names = {e.name for e in client.search_experiments()}
    assert {f"experiment-{i}" for i in range(4)} <= names
