"""Hang detection under real torchrun (2 gloo ranks on CPU): a frozen rank (kill -STOP), a short
pause that is not a hang, a hang while a checkpoint is written; and the watchdog's rule alone."""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import events, rank_processes

from stoker.config import ConfigError, RetryConfig, TrainConfig
from stoker.launch.local import LocalLauncher
from stoker.launch.rank_lines import LineLog
from stoker.launch.retry import Outcome, describe_exit, run_with_retries
from stoker.runtime.__main__ import collective_timeout_reason
from stoker.runtime.hang import Beat, Hang, HangPolicy, HangWatch, suspects
from stoker.runtime.spec import RunSpec

# Short figures so that a test finds a hang in seconds; a 3 s pause stays under step_floor_s.
FAST = {"step_floor_s": 6.0, "step_factor": 5.0, "eval_s": 30.0, "checkpoint_s": 10.0,
        "startup_s": 300.0}
HANG_LINE = "stoker.runtime.launch: hang: no rank progressed"


def launch(spec: Path, env: dict[str, str] | None = None, on_attempt=None):
    """Run a job to its end with retries; returns the attempts, the output and each attempt's
    end (time.time())."""
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable, env=env or {})
    output: list[str] = []
    ended: list[float] = []

    def attempt(number: int) -> int:
        if on_attempt is not None:
            on_attempt(number, launcher)
        code = launcher.run(spec, on_line=output.append, timeout_s=600)
        ended.append(time.time())
        return code

    attempts = run_with_retries(attempt, RetryConfig(backoff_s=0), sleep=lambda s: None)
    return attempts, "\n".join(output), ended


def final_weights(spec: Path) -> dict[str, torch.Tensor]:
    return torch.load(spec.parent / "final" / "model.pt")


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """An uninterrupted 2-rank run of 2 epochs (44 steps)."""
    job = tmp_path_factory.mktemp("hang-reference") / "ref"
    job.mkdir()
    spec = RunSpec(train=TrainConfig(epochs=2, checkpoint_every_steps=10, keep_latest_k=2),
                   data_dir=dataset.local_path, job_dir=str(job), run_name="ref")
    spec.dump(job / "spec.yaml")
    attempts, output, _ = launch(job / "spec.yaml")
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    return job / "spec.yaml"


@pytest.mark.integration
def test_a_stopped_rank_is_found_and_the_attempt_resumed(reference, make_spec):
    """kill -STOP of rank 1 mid-epoch -> the attempt ends (137) within 60 s, every rank's stack
    in the output, the retry resumes and trains the uninterrupted run's weights."""
    spec = make_spec("stopped", epochs=2, tracking=False, hang=FAST)
    stopped: list[float] = []

    def stop_rank_1(launcher: LocalLauncher) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            # Mid-way between the checkpoints of steps 10 and 20: a stop that lands late (CI
            # under load: step 10's checkpoint) finds rank 0 waiting in a checkpoint instead.
            if any(e["event"] == "step" and e["step"] >= 12 for e in events(spec.parent)):
                proc = launcher.process
                victims = rank_processes(psutil.Process(proc.pid)) if proc else {}
                if 1 in victims:
                    victims[1].send_signal(signal.SIGSTOP)
                    stopped.append(time.time())
                    return
            time.sleep(0.05)

    def on_attempt(number: int, launcher: LocalLauncher) -> None:
        if number == 1:
            threading.Thread(target=stop_rank_1, args=(launcher,), daemon=True).start()

    attempts, output, ended = launch(spec, on_attempt=on_attempt)
    assert stopped, output
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    assert ended[0] - stopped[0] < 60, output
    assert HANG_LINE in output, output
    found_in = r"hang: no rank progressed for \d+ s in section (step|checkpoint)\b"
    assert re.search(found_in, output), output
    # The line names the frozen rank (trial: "rank 0 at step 549, rank 1 at step 549" only),
    # and each stack comes under its rank's name (forked ranks share thread ids).
    assert "; rank 1 is stopped (SIGSTOP: state T)); every rank's stack is above" in output
    assert output.count("most recent call first") >= 2, output  # both ranks' stacks
    for rank in (0, 1):
        assert f"stoker.runtime.launch: hang: rank {rank}'s stack (pid " in output, output
    # The continued rank does not blame "a peer rank" for the peers the watchdog ended.
    assert "a peer rank is gone" not in output, output
    assert_bitwise_equal(final_weights(spec), final_weights(reference))


@pytest.mark.integration
def test_a_3_s_pause_is_not_a_hang(make_spec):
    """Rank 1 sleeps 3 s once (test hook) under a 6 s floor: one attempt, no hang line."""
    spec = make_spec("paused", epochs=1, tracking=False, hang=FAST)
    attempts, output, _ = launch(spec, env={"STOKER_TEST_PAUSE": "1:step:8:3"})
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    assert HANG_LINE not in output


@pytest.mark.integration
def test_a_hang_while_a_checkpoint_is_written_resumes_from_the_previous_one(
        reference, make_spec, tmp_path):
    """Rank 1 hangs entering the checkpoint of step 20 (test hook, first attempt only): found
    under checkpoint_s, the retry resumes from step 10 and trains the reference's weights."""
    spec = make_spec("ckpt-hang", epochs=2, tracking=False, hang=FAST)
    once = tmp_path / "paused-once"
    attempts, output, ended = launch(
        spec, env={"STOKER_TEST_PAUSE": f"1:checkpoint:20:1000:{once}"})
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    assert HANG_LINE in output and "section checkpoint" in output
    assert f"resumed from {spec.parent / 'checkpoints' / 'step-000000010'}" in output, output
    starts = [e for e in events(spec.parent) if e["event"] == "start"]
    assert len(starts) == 2
    assert_bitwise_equal(final_weights(spec), final_weights(reference))


def test_the_watchdog_waits_k_step_times_then_the_floor():
    """Steps of 1 s with k=5, floor 2 s: idle 4 s is fine, 5 s is a hang, named by section."""
    watch = HangWatch(HangPolicy(step_factor=5, step_floor_s=2, warmup_steps=2))
    for t in range(6):
        beats = {0: Beat(t, t, "step", 1, 1000), 1: Beat(t, t, "step", 2, 900)}
        assert watch.observe(beats, t) is None
    same = {0: Beat(5, 5, "step", 1, 1000), 1: Beat(5, 5, "step", 2, 900)}
    assert watch.observe(same, 9.0) is None
    hang = watch.observe(same, 10.5)
    assert hang is not None and hang.section == "step" and hang.timeout_s == 5


def test_hang_settings_are_validated():
    with pytest.raises((ConfigError, ValueError), match="step_factor"):
        TrainConfig(hang={"step_factor": 0.5})


def test_a_rank_in_a_checkpoint_gets_the_checkpoint_timeout_not_its_waiting_peers():
    """Both ranks at step 7, rank 1 saving (checkpoint_s=8) and rank 0 waiting for it in a
    step's collective (floor 120 s): hung after 8 s (trial: the longest of the two applied,
    so a 60 s save under checkpoint_s=8 was never found)."""
    watch = HangWatch(HangPolicy(checkpoint_s=8, step_floor_s=120, warmup_steps=1))
    beats = {0: Beat(7, 7, "step", 1, 100), 1: Beat(8, 7, "checkpoint", 2, 100)}
    assert watch.observe(beats, 0.0) is None
    assert watch.observe(beats, 7.5) is None
    hang = watch.observe(beats, 8.5)
    assert hang is not None and (hang.section, hang.timeout_s) == ("checkpoint", 8)


def test_the_rank_that_stands_out_is_named():
    """A stopped process first; else the ranks behind; else one in another section; else
    none, and the line says so."""
    same = {0: Beat(5, 9, "step", 1), 1: Beat(5, 9, "step", 2)}
    assert suspects(same, {0: "running", 1: "stopped"}) == ("rank 1 is stopped (SIGSTOP: "
                                                             "state T)",)
    assert suspects(same, {0: "gone", 1: "running"}) == ("rank 0 has no process any more",)
    behind = {0: Beat(5, 10, "step", 1), 1: Beat(5, 9, "step", 2), 2: Beat(5, 10, "step", 3)}
    assert suspects(behind, {}) == ("rank 1 is behind (step 9; the others reached 10)",)
    saving = {0: Beat(5, 9, "step", 1), 1: Beat(6, 9, "eval", 2)}
    assert suspects(saving, {}) == ("rank 1 is in section eval (the others wait for it)",)
    assert suspects(same, {0: "running", 1: "running"}) == ()
    hang = Hang("step", 6.2, 6.0, {0: 9, 1: 9})
    assert hang.summary().endswith("rank 1 at step 9; no rank stands out: compare their stacks)")


def test_the_hang_is_kept_with_the_attempt_and_said_in_its_exit(tmp_path):
    """The launcher's hang line is noted (the attempt's record keeps it: ``stoker status``)
    and logged at WARNING; the exit reads as a hang, not a bare SIGKILL."""
    forwarded: list[tuple[int, str]] = []

    class Logger:
        def log(self, level, line):
            forwarded.append((level, line))

    from stoker.launch.rank_lines import at_rank_level

    lines = LineLog(tmp_path / "train.log", at_rank_level(Logger()))
    hang = Hang("step", 6.2, 6.0, {0: 9, 1: 9}, ("rank 1 is stopped (SIGSTOP: state T)",))
    lines(hang.line())
    lines.close()
    assert lines.hang == hang.summary()
    assert forwarded == [(30, hang.line())]  # logging.WARNING
    assert describe_exit(137, None, lines.hang) == f"137: hang: {hang.summary()}"
    assert describe_exit(137, None, {"not": "a string"}) == "137 (SIGKILL)"
    assert "\x1b" not in describe_exit(137, None, "no rank\x1b[2J progressed")


def test_a_collective_timeout_is_an_infrastructure_failure_not_a_bug():
    """gloo's and NCCL's words for a collective that waited out the process group's timeout
    (train.hang.enabled=false: trial, classed user_error and not retried)."""
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed "
                        "out waiting 35000ms for recv operation to complete")
    pair = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                        "[127.0.0.1]:40321: Application timeout caused pair closure")
    assert collective_timeout_reason(gloo) == "Timed out waiting"
    assert collective_timeout_reason(pair) == "Application timeout caused pair closure"
    assert collective_timeout_reason(ValueError("bad value")) is None
