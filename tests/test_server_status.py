"""``stoker server status`` of a local server whose process lives but does not answer (yet): a
real process stands for the server, its record as ``stoker.local_server`` writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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


def _hold(lock_path: Path) -> subprocess.Popen:
    """A process of its own that holds the file lock ``lock_path`` until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from filelock import FileLock\n"
         "with FileLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)",
         str(lock_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_server_between_its_preparation_and_its_record_is_said_starting(tmp_path):
    """Trial: between the database's preparation and the server's record, status said "not
    running": the command that starts it holds the server's lock all along."""
    home = tmp_path / "prefect"
    home.mkdir()
    holder = _hold(home / "server.lock")
    try:
        said = status(home)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert said.returncode == 1, said.stdout + said.stderr
    assert said.stdout.startswith("starting or stopping (another command holds its lock)"), \
        said.stdout
    assert status(home).stdout.startswith("not running; home ")


def test_the_preparation_holds_its_lock_before_it_imports_prefect(tmp_path):
    """Trial: for its first ~5 s (Prefect's imports) the preparation did not hold its lock yet,
    and status said "not running". Here Prefect's import never ends: the lock is held anyway."""
    from stoker.server_database import _PREPARE, PREPARE_LOCK, preparing

    home, fake = tmp_path / "prefect", tmp_path / "slow-imports"
    home.mkdir()
    (fake / "prefect").mkdir(parents=True)
    (fake / "prefect" / "__init__.py").write_text("import time\ntime.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", _PREPARE, str(home / PREPARE_LOCK)],
                             env={**os.environ, "PYTHONPATH": str(fake)})
    try:
        deadline = time.monotonic() + 60
        while not preparing(home) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert preparing(home)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert not preparing(home)


def _release_later(holder: subprocess.Popen, after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, holder.kill)
    timer.start()
    return timer


def test_a_command_that_waits_for_another_ones_start_says_so(tmp_path):
    """Trial: the second of two first runs was silent for 38 s while the first one prepared
    the database and started the server (it held the server's lock)."""
    from stoker.local_server import LocalServer

    home = tmp_path / "prefect"
    home.mkdir()
    said: list[str] = []
    holder = _hold(home / "server.lock")
    timer = _release_later(holder, 2.0)
    try:  # no record: the keeper's call returns once it has the lock, starting nothing
        assert LocalServer(home, say=said.append).ensure(only_if_recorded=True) == (None, False)
    finally:
        timer.join()
        holder.wait(timeout=10)
    assert len(said) == 1 and said[0].startswith(
        "waiting for another command that is starting or stopping the local Prefect server"), said


def test_a_preparation_that_waits_for_an_earlier_one_says_so(tmp_path):
    """Trial: a preparation left running by a kill -9 of its command was waited for silently."""
    from stoker.server_database import PREPARE_LOCK, DatabaseError, prepare_database

    home, fake = tmp_path / "prefect", tmp_path / "no-prefect"
    home.mkdir()
    (fake / "prefect").mkdir(parents=True)  # this preparation then fails fast, after the wait
    (fake / "prefect" / "__init__.py").write_text("raise ImportError('not here')\n")
    said: list[str] = []
    holder = _hold(home / PREPARE_LOCK)
    timer = _release_later(holder, 2.0)
    try:
        with pytest.raises(DatabaseError):
            prepare_database(home, {**os.environ, "PYTHONPATH": str(fake),
                                    "PREFECT_HOME": str(home)}, tmp_path / "server.log",
                             say=said.append, timeout_s=120)
    finally:
        timer.join()
        holder.wait(timeout=10)
    assert said[0].startswith("waiting for an earlier preparation of the Prefect database"), said
