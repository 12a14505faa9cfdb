"""The standby launcher (issue 17: an attempt's start-up): ``stoker run`` starts the first
attempt's launcher before its flow, so that torch and the runtime are imported while Prefect
starts and the data is pulled. Real processes: a standby, a torchrun attempt handed to it, a
parent killed with SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import events, process_gone, rank_processes

from stoker.launch import local
from stoker.launch.local import LocalLauncher, discard_standby, prestart, take_standby
from stoker.runtime.launch import PARKED_MARKER

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_standby_left():
    yield
    discard_standby()


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
    assert process_gone(pid, 10) and local._standby is None
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
    assert process_gone(pid, 5)

    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from stoker.launch.local import prestart\n"
         "print(prestart(2).process.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path,
        # The repository, not this worker's sys.path: a model loaded in this worker put its
        # code/ folder (a partial `stoker` package) first there (CI: "No module named
        # 'stoker.runtime.launch'").
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.kill()
    parent.wait()
    assert process_gone(child), "the standby outlived its SIGKILLed parent"


def test_end_of_input_before_an_attempt_runs_nothing(tmp_path, monkeypatch):
    """The standby's side: no attempt line (the orchestrator went away) is exit 0, nothing
    started and nothing written."""
    import io

    from stoker.runtime.launch import standby

    monkeypatch.chdir(tmp_path)
    assert standby(io.StringIO("")) == 0
    assert list(tmp_path.iterdir()) == []


def _sigterm_rank1_at(spec, launcher: LocalLauncher, at_step: int) -> threading.Thread:
    """SIGTERM rank 1 once rank 0 reports ``at_step`` (a preemption of one rank)."""

    def run() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(e["event"] == "step" and e["step"] >= at_step for e in events(spec.parent)):
                proc = launcher.process
                with contextlib.suppress(psutil.Error):
                    ranks = rank_processes(psutil.Process(proc.pid))
                    if 1 in ranks:
                        ranks[1].send_signal(signal.SIGTERM)
                        return
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
def test_a_preempted_attempt_parks_its_launcher_and_the_retry_resumes_in_it(make_spec):
    """Exit 75 leaves the launcher alive (no rank, no other process of its session) as the
    standby; the retry runs in that same process, resumes, and trains the weights of a run
    never interrupted. A completed attempt's launcher ends."""
    straight = make_spec("straight", tracking=False, epochs=2)
    assert LocalLauncher(2).run(straight, on_line=lambda _line: None, timeout_s=600) == 0
    assert local._standby is None  # exit 0: nothing parked
    spec = make_spec("parked", tracking=False, epochs=2)
    launcher = LocalLauncher(2)
    lines: list[str] = []
    _sigterm_rank1_at(spec, launcher, 5)
    assert launcher.run(spec, on_line=lines.append, timeout_s=600) == 75, "\n".join(lines[-30:])
    first = launcher.process
    parked = local._standby
    assert parked is not None and parked.process is first and first.poll() is None
    assert not any(line.startswith(PARKED_MARKER) for line in lines)
    session = [p for p in psutil.process_iter() if p.pid != first.pid
               and _sid(p.pid) == first.pid]
    assert session == [], "the preempted attempt left processes behind"

    lines.clear()
    assert launcher.run(spec, on_line=lines.append, timeout_s=600) == 0, "\n".join(lines[-30:])
    assert launcher.process is first  # the retry took the parked launcher
    assert any("resumed from" in line for line in lines), lines[-20:]
    assert process_gone(first.pid, 10) and local._standby is None
    before = torch.load(straight.parent / "final" / "model.pt")
    after = torch.load(spec.parent / "final" / "model.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)


def at_step(spec, step: int, action) -> threading.Thread:
    """Call ``action()`` in a thread once rank 0 of ``spec``'s job reports ``step``."""

    def run() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(e["event"] == "step" and e["step"] >= step for e in events(spec.parent)):
                action()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


@pytest.mark.integration
def test_a_parked_launcher_that_dies_or_is_discarded_leaves_nothing(make_spec):
    """Signalled while parked it ends (the retry starts cold and still completes); discarded
    (no retry came: the train task's end), it is reaped."""
    spec = make_spec("dies", tracking=False, epochs=2)
    launcher = LocalLauncher(2)
    _sigterm_rank1_at(spec, launcher, 3)
    assert launcher.run(spec, on_line=lambda _line: None, timeout_s=600) == 75
    first = launcher.process
    first.send_signal(signal.SIGTERM)
    assert process_gone(first.pid, 10)
    assert launcher.run(spec, on_line=lambda _line: None, timeout_s=600) == 0
    assert launcher.process is not first

    spec = make_spec("discarded", tracking=False, epochs=2)
    _sigterm_rank1_at(spec, launcher, 3)
    assert launcher.run(spec, on_line=lambda _line: None, timeout_s=600) == 75
    pid = launcher.process.pid
    discard_standby()
    assert process_gone(pid, 5) and local._standby is None


@pytest.mark.integration
def test_a_launcher_stopped_from_outside_is_not_parked(make_spec):
    """SIGTERM to the launcher (a cancel, ``kill``): the ranks commit, exit 75, and the
    launcher ends: stop means stop, nothing waits for a retry."""
    spec = make_spec("stopped", tracking=False, epochs=3)
    launcher = LocalLauncher(2)

    at_step(spec, 3, lambda: launcher.process.send_signal(signal.SIGTERM))
    assert launcher.run(spec, on_line=lambda _line: None, timeout_s=600) == 75
    assert launcher.process.poll() is not None and local._standby is None


@pytest.mark.integration
def test_a_repeated_stop_signal_leaves_the_ranks_their_stop_checkpoint(make_spec):
    """``kill -9`` of ``stoker run``: Linux sends the launcher its parent-death SIGTERM again at
    each of the dying orchestrator's threads it is handed to (1 to 3 seen). Each one raised
    inside torchrun's wait for the stopping ranks; the third ended the launcher, and its ranks
    were killed before their stop checkpoint (no ``end`` event: the full suite's
    killed-orchestrator test, 1 run in 15 here). Rank 1 is held (SIGSTOP) so that the repeats
    land inside that wait."""
    spec = make_spec("repeated", tracking=False, epochs=3)
    launcher = LocalLauncher(2)

    def stop_launcher_thrice() -> None:
        rank1 = rank_processes(psutil.Process(launcher.process.pid))[1]
        rank1.send_signal(signal.SIGSTOP)
        for _ in range(3):  # as many as seen
            launcher.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        rank1.send_signal(signal.SIGCONT)

    at_step(spec, 3, stop_launcher_thrice)
    lines: list[str] = []
    assert launcher.run(spec, on_line=lines.append, timeout_s=600) == 75, "\n".join(lines[-30:])
    end = [e for e in events(spec.parent) if e["event"] == "end"]
    assert [e["outcome"] for e in end] == ["preempted"], lines[-30:]
    committed = sorted(spec.parent.glob("checkpoints/step-*/COMMITTED"))
    assert committed and committed[-1].parent.name == f"step-{end[0]['step']:09d}"
    # A Ctrl-C beside a cancel (two SIGTERMs) printed torchrun's "--- Logging error ---" with a
    # SignalException traceback raised inside its shutdown's log call (helper trial).
    assert not [line for line in lines if "Logging error" in line or "Traceback" in line], lines


def test_an_error_out_of_the_launcher_leaves_no_process_waiting_forever(tmp_path):
    """A launcher left in interpreter shutdown joins its forked children while a forked rank
    waits for the launcher to read its result: both waited forever, an orphan pair after a
    ``kill -9`` of ``stoker run`` (full suite). Whatever escapes the launcher (here a write to
    the dead orchestrator's pipe, with a forked child waiting as torch's rank wrapper does), the
    process prints it, kills what it started and exits 1."""
    script = "\n".join([
        "import multiprocessing, os",
        "from stoker.runtime.launch import exit_after",
        "def run():",
        "    context = multiprocessing.get_context('fork')",
        "    child = context.Process(target=context.Event().wait)  # waits for the launcher",
        "    child.start()",
        f"    open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))",
        "    raise BrokenPipeError(32, 'Broken pipe')",
        "exit_after(run)",
    ])
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert process.returncode == 1, process.stderr
    assert "BrokenPipeError" in process.stderr
    assert process_gone(int((tmp_path / "child").read_text()), timeout_s=10)


def test_torchruns_timer_joining_itself_is_not_printed_and_other_errors_are():
    """torchrun's rendezvous keep-alive timer, freed by a garbage collection in its own thread,
    runs its finalizer there and fails to join itself (a CI run printed that traceback as a
    budget stop ended the launcher). The launcher leaves that one out of stderr; any other
    error in a finalizer is still printed."""
    probe = (
        "import gc, sys, threading, weakref\n"
        "from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer\n"
        "from stoker.runtime.launch import quiet_timer_self_join\n"
        "if sys.argv[1] == 'quiet': quiet_timer_self_join()\n"
        "holder, done = {}, threading.Event()\n"
        "def tick():\n"
        "    if holder.pop('timer', None) is not None:\n"
        "        gc.collect()\n"
        "        done.set()\n"
        "timer = _PeriodicTimer(__import__('datetime').timedelta(seconds=0.01), tick)\n"
        "timer.start()\n"
        "holder['timer'] = timer\n"
        "del timer\n"
        "done.wait(10)\n"
        "class Box: pass\n"
        "box = Box()\n"
        "weakref.finalize(box, lambda: 1 / 0)\n"  # another finalizer's error: still printed
        "del box\n"
        "print('done', flush=True)\n")
    quiet = subprocess.run([sys.executable, "-c", probe, "quiet"], capture_output=True,
                           text=True, timeout=120)
    loud = subprocess.run([sys.executable, "-c", probe, "loud"], capture_output=True,
                          text=True, timeout=120)
    assert quiet.stdout.strip() == loud.stdout.strip() == "done"
    assert "cannot join current thread" in loud.stderr  # the error is real without the filter
    assert "cannot join current thread" not in quiet.stderr, quiet.stderr
    assert "ZeroDivisionError" in quiet.stderr and "ZeroDivisionError" in loud.stderr


def test_a_stop_signal_to_a_rank_forked_before_its_own_handlers_ends_it():
    """Trial: a Ctrl-C while torchrun started forked ranks printed `Exception ignored in:
    <function _after_at_fork_child_reinit_locks>` ... `SignalException: Process N got signal:
    15`, and that rank trained on for 30 s. A rank that gets a stop signal while it still has
    the launcher's handler (between its fork and its runtime's handlers) ends at once, exit
    128 + the signal; the launcher itself still acts on its first signal (torchrun's
    ``SignalException``)."""
    script = """
import os, signal, sys
from torch.distributed.elastic.multiprocessing import api
from stoker.runtime import launch
launch._act_on_the_first_stop_signal_only()
signal.signal(signal.SIGTERM, api._terminate_process_handler)  # as torchrun registers it
pid = os.fork()
if pid == 0:  # a forked rank, its runtime not started yet
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(0)  # never reached
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
try:
    os.kill(os.getpid(), signal.SIGTERM)
except api.SignalException as e:
    print("launcher", e.sigval.name)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["child 143", "launcher SIGTERM"], done.stdout
    assert "Exception ignored" not in done.stderr
