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


KILLED_WHILE_MIGRATING = """
import os, sys
import mlflow.store.db.utils as db_utils
from stoker.runtime.tracking import ensure_store

def upgrade_then_die(engine):
    # A SIGKILL in the middle of the schema migrations: the initial tables are written, the
    # migrations' batch table (what CI saw left behind) is half made.
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE _alembic_tmp_experiments (id INTEGER)")
    os._exit(137)

db_utils._upgrade_db = upgrade_then_die
if sys.argv[2] == "rank":  # a rank's tracking opens the store
    ensure_store(sys.argv[1])
else:  # the pipeline's first contact: the lineage check of the pull step
    from stoker.tracking.registry import Lineage, check_lineage
    check_lineage(sys.argv[1], "model", Lineage(("cat", "dog"), (3, 8, 8)))
"""


@pytest.mark.parametrize("who", ["rank", "pull step"])
def test_a_store_whose_creation_was_killed_is_not_left_half_made(tmp_path: Path, who):
    """A process SIGKILLed while it created the embedded store (a rank in the first seconds of a
    job, or the pipeline's pull step) must not leave a half-migrated store that fails every later
    run of the work folder."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_MIGRATING, uri, who],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == 137, killed.stderr[-2000:]
    from stoker.runtime.tracking import RunTracker

    tracker = RunTracker(uri, "after-a-kill", run_name="next")  # the next attempt
    tracker.end("FINISHED")
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "FINISHED"
