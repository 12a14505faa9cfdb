"""``stoker server status`` of a local server whose process lives but does not answer (yet): a
real process stands for the server, its record as ``stoker.local_server`` writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stoker.local_server import RECORD, free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def silent_server(tmp_path):
    """(home, write): a live process that listens nowhere, and ``write(started)`` that records
    it as the home's server, started at ``started`` (epoch seconds)."""
    home = tmp_path / "prefect"
    home.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def write(started: float) -> None:
        port = free_port()
        (home / RECORD).write_text(json.dumps({
            "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
            "port": port, "api_url": f"http://127.0.0.1:{port}/api", "started": started}))

    yield home, write
    proc.kill()
    proc.wait(timeout=10)


def status(home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.run([sys.executable, "-m", "stoker.cli", "server", "status"],
                          env=env | {"PREFECT_HOME": str(home),
                                     "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"},
                          capture_output=True, text=True, timeout=120)


def test_a_server_still_starting_is_said_starting_not_to_be_stopped(silent_server):
    """Issue 45 trial: status advised `stoker server stop` for a server 5 s into its start."""
    home, write = silent_server
    write(time.time() - 5)
    said = status(home)
    assert said.returncode == 1, said.stdout + said.stderr
    assert said.stdout.startswith("starting (for "), said.stdout
    assert "of its 120 s start timeout" in said.stdout and "stop" not in said.stdout


def test_a_server_whose_database_is_being_prepared_is_said_starting(tmp_path):
    """Before the record: the first start prepares the database (its process holds the lock)."""
    from stoker.server_database import PREPARE_LOCK

    home = tmp_path / "prefect"
    home.mkdir()
    holder = subprocess.Popen(  # as the preparation holds it, in a process of its own
        [sys.executable, "-c", "import sys, time; from filelock import FileLock\n"
         "with FileLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)",
         str(home / PREPARE_LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        said = status(home)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert said.returncode == 1, said.stdout + said.stderr
    assert said.stdout.startswith("starting (preparing the Prefect database, once)"), said.stdout
    assert status(home).stdout.startswith("not running; home ")  # the preparer is gone


def test_a_server_past_its_start_timeout_may_be_stopped(silent_server):
    home, write = silent_server
    write(time.time() - 300)
    said = status(home)
    assert said.returncode == 1, said.stdout + said.stderr
    assert said.stdout.startswith("not running (its process lives but does not answer; "
                                  "`stoker server stop` ends it)"), said.stdout
