"""How the ranks start (issue 17: an attempt's start-up): forked from the warm launcher where no
GPU device exists, or exec'd as fresh interpreters; same exit codes, same weights either way."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import events, rank_processes

from stoker.config import ConfigError, load_pipeline_config
from stoker.launch.factory import check_before_pull
from stoker.launch.local import LocalLauncher
from stoker.runtime.launch import WORKER_START_ENV, worker_start

ROOT = Path(__file__).resolve().parents[1]


def test_worker_start_reads_the_variable_and_defaults_by_gpu_device(tmp_path):
    assert worker_start({WORKER_START_ENV: "exec"}, tmp_path) == "exec"
    assert worker_start({WORKER_START_ENV: " Fork "}, tmp_path) == "fork"
    assert worker_start({}, tmp_path) == "fork"  # no GPU device file
    (tmp_path / "nvidiactl").touch()  # the control device alone is no GPU
    assert worker_start({WORKER_START_ENV: "auto"}, tmp_path) == "fork"
    (tmp_path / "nvidia0").touch()
    assert worker_start({}, tmp_path) == "exec"
    assert worker_start({WORKER_START_ENV: "fork"}, tmp_path) == "fork"  # asked for: as said
    (tmp_path / "nvidia0").unlink()
    (tmp_path / "kfd").touch()  # AMD
    assert worker_start({}, tmp_path) == "exec"
    with pytest.raises(ValueError, match=r"STOKER_WORKER_START='spawn': use fork, exec or auto"):
        worker_start({WORKER_START_ENV: "spawn"}, tmp_path)


def test_a_bad_worker_start_is_refused_before_the_pull(monkeypatch):
    monkeypatch.setenv(WORKER_START_ENV, "threads")
    with pytest.raises(ConfigError, match="STOKER_WORKER_START='threads'"):
        check_before_pull(load_pipeline_config(None, []))


def test_the_launch_wrapper_names_a_bad_worker_start_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stoker.runtime.launch", "--nproc-per-node=1",
                           "-m", "stoker.runtime", str(tmp_path / "spec.yaml")],
                          env={**os.environ, WORKER_START_ENV: "x"}, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("stoker.runtime.launch: STOKER_WORKER_START='x': use fork, "
                                   "exec or auto")


def _run(spec: Path, start: str) -> tuple[int, dict[int, dict], list[str]]:
    """One attempt with ``start``; returns its exit code, what was seen of each rank while it
    trained (name, parent, command line) and the output."""
    launcher = LocalLauncher(2, python=sys.executable, env={WORKER_START_ENV: start})
    seen: dict[int, dict] = {}
    lines: list[str] = []

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(seen) < 2:
            proc = launcher.process
            if proc is not None and proc.poll() is None:
                try:
                    agent = psutil.Process(proc.pid)
                    for rank, p in rank_processes(agent).items():
                        seen.setdefault(rank, {"name": p.name(), "ppid": p.ppid(),
                                               "agent": agent.pid, "cmdline": p.cmdline()})
                except psutil.Error:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = launcher.run(spec, on_line=lines.append, timeout_s=600)
    watcher.join(5)
    return code, seen, lines


@pytest.mark.integration
def test_forked_and_execd_ranks_train_the_same_weights(make_spec):
    """Default here (no GPU device): the ranks are forked from the launch wrapper, which runs
    `-m stoker.runtime.launch`; with exec each rank is `python -u -m stoker.runtime SPEC`. Both
    name themselves stoker-rank<N>, end 0, log as [rankN] and give bitwise-equal weights."""
    weights = {}
    for start in ("fork", "exec"):
        spec = make_spec(f"job-{start}", tracking=False, epochs=1)
        code, seen, lines = _run(spec, start)
        assert code == 0, "\n".join(lines[-30:])
        assert sorted(seen) == [0, 1], seen
        for rank, info in seen.items():
            assert info["name"] == f"stoker-rank{rank}" and info["ppid"] == info["agent"]
            # Seen before the rank titles itself: a forked rank shows the launcher's command line
            # (inherited), an exec'd one `python -u -m stoker.runtime SPEC`. Seen after: both show
            # the title `stoker-rank<N> job <JOB>: python -m stoker.runtime SPEC`.
            cmdline = info["cmdline"]
            titled = cmdline[:2] == [f"stoker-rank{rank}", "job"]
            if start == "fork":
                assert titled or "stoker.runtime.launch" in cmdline, info
            else:
                assert "stoker.runtime.launch" not in cmdline, info
                assert titled or cmdline[-3:-1] == ["-m", "stoker.runtime"], info
        assert any(line.startswith("[rank0] ") for line in lines), lines[-20:]
        weights[start] = torch.load(spec.parent / "final" / "model.pt")
    assert weights["fork"].keys() == weights["exec"].keys()
    assert all(torch.equal(weights["fork"][k], weights["exec"][k]) for k in weights["fork"])


@pytest.mark.integration
def test_a_forked_rank_killed_is_an_infrastructure_failure(make_spec):
    """kill -9 of one forked rank: the launcher exits 137 (infrastructure), as for an exec'd
    one, and no rank outlives the attempt."""
    spec = make_spec("killed", tracking=False, epochs=20)
    launcher = LocalLauncher(2, python=sys.executable, env={WORKER_START_ENV: "fork"})
    killed: list[int] = []

    def kill_rank1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            proc = launcher.process
            if proc is not None and (spec.parent / "progress.jsonl").exists():
                ranks = rank_processes(psutil.Process(proc.pid))
                if 1 in ranks:
                    killed.append(ranks[1].pid)
                    ranks[1].kill()
                    return
            time.sleep(0.05)

    threading.Thread(target=kill_rank1, daemon=True).start()
    lines: list[str] = []
    code = launcher.run(spec, on_line=lines.append, timeout_s=300)
    assert killed, "rank 1 never appeared"
    assert code == 137, "\n".join(lines[-30:])
    assert not psutil.pid_exists(killed[0]) or psutil.Process(killed[0]).status() == "zombie"
    left = [p for p in psutil.process_iter(["name", "cmdline", "status"])
            if (p.info["name"] or "").startswith("stoker-rank") and p.info["status"] != "zombie"
            and str(spec) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


LAGGING_RANKS = """
import os, sys, time
import stoker.runtime.__main__ as runtime

def fake_main(argv):  # rank 0 ends well after rank 1, as when it waits for MLflow to close
    if os.environ["RANK"] == "0":
        time.sleep(float(sys.argv[1]))
        return 0
    return int(sys.argv[2])

runtime.main = fake_main  # the forked ranks inherit it
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from stoker.runtime.launch import forked_rank

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                      rdzv_endpoint="127.0.0.1:0", run_id="lag", start_method="fork",
                      monitor_interval=0.1)
try:
    elastic_launch(config, entrypoint=forked_rank)("spec.yaml")
    print("exit 0", flush=True)
except ChildFailedError as e:
    print(f"exit {e.get_first_failure()[1].exitcode}", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(("lag_s", "rank1_code", "expected"), [(8.0, 0, "exit 0"),
                                                                  (0.5, 75, "exit 75")])
def test_forked_ranks_that_end_seconds_apart_end_the_attempt(lag_s, rank1_code, expected):
    """QA: rank 0 finishing more than 5 s after rank 1 (it waits for MLflow to close the run)
    left the launcher waiting on rank 1 forever: rank 1 had been ended while torchrun's worker
    wrapper still waited to be told every return value was read. A rank that exits non-zero
    still reports its code."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LAGGING_RANKS, str(lag_s), str(rank1_code)],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.stdout.strip().splitlines()[-1:] == [expected], proc.stdout + proc.stderr[-3000:]
    assert time.monotonic() - started < lag_s + 45


PEER_DIES_AFTER_THE_END = """
import os, signal, sys, time
import stoker.runtime.__main__ as runtime
from stoker.runtime.preemption import StopFlag

def fake_main(argv):  # rank 0 completes (its stop flag listening, as main's); rank 1 is killed
    StopFlag().install()
    if os.environ["RANK"] == "1":
        time.sleep(float(sys.argv[2]))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(sys.argv[1]))  # rank 0's end: its model logged, its MLflow run closed
    return 0

runtime.main = fake_main  # the forked ranks inherit it
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from stoker.runtime.launch import forked_rank

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                      rdzv_endpoint="127.0.0.1:0", run_id="late-death", start_method="fork",
                      monitor_interval=0.1)
started = time.monotonic()
try:
    elastic_launch(config, entrypoint=forked_rank)("spec.yaml")
    print("exit 0", flush=True)
except ChildFailedError as e:
    print(f"exit {e.get_first_failure()[1].exitcode} after {time.monotonic() - started:.1f} s",
          flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(("rank0_end_s", "rank1_killed_s"), [(0.0, 2.0), (3.0, 1.0)],
                         ids=["after-rank-0-returned", "while-rank-0-ends"])
def test_a_rank_that_completed_ends_at_once_when_a_peer_dies_before_the_launcher_is_done(
        rank0_end_s, rank1_killed_s):
    """QA: kill -9 of rank 1 at the last step (a helper's trial, and `stoker run` here: the
    attempt ended 33 s after the kill). Rank 0 completed, then waited in torchrun's worker
    wrapper with its stop handler still set; the launcher's SIGTERM, sent as soon as rank 1
    died (after rank 0 returned, or while rank 0 still logged its model), only set that flag,
    and torchrun SIGKILLed rank 0 30 s later."""
    proc = subprocess.run([sys.executable, "-c", PEER_DIES_AFTER_THE_END, str(rank0_end_s),
                           str(rank1_killed_s)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    last = proc.stdout.strip().splitlines()[-1:]
    assert last and last[0].startswith("exit -9 after "), proc.stdout + proc.stderr[-3000:]
    assert float(last[0].split()[3]) < 15, last  # seconds of training, then the close: not 30 s


@pytest.mark.integration
@pytest.mark.parametrize("start", ["fork", "exec"])
def test_the_launch_wrapper_gives_each_rank_one_thread_without_omp_num_threads(make_spec,
                                                                               start):
    """``python -m stoker.runtime.launch`` as a CPU container's entrypoint runs it: nothing sets
    OMP_NUM_THREADS, torchrun sets 1 for 2 ranks. Forked ranks kept the thread count OpenMP
    had read when the launcher imported torch (all cores): 2 ranks x 2 threads on 2 cores
    trained 3.7x slower than exec'd ranks."""
    spec = make_spec(f"threads-{start}", tracking=False, epochs=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    proc = subprocess.run([sys.executable, "-m", "stoker.runtime.launch", "--nproc-per-node=2",
                           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                           "--local-addr=127.0.0.1", "-m", "stoker.runtime", str(spec)],
                          env={**env, WORKER_START_ENV: start}, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (started,) = [e for e in events(spec.parent) if e["event"] == "start"]
    assert started["intra_op_threads"] == 1


def test_a_standby_imports_rank_0s_tracking_before_the_fork_and_opens_nothing():
    """Rank 0 imported MLflow's client and sqlite store while it trained (~1.8 CPU-s on a core
    the steps needed): the default job's steps took 4.9 s in `stoker run` against 3.1 s bare.
    A standby launcher imports them before the fork; no Python thread, store or engine is made
    there, so nothing is shared across the fork."""
    code = (
        "import sys, threading, gc\n"
        "from stoker.runtime.launch import TRACKING_IMPORTS, _warm_up, warm_up_tracking\n"
        "_warm_up()\n"
        "warm_up_tracking()\n"
        "import sqlalchemy.engine\n"
        "engines = sum(isinstance(o, sqlalchemy.engine.Engine) for o in gc.get_objects())\n"
        "print([m for m in TRACKING_IMPORTS if m not in sys.modules],\n"
        "      [t.name for t in threading.enumerate()], engines)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, check=True, env={**os.environ, "PYTHONPATH": str(
                             Path(__file__).resolve().parents[1])}).stdout.strip()
    assert out.splitlines()[-1] == "[] ['MainThread'] 0", out
