"""DataLoader workers under real torchrun (2 gloo ranks on CPU, ``num_workers: 2``): forked once
per attempt, and a worker that hangs ends the attempt as an infrastructure failure that resumes.

New-user trial: a worker forked for a new epoch hung in ``fork()`` (CPython gh-112275) after about
1,900 forks; the job froze with no message, and a Ctrl-C then lost 29 steps.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import events, last_step, rank_processes

from stoker.config import RetryConfig
from stoker.launch.local import LocalLauncher
from stoker.launch.retry import Outcome, run_with_retries

pytestmark = pytest.mark.integration
TESTS = Path(__file__).parent


def run_job(spec: Path, probe: Path, at_step: int | None = None, fault: str = "hang"):
    """Run ``spec`` to its end with retries; ``at_step``: once the job passes that step, the
    next sample a data worker reads makes it ``fault`` ("hang" for good, or "kill" itself), or
    ("freeze") a worker of rank 0 is sent SIGSTOP."""
    (probe / "pids").mkdir(parents=True, exist_ok=True)
    env = {"PROBE_DIR": str(probe),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable, env=env)
    output: list[str] = []

    def arm() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and last_step(spec.parent) < at_step:
            time.sleep(0.05)
        if fault == "kill-rank1":  # from outside, as the OOM killer would: rank 1 itself
            rank1 = rank_processes(psutil.Process(launcher.process.pid))[1]
            workers = rank1.children()
            names = [w.name() for w in workers]
            rank1.kill()
            killed = time.monotonic()
            while any(alive(w.pid) for w in workers) and time.monotonic() - killed < 10:
                time.sleep(0.01)  # dead once a zombie: who reaps an orphan is not theirs
            (probe / "rank1").write_text(json.dumps({
                "pid": rank1.pid, "names": names, "left": [w.pid for w in workers
                                                           if alive(w.pid)],
                "workers_gone_s": time.monotonic() - killed}))
            return
        if fault != "freeze":
            (probe / fault).touch()
            return
        # From outside, as SIGSTOP, a cgroup freezer or a debugger would: a worker of rank 0.
        rank0 = rank_processes(psutil.Process(launcher.process.pid))[0]
        worker = rank0.children()[0]
        worker.suspend()
        (probe / "frozen").write_text(str(worker.pid))

    if at_step is not None:
        threading.Thread(target=arm, daemon=True).start()
    attempts = run_with_retries(lambda n: launcher.run(spec, on_line=output.append),
                                RetryConfig(backoff_s=0), sleep=lambda s: None)
    return attempts, "\n".join(output)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed child whose parent is gone is a zombie until this
    machine's init reaps it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker_pids(probe: Path) -> set[int]:
    return {int(p.name) for p in (probe / "pids").iterdir()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, dataset):
    """3 epochs (with 3 evaluations) in one attempt, read by 2 workers per rank."""
    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    root = tmp_path_factory.mktemp("workers")
    job = root / "job"
    job.mkdir()
    RunSpec(train=TrainConfig(epochs=3, checkpoint_every_steps=10, num_workers=2,
                              dataset="data_worker_probe:splits"),
            data_dir=dataset.local_path, job_dir=str(job)).dump(job / "spec.yaml")
    attempts, output = run_job(job / "spec.yaml", root / "probe")
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    return job, root / "probe"


def test_an_attempts_data_workers_are_forked_once(uninterrupted):
    """Training and evaluation of every epoch share one set of workers per rank, forked at the
    attempt's start: 2 ranks x 2 workers, not 2 x 2 per epoch plus those of each evaluation."""
    job, probe = uninterrupted
    evals = [e for e in events(job) if e["event"] == "eval"]
    assert len(evals) == 3 and evals[-1]["val_accuracy"] > 0.5
    pids = worker_pids(probe)
    assert len(pids) == 4, sorted(pids)
    assert not any(alive(pid) for pid in pids), "a data worker outlived its rank"


def test_a_hung_data_worker_ends_the_attempt_as_an_infrastructure_failure(uninterrupted,
                                                                         make_spec, tmp_path):
    """A worker stops delivering (stuck for good, signals held) after the checkpoint at step 10:
    the rank gives up after ``train.data_timeout_s`` with a line naming the field, its workers
    are killed (none outlives it), the attempt exits 137 (infrastructure), and the retry resumes
    from the checkpoint to the same weights as the uninterrupted run."""
    spec = make_spec("hang", tracking=False, epochs=3, num_workers=2, data_timeout_s=5,
                     dataset="data_worker_probe:splits")
    started = time.monotonic()
    attempts, output = run_job(spec, tmp_path / "probe", at_step=12)
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    assert attempts[0].exit_code == 137
    assert "no batch from the DataLoader workers in 5 s (train.data_timeout_s)" in output
    assert "training failed" not in output  # not reported as a bug, no traceback
    # The rank chose 137: the launcher says so (the attempt line read "SIGKILL": trial).
    assert "ended the attempt itself with exit 137" in output and "not a SIGKILL" in output
    hung = int((tmp_path / "probe" / "hung").read_text())
    assert not alive(hung), "the hung worker outlived its rank"
    resumed = [e for e in events(spec.parent) if e["event"] == "start" and e.get("resumed")]
    assert len(resumed) == 1 and resumed[0]["step"] >= 10
    assert time.monotonic() - started < 120
    assert_same_weights(spec.parent, uninterrupted[0])


def test_a_frozen_data_worker_ends_the_attempt_too(uninterrupted, make_spec, tmp_path):
    """A worker frozen from outside (SIGSTOP) with batches in flight: the rank blocked in reading
    a batch's shared-memory descriptor from it, which the DataLoader's own timeout does not
    cover (new-user trial: hung with no message for 80 s, 2 of 2 tries). The watchdog ends the
    wait after ``train.data_timeout_s`` all the same, kills the frozen worker, and the retry
    resumes to the uninterrupted run's weights."""
    spec = make_spec("frozen", tracking=False, epochs=3, num_workers=2, data_timeout_s=5,
                     dataset="data_worker_probe:splits")
    started = time.monotonic()
    attempts, output = run_job(spec, tmp_path / "probe", at_step=12, fault="freeze")
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    assert attempts[0].exit_code == 137
    assert "no batch from the DataLoader workers in 5 s (train.data_timeout_s)" in output
    assert "training failed" not in output and "OOM killer" not in output
    assert not alive(int((tmp_path / "probe" / "frozen").read_text()))
    # What the ranks recorded: an infrastructure end, not a failure of the user's (trial).
    ends = [e["outcome"] for e in events(spec.parent) if e["event"] == "end"]
    assert ends == ["infrastructure", "completed"], ends
    assert time.monotonic() - started < 120
    assert_same_weights(spec.parent, uninterrupted[0])


def test_a_data_worker_killed_by_sigkill_is_an_infrastructure_failure(uninterrupted, make_spec,
                                                                      tmp_path):
    """The OOM killer's usual victim is a data worker. Its rank used to fail as a bug (exit 1,
    "training failed", not retried); it is an infrastructure failure (137) that resumes."""
    spec = make_spec("oom", tracking=False, epochs=3, num_workers=2,
                     dataset="data_worker_probe:splits")
    attempts, output = run_job(spec, tmp_path / "probe", at_step=12, fault="kill")
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    assert attempts[0].exit_code == 137
    killed = int((tmp_path / "probe" / "killed").read_text())
    assert f"DataLoader worker (pid {killed}) was killed by SIGKILL" in output, output
    # Trial: "the job resumes from the last checkpoint", also where no retry was left.
    assert "retried from the last checkpoint while retry.max_infra_failures allows" in output
    assert "training failed" not in output
    assert "ended the attempt itself with exit 137" in output, output  # the rank's own 137
    assert_same_weights(spec.parent, uninterrupted[0])


def test_a_killed_ranks_data_workers_die_with_it_and_torchrun_names_that_rank(
        uninterrupted, make_spec, tmp_path):
    """New-user trial: ``kill -9`` of rank 1 (``num_workers: 1``) was reported as rank 0's
    failure (torchrun: ``failed (exitcode: 137) local_rank: 0``), 5 s later. Rank 1's workers
    outlived it, holding its sockets and torchrun's exit pipe open until their own parent check.
    They now die with their rank, so torchrun sees rank 1's SIGKILL first; and they are named
    ``stoker-r1-data<N>``, not ``stoker-rank1`` like the rank (``pgrep stoker-rank1`` found
    them too)."""
    spec = make_spec("rank1", tracking=False, epochs=3, num_workers=2,
                     dataset="data_worker_probe:splits")
    attempts, output = run_job(spec, tmp_path / "probe", at_step=12, fault="kill-rank1")
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    rank1 = json.loads((tmp_path / "probe" / "rank1").read_text())
    assert rank1["names"] == ["stoker-r1-data0", "stoker-r1-data1"], rank1
    assert rank1["left"] == [] and rank1["workers_gone_s"] < 1.0, rank1  # not up to 5 s later
    failures = [line for line in output.splitlines() if "failed (exitcode:" in line]
    assert failures and f"failed (exitcode: -9) local_rank: 1 (pid: {rank1['pid']})" in \
        failures[0], failures
    assert "ended the attempt itself" not in output  # a real SIGKILL is one
    assert_same_weights(spec.parent, uninterrupted[0])


def assert_same_weights(job: Path, reference: Path) -> None:
    a, b = torch.load(job / "final/model.pt"), torch.load(reference / "final/model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        time.sleep(3)
        return i


def test_a_worker_killed_while_its_rank_waits_is_named_as_killed():
    """Killed while the rank waits for its batch, the DataLoader says "exited unexpectedly",
    raised from its SIGCHLD report (second trial: that rank failed as a bug, exit 1, not
    retried). The report is found in the causes."""
    from stoker.runtime.data import data_worker_killed

    before = {child.pid for child in psutil.Process().children()}  # e.g. an earlier test's
    batches = iter(torch.utils.data.DataLoader(_Slow(), batch_size=1, num_workers=2))
    workers = [c for c in psutil.Process().children() if c.pid not in before]
    assert len(workers) == 2, workers
    # Both: which one holds the first batch is the loader's business; either death must raise.
    threading.Timer(1.0, lambda: [worker.kill() for worker in workers]).start()
    with pytest.raises(RuntimeError) as raised:
        next(batches)
    del batches
    assert data_worker_killed(raised.value) in {
        f"DataLoader worker (pid {worker.pid}) was killed by SIGKILL" for worker in workers}, \
        repr(raised.value)
    assert data_worker_killed(RuntimeError("DataLoader worker (pid 5) exited unexpectedly "
                                           "with exit code 1")) is None  # not a SIGKILL


def test_a_worker_killed_while_its_batch_is_handed_over_is_named_by_its_exit_code():
    """CI: the kill broke the transfer of a batch's shared memory (ConnectionRefusedError), and
    the DataLoader raised "DataLoader worker (pid(s) N) exited unexpectedly" with no signal in
    any cause: the rank failed as a bug (exit 1, "training failed", not retried)."""
    from types import SimpleNamespace

    from stoker.runtime.data import data_worker_killed

    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as handover:
            raise RuntimeError("DataLoader worker (pid(s) 14777) exited unexpectedly") \
                from handover
    except RuntimeError as e:
        error = e
    killed = [SimpleNamespace(pid=14776, exitcode=None), SimpleNamespace(pid=14777, exitcode=-9)]
    assert data_worker_killed(error, killed) == \
        "DataLoader worker (pid 14777) was killed by SIGKILL"
    exited = [SimpleNamespace(pid=14777, exitcode=1)]  # it exited by itself: not the OOM killer
    assert data_worker_killed(error, exited) is None
    assert data_worker_killed(error) is None  # its exit code unknown
