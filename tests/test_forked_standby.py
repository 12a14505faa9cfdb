"""The standby launcher forked from ``stoker run`` (issue 45: the default job's CPU).

``stoker run`` imported MLflow for its own tracking, and its standby launcher, a new interpreter,
imported it again for the forked rank 0: about 2 CPU-s of a 13 CPU-s default job. Forked from
the command once MLflow is imported, the launcher inherits it. Real processes: a command that
prestarts the standby, a torchrun attempt handed to it whose rank 0 tracks to a real sqlite
store, a command killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import process_gone

from stoker.launch import local
from stoker.launch.local import LocalLauncher, can_fork_standby
from stoker.runtime.launch import gpu_device_present

REPO = Path(__file__).resolve().parents[1]

# A command as `stoker run` is when it prestarts: one thread, MLflow not yet imported.
COMMAND = """
import json, os, sys
from stoker.launch.local import ForkedStandby, LocalLauncher, prestart
from stoker.runtime.preemption import name_process
assert "mlflow" not in sys.modules
name_process("stoker")  # as the `stoker` console script is named
standby = prestart(2)
print(json.dumps({"forked": isinstance(standby.process, ForkedStandby),
                  "pid": standby.process.pid}), flush=True)
if sys.argv[1] == "wait":
    import time
    time.sleep(600)
lines = []
launcher = LocalLauncher(2, env={"STOKER_HANDED_OVER": "yes"})
code = launcher.run(sys.argv[1], on_line=lines.append, timeout_s=600)
print(json.dumps({"code": code, "took": launcher.process is standby.process,
                  "lines": lines[-40:]}), flush=True)
"""


def _command(arg: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", COMMAND, arg], stdout=subprocess.PIPE, text=True, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)})


needs_forked_ranks = pytest.mark.skipif(
    gpu_device_present(), reason="a GPU device file: ranks and standby start as new interpreters")


@needs_forked_ranks
@pytest.mark.integration
def test_a_forked_standby_runs_the_attempt_and_rank_0_tracks_to_the_store(make_spec, tmp_path):
    """Forked from the command, the standby is the attempt's launcher: its ranks train, rank 0
    logs to the real sqlite store with the MLflow the command imported, and the run's metrics
    read back from the store."""
    spec = make_spec("forked", epochs=1)
    command = _command(str(spec), tmp_path)
    out, _ = command.communicate(timeout=600)
    started, ended = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert started["forked"] is True
    assert ended["code"] == 0 and ended["took"] is True, "\n".join(ended["lines"])
    assert any(line.startswith("[rank0] ") for line in ended["lines"])
    assert process_gone(started["pid"], 10)

    from mlflow import MlflowClient

    run_id = (spec.parent / "mlflow_run_id").read_text().strip()
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FINISHED"
    assert "val_accuracy" in run.data.metrics and "train_loss" in run.data.metrics


@needs_forked_ranks
def test_a_forked_standby_is_its_own_session_and_dies_with_its_command(tmp_path):
    """As a started one: its own session, the line ``python -m stoker.runtime.launch
    --standby`` in ``ps``, and gone when its command is SIGKILLed (its pipe closes,
    PR_SET_PDEATHSIG fires)."""
    command = _command("wait", tmp_path)
    started = json.loads(command.stdout.readline())
    assert started["forked"] is True
    pid = started["pid"]
    assert os.getsid(pid) == pid
    # Its line and its name are set one after the other (setproctitle renames the process
    # on its way): wait for both, then hold them to what a new interpreter shows.
    # Named as a new interpreter is, not as the command (`pgrep -x stoker` finds the command).
    wanted = ("python -m stoker.runtime.launch --standby", Path(sys.executable).name[:15])
    deadline = time.monotonic() + 30
    while True:
        process = psutil.Process(pid)
        shown = (" ".join(process.cmdline()).strip(), process.name())
        if shown == wanted or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert shown == wanted
    command.send_signal(signal.SIGKILL)
    command.wait()
    assert process_gone(pid), "the forked standby outlived its SIGKILLed command"


def test_the_standby_is_forked_only_where_a_new_interpreter_would_be_the_same(monkeypatch):
    """Forked ranks, this interpreter, its interpreter-level variables, no other thread: any
    other case starts a new interpreter, as before."""
    env = LocalLauncher(2).environment()
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    if not gpu_device_present():
        assert can_fork_standby(sys.executable, env)
    assert not can_fork_standby(sys.executable, {**env, "STOKER_WORKER_START": "exec"})
    assert not can_fork_standby(sys.executable, {**env, "STOKER_WORKER_START": "bogus"})
    assert not can_fork_standby("/other/python", env)
    assert not can_fork_standby(sys.executable, {**env, "PYTHONPATH": "/elsewhere"})
    assert not can_fork_standby(sys.executable, {**env, "LD_PRELOAD": "libx.so"})
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # a lock may be held: no fork
    assert not can_fork_standby(sys.executable, env)


def test_a_command_with_a_thread_starts_a_new_interpreter(monkeypatch):
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    standby = local.prestart(2)
    try:
        assert isinstance(standby.process, subprocess.Popen)
    finally:
        local.discard_standby()
