"""A rank killed while rank 0 waits for its checkpoint digest (issue 45's re-trial): the
survivor notices within seconds, the attempt is retried from the last committed checkpoint
(real torchrun ranks; the kill placed by freezing the rank with SIGSTOP inside its save)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
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
from stoker.runtime.checkpoint import DIGEST_SUFFIX, MARKER, Checkpointer
from stoker.runtime.peers import PeerGone


class KillInCommitWait(threading.Thread):
    """Freezes rank 1 (SIGSTOP) at random moments until it is frozen inside a save whose
    digest rank 0 waits for (a step folder without ``COMMITTED`` and without rank 1's digest),
    then SIGKILLs it there; else continues it (SIGCONT) and tries again."""

    def __init__(self, launcher: LocalLauncher, job_dir: Path, after_step: int):
        super().__init__(daemon=True)
        self.launcher, self.job_dir, self.after_step = launcher, job_dir, after_step
        self.checkpoints = job_dir / "checkpoints"
        self.killed_at: float | None = None  # monotonic s
        self.step: int | None = None

    def _waited_on(self) -> int | None:
        """The step rank 0 cannot commit without rank 1's digest, None if there is none."""
        for folder in sorted(self.checkpoints.glob("step-*"), reverse=True):
            if (folder / "shared.pt").exists() and not (folder / MARKER).exists() \
                    and not (folder / f"rank-00001.pt{DIGEST_SUFFIX}").exists():
                return int(folder.name[5:])
        return None

    def run(self) -> None:
        rng, deadline = random.Random(45), time.monotonic() + 240
        while time.monotonic() < deadline and self.killed_at is None:
            time.sleep(rng.uniform(0.0, 0.02))
            proc = self.launcher.process
            if proc is None or proc.poll() is not None or last_step(self.job_dir) < self.after_step:
                continue
            rank1 = rank_processes(psutil.Process(proc.pid)).get(1)
            if rank1 is None:
                continue
            try:
                rank1.send_signal(signal.SIGSTOP)
                time.sleep(0.3)  # rank 0 seals its files and starts waiting meanwhile
                if (step := self._waited_on()) is not None:
                    self.step, self.killed_at = step, time.monotonic()
                    rank1.send_signal(signal.SIGKILL)
                    return
                rank1.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                continue


@pytest.mark.integration
def test_a_rank_killed_while_rank_0_waits_for_its_digest_ends_the_attempt_within_seconds(
        make_spec):
    spec = make_spec("killed-in-commit", epochs=3, checkpoint_every_steps=1, keep_latest_k=2)
    job_dir = spec.parent
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable)
    output: list[str] = []
    killer = KillInCommitWait(launcher, job_dir, after_step=15)
    ended: list[float] = []

    def attempt(number: int) -> int:
        if number == 1:
            killer.start()
        try:
            return launcher.run(spec, on_line=output.append)
        finally:
            ended.append(time.monotonic())

    attempts = run_with_retries(attempt, RetryConfig(backoff_s=0, max_infra_failures=1),
                                sleep=lambda s: None)
    text = "\n".join(output)
    assert killer.killed_at is not None, "rank 1 was never frozen inside a save: " + text[-2000:]
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], text
    # Was: rank 0 waited for the dead rank's digest until torchrun's SIGKILL, 30 s later,
    # and said nothing meanwhile.
    assert ended[0] - killer.killed_at < 12, text[-3000:]
    # The survivor says why it ends: the peer it waited for, in the digest wait or in the
    # next step's collective.
    assert re.search(r"rank 1 \(pid \d+\) has exited|a peer rank is gone", text), text[-3000:]
    # Retried from the last committed checkpoint: the step rank 1 died in was never committed.
    starts = [e for e in events(job_dir) if e["event"] == "start"]
    assert starts[1]["step"] == killer.step - 1, (starts, killer.step)


def test_rank_0_stops_waiting_for_a_digest_once_the_rank_is_gone_and_says_a_long_wait(
        tmp_path, monkeypatch, caplog):
    """The digest wait asks ``peer_gone`` every half second: a dead rank ends it at once (was:
    ``commit_timeout_s``, 60 s by default, silent), and a wait past a few seconds is said."""
    import stoker.runtime.checkpoint as checkpoint
    import stoker.runtime.peers as peers

    monkeypatch.setattr(peers, "PEER_WAIT_SAY_S", 0.3)
    ckpt = checkpoint.Checkpointer(str(tmp_path), 0, 2, commit_timeout_s=60)
    asked: list[int] = []
    gone_after = time.monotonic() + 1.0

    def peer_gone(rank: int) -> str | None:
        asked.append(rank)
        return f"rank {rank} (pid 4242) has exited" if time.monotonic() > gone_after else None

    ckpt.peer_gone = peer_gone
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="stoker.runtime.peers"):
        ckpt.save(10, {"w": torch.zeros(4)}, {"rng": 0})
        with pytest.raises(PeerGone, match=r"rank 1 \(pid 4242\) has exited before it wrote "
                           r"its digest rank-00001.pt.digest; left uncommitted"):
            ckpt.wait()
    assert time.monotonic() - started < 5 and set(asked) == {1}
    assert "waiting 0 s so far for rank 1 to write its digest rank-00001.pt.digest (given " \
           "up after 60 s, or as soon as the rank is gone)" in caplog.text
    assert ckpt.committed_steps() == []


def test_a_digest_never_written_is_an_infrastructure_failure_not_a_user_error(tmp_path):
    """A rank alive but silent past ``commit_timeout_s`` (frozen) ends the attempt as a lost
    peer (exit 137, retried), not as a bad checkpoint (exit 2)."""
    ckpt = Checkpointer(str(tmp_path), 0, 2, commit_timeout_s=0.2)
    ckpt.save(10, {"w": torch.zeros(4)}, {"rng": 0})
    with pytest.raises(PeerGone, match="rank 1 did not write"):
        ckpt.wait()


def test_a_peer_is_gone_once_its_process_has_exited_or_is_a_zombie(tmp_path):
    """``local_peer_gone`` looks at the pid in the rank's heartbeat, among this rank's
    siblings only; a rank without a heartbeat here (another node) is never called gone."""
    folder = tmp_path / "beats"
    folder.mkdir()
    peer = subprocess.Popen(["sleep", "60"])
    checker = [sys.executable, "-c", "import sys; from stoker.runtime.peers import "
               "local_peer_gone; print(local_peer_gone(int(sys.argv[1]), sys.argv[2]))"]

    def ask(rank: int) -> str:  # from a sibling of the peer, as rank 0 is of rank 1
        return subprocess.run([*checker, str(rank), str(folder)], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        (folder / "rank-1.beat").write_text(f"3 10 checkpoint {peer.pid} 0".ljust(64))
        assert ask(1) == "None"
        assert ask(2) == "None"  # no heartbeat of rank 2 here
        peer.kill()  # not reaped yet: a zombie
        time.sleep(0.2)
        assert ask(1) == f"rank 1 (pid {peer.pid}) has exited"
        peer.wait()
        assert ask(1) == f"rank 1 (pid {peer.pid}) has exited"
        (folder / "rank-1.beat").write_text(f"3 10 checkpoint {os.getpid()} 0".ljust(64))
        assert ask(1) == f"rank 1 (pid {os.getpid()}) has exited"  # alive, but not a sibling
    finally:
        peer.kill()
        peer.wait()


def test_a_peer_gone_in_the_digest_wait_ends_the_rank_with_137_and_its_line(
        tmp_path, monkeypatch, caplog):
    """A rank whose training thread waited for that commit (the next save, the attempt's end)
    exits 137 (retried), naming the rank and the step, not 2 (a user error) or after 30 s."""
    import stoker.runtime.trainer as trainer_module
    from stoker.runtime.__main__ import EXIT_STOP_LOST, run
    from stoker.runtime.preemption import StopFlag

    closed: list[str] = []

    class WaitedForADeadRank:  # the Trainer's interface, as far as run() uses it
        def __init__(self, spec, env, stop):
            self.env, self.step, self.created = env, 42, time.time()
            self.ckpt = Checkpointer(str(tmp_path / "checkpoints"), 0, 1)

        def train(self) -> str:
            raise PeerGone("checkpoint .../step-000000042: rank 1 (pid 4242) has exited before "
                           "it wrote its digest rank-00001.pt.digest; left uncommitted")

        def close(self, outcome: str) -> None:
            closed.append(outcome)

    monkeypatch.setattr(trainer_module, "Trainer", WaitedForADeadRank)
    with caplog.at_level("WARNING", logger="stoker.runtime"):
        assert run(one_process_spec(tmp_path, monkeypatch), StopFlag()) == EXIT_STOP_LOST == 137
    assert closed == ["infrastructure"]
    assert "rank 1 (pid 4242) has exited before it wrote its digest rank-00001.pt.digest; left " \
           "uncommitted at step 42: stopping this rank" in caplog.text


def test_a_peer_gone_while_the_process_group_connects_is_a_lost_peer_not_a_traceback(
        tmp_path, monkeypatch, caplog):
    """CI: rank 1 joined, found a bad train.image_mean at once (exit 2) and left while rank 0
    still connected its gloo mesh; rank 0's RuntimeError escaped and torchrun named its exit 1
    (`user_error`) instead of rank 1's 2. Now rank 0 waits as for any lost peer, then 137."""
    import stoker.runtime.distributed as distributed
    from stoker.runtime.__main__ import EXIT_STOP_LOST, run
    from stoker.runtime.preemption import StopFlag

    def peer_left(timeout_s=None):
        raise RuntimeError("Gloo connectFullMesh failed with [.../gloo/transport/tcp/pair.cc:553] "
                           "Connection closed by peer [127.0.0.1]:19093")

    monkeypatch.setattr(distributed, "init_distributed", peer_left)
    with caplog.at_level("WARNING", logger="stoker.runtime"):
        assert run(one_process_spec(tmp_path, monkeypatch), StopFlag()) == EXIT_STOP_LOST == 137
    assert "a peer rank is gone at step 0" in caplog.text


def one_process_spec(tmp_path: Path, monkeypatch) -> Path:
    """A default spec for ``run()`` as one process (no torchrun variables, no heartbeat)."""
    from stoker.config_train import TrainConfig
    from stoker.runtime.spec import RunSpec

    for name in ("RANK", "WORLD_SIZE", "STOKER_HEARTBEAT_DIR"):
        monkeypatch.delenv(name, raising=False)
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(tmp_path)).dump(
        tmp_path / "spec.yaml")
    return tmp_path / "spec.yaml"
