"""The standby launcher (issue 17: an attempt's start-up): ``stoker run`` starts the first
attempt's launcher before its flow, so that torch and the runtime are imported while Prefect
starts and the data is pulled. Real processes: a standby, a torchrun attempt handed to it, a
parent killed with SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from stoker.launch import local
from stoker.launch.local import LocalLauncher, discard_standby, prestart, take_standby


@pytest.fixture(autouse=True)
def no_standby_left():
    yield
    discard_standby()


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.integration
def test_the_first_attempt_takes_the_standby_and_trains_the_same_weights(make_spec):
    """Handed over, the standby is the attempt's launcher (same pid, its own session), gets the
    attempt's whole environment, and trains the same weights as a launcher started cold."""
    cold = make_spec("cold", tracking=False, epochs=1)
    assert LocalLauncher(2).run(cold, on_line=lambda _line: None, timeout_s=600) == 0

    standby = prestart(2)
    warm = make_spec("warm", tracking=False, epochs=1)
    launcher = LocalLauncher(2, env={"STOKER_HANDED_OVER": "yes"})
    lines: list[str] = []
    assert launcher.run(warm, on_line=lines.append, timeout_s=600) == 0, "\n".join(lines[-30:])
    assert launcher.process is standby.process  # the standby ran the attempt
    assert local._standby is None  # taken: the next attempt starts cold (or from a new one)
    assert any(line.startswith("[rank0] ") for line in lines), lines[-20:]
    before = torch.load(cold.parent / "final" / "model.pt")
    after = torch.load(warm.parent / "final" / "model.pt")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_standby_of_another_import_time_environment_is_not_taken():
    """Threads, interpreter and start method are fixed when torch is imported: an attempt that
    wants others starts cold, and the standby that does not fit is ended, not left behind."""
    standby = prestart(2)
    pid = standby.process.pid
    env = LocalLauncher(2, env={"OMP_NUM_THREADS": "2"}).environment()
    assert take_standby(sys.executable, env) is None
    assert _gone(pid, 10) and local._standby is None
    # Variables read later (Prefect's, MLflow's, Stoker's) do not matter: they are handed over.
    standby = prestart(2)
    env = LocalLauncher(2, env={"MLFLOW_TRACKING_URI": "sqlite:///x.db",
                                "STOKER_JOB": "a"}).environment()
    assert take_standby(sys.executable, env) is standby
    assert take_standby("/other/python", env) is None  # none is left


def test_a_standby_ends_when_its_input_closes_and_when_its_parent_is_killed(tmp_path):
    """Unused, a standby never outlives its orchestrator: discarded it is reaped at once, and
    when the orchestrator is SIGKILLed its pipe closes (and PR_SET_PDEATHSIG fires)."""
    standby = prestart(2)
    pid = standby.process.pid
    discard_standby()
    assert _gone(pid, 5)

    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from stoker.launch.local import prestart\n"
         "print(prestart(2).process.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.kill()
    parent.wait()
    assert _gone(child), "the standby outlived its SIGKILLed parent"


def test_end_of_input_before_an_attempt_runs_nothing(tmp_path, monkeypatch):
    """The standby's side: no attempt line (the orchestrator went away) is exit 0, nothing
    started and nothing written."""
    import io

    from stoker.runtime.launch import standby

    monkeypatch.chdir(tmp_path)
    assert standby(io.StringIO("")) == 0
    assert list(tmp_path.iterdir()) == []
