"""The training runtime under real torchrun (2 gloo ranks on CPU): preemption, exact resume,
crash recovery, world-size changes, strict loading."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import Preemptor, events, metric_steps
from mlflow import MlflowClient

from stoker.config import RetryConfig
from stoker.launch.local import LocalLauncher
from stoker.launch.retry import Outcome, run_with_retries
from stoker.runtime.checkpoint import MARKER, Checkpointer, CheckpointError
from stoker.runtime.distributed import DistEnv
from stoker.runtime.preemption import StopFlag
from stoker.runtime.spec import RunSpec
from stoker.runtime.trainer import Trainer

pytestmark = pytest.mark.integration
NO_WAIT = RetryConfig(backoff_s=0)


def launch(spec: Path, world_size: int = 2, preempt: list[dict] | None = None,
           policy: RetryConfig = NO_WAIT):
    """Run a job to its end with retries; ``preempt[i]`` arms a Preemptor for attempt i+1."""
    job_dir = spec.parent
    launcher = LocalLauncher(world_size, shutdown_grace_s=20, python=sys.executable)
    output: list[str] = []
    fired: list[Preemptor] = []

    def attempt(number: int) -> int:
        if preempt and number <= len(preempt):
            fired.append(Preemptor(launcher, job_dir, **preempt[number - 1]))
            fired[-1].start()
        return launcher.run(spec, on_line=output.append)

    attempts = run_with_retries(attempt, policy, sleep=lambda s: None)
    return attempts, "\n".join(output), fired


def final_weights(spec: Path) -> dict[str, torch.Tensor]:
    return torch.load(spec.parent / "final" / "model.pt")


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def loss_history(spec: Path) -> list[tuple[int, float]]:
    loaded = RunSpec.load(spec)
    client = MlflowClient(loaded.tracking_uri)
    run_id = (spec.parent / "mlflow_run_id").read_text()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """An uninterrupted 2-rank run of 3 epochs (66 steps)."""
    import conftest  # noqa: F401

    root = tmp_path_factory.mktemp("reference")
    from stoker.config import TrainConfig

    job = root / "ref"
    job.mkdir()
    spec = RunSpec(train=TrainConfig(epochs=3, checkpoint_every_steps=10, keep_latest_k=2),
                   data_dir=dataset.local_path, job_dir=str(job),
                   tracking_uri=f"sqlite:///{root / 'mlflow.db'}", run_name="ref")
    spec.dump(job / "spec.yaml")
    attempts, output, _ = launch(job / "spec.yaml")
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    return job / "spec.yaml"


def test_preempted_twice_resumes_bitwise_exact(reference, make_spec):
    spec = make_spec("preempted", epochs=3)
    attempts, output, fired = launch(spec, preempt=[
        {"at_step": 12, "target": "tree"},      # spot notice to the whole process tree
        {"at_step": 40, "target": "rank:1"},    # a signal that reaches only rank 1
    ])
    assert [a.outcome for a in attempts] == [Outcome.PREEMPTED, Outcome.PREEMPTED,
                                            Outcome.COMPLETED], output
    assert [a.exit_code for a in attempts] == [75, 75, 0]
    stops = [e["step"] for e in events(spec.parent) if e["event"] == "end"]
    assert len(stops) == 3 and stops[0] < stops[1] < stops[2] == 66
    # Each preemption committed a checkpoint at the very step it stopped.
    checkpoints = {e["step"] for e in events(spec.parent) if e["event"] == "checkpoint"}
    assert {stops[0], stops[1]} <= checkpoints
    assert_bitwise_equal(final_weights(spec), final_weights(reference))
    # 8 saves, keep_latest_k=2: rank 0 overwrote purged shared.pt files, and the completed job
    # dropped the last spare (trial: every finished job kept one)
    folder = spec.parent / "checkpoints"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
    # One MLflow run, each step logged once, with the uninterrupted run's losses: the mean over
    # each 10 steps, also over the windows the stops cut (the open window is checkpointed).
    history = loss_history(spec)
    assert [s for s, _ in history] == metric_steps(66)
    assert history == loss_history(reference)
    client = MlflowClient(RunSpec.load(spec).tracking_uri)
    run = client.get_run((spec.parent / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id],
                                  f"attributes.run_name = '{spec.parent.name}'")) == 1


def test_async_checkpoints_resume_bitwise_exact(reference, make_spec):
    spec = make_spec("async", epochs=3, async_checkpoint=True)
    attempts, output, _ = launch(spec, preempt=[{"at_step": 25, "target": "tree"}])
    assert [a.outcome for a in attempts] == [Outcome.PREEMPTED, Outcome.COMPLETED], output
    blocking = [e["blocking_s"] for e in events(spec.parent) if e["event"] == "checkpoint"]
    assert blocking and all(b >= 0 for b in blocking)
    assert_bitwise_equal(final_weights(spec), final_weights(reference))


def test_kill_during_save_resumes_from_previous_checkpoint(reference, make_spec):
    spec = make_spec("killed", epochs=3)
    attempts, output, fired = launch(
        spec, preempt=[{"at_step": 35, "target": "tree", "sig": signal.SIGKILL}],
        policy=RetryConfig(backoff_s=0, max_infra_failures=0))
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE], output
    assert attempts[0].exit_code == 137  # the launcher's own death, as a shell reports it
    ckpt_dir = spec.parent / "checkpoints"
    committed = Checkpointer(str(ckpt_dir), 0, 2).committed_steps()
    assert committed, "expected committed checkpoints before the kill"
    # Make the newest checkpoint look like it was being written when the node died.
    newest = ckpt_dir / f"step-{committed[-1]:09d}"
    (newest / MARKER).unlink()
    (newest / "shared.pt").write_bytes((newest / "shared.pt").read_bytes()[:100])
    attempts, output, _ = launch(spec)
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    assert f"{newest.name}: no COMMITTED marker" in output
    previous = committed[-2] if len(committed) > 1 else None
    if previous:
        assert f"resumed from {ckpt_dir / f'step-{previous:09d}'}" in output
    assert_bitwise_equal(final_weights(spec), final_weights(reference))
    assert [s for s, _ in loss_history(spec)] == metric_steps(66)  # re-run steps not re-logged


def test_a_killed_launcher_leaves_its_ranks_the_grace_to_commit_their_stop_checkpoint(
        make_spec):
    """New-user trial: `kill -9` of torchrun alone. The ranks get SIGTERM from the kernel
    (parent-death signal) and commit a stop checkpoint; the attempt is exit 137 and the retry
    resumes from that checkpoint, losing nothing (was: the orchestrator SIGKILLed the session
    within 50 ms of the launcher's death, mid-stop, and the job went back to its last periodic
    checkpoint, here step 0)."""
    spec = make_spec("launcher-killed", epochs=2, tracking=False, checkpoint_every_steps=1000)
    attempts, output, fired = launch(
        spec, preempt=[{"at_step": 10, "target": "agent", "sig": signal.SIGKILL}],
        policy=RetryConfig(backoff_s=0, max_infra_failures=1))
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    assert attempts[0].exit_code == 137
    starts = [e for e in events(spec.parent) if e["event"] == "start"]
    reached = max(e["step"] for e in events(spec.parent)
                  if e["event"] == "step" and e["time"] < starts[1]["time"])
    assert fired[0].fired_at >= 10 and starts[1]["step"] == reached, (starts, reached)


def test_a_killed_rank_is_an_infrastructure_failure_not_a_bug_of_the_survivor(make_spec):
    spec = make_spec("rank-killed", epochs=2)
    attempts, output, _ = launch(
        spec, preempt=[{"at_step": 15, "target": "rank:1", "sig": signal.SIGKILL}],
        policy=RetryConfig(backoff_s=0, max_infra_failures=1))
    assert [a.outcome for a in attempts] == [Outcome.INFRASTRUCTURE, Outcome.COMPLETED], output
    # The surviving rank's broken collective is a warning, not "training failed" + traceback.
    assert "training failed at step" not in output, output[-3000:]
    # ... and torchrun's SIGTERM to it, after rank 1 died, is no stop anyone asked for (trial:
    # "... while this rank was stopping (SIGTERM): no stop checkpoint").
    assert "while this rank was stopping (SIGTERM)" not in output, output[-3000:]


def test_the_survivors_line_names_a_stop_only_when_someone_asked_for_one():
    from stoker.runtime.__main__ import peer_lost_while_stopping

    assert peer_lost_while_stopping(97, "Connection closed by peer", "SIGTERM") == (
        "a peer rank is gone at step 97 (Connection closed by peer), and this rank got SIGTERM "
        "(torchrun ends the other ranks once one has failed; or a stop from outside)")
    assert peer_lost_while_stopping(
        97, "Connection reset by peer", "SIGTERM: stoker run got SIGINT (Ctrl-C)") == (
        "a peer rank is gone at step 97 (Connection reset by peer) while this rank was stopping "
        "(SIGTERM: stoker run got SIGINT (Ctrl-C))")


def test_checkpoints_that_hold_the_loop_too_long_get_one_warning_naming_the_settings(
        make_spec):
    """A checkpoint every step of a 10 ms step (the cadence suits slower steps): rank 0 warns
    once, naming the settings that space saves out; the default cadence here does not."""
    spec = make_spec("ckpt-share", epochs=1, checkpoint_every_steps=1, tracking=False)
    attempts, output, _ = launch(spec)
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    warned = [line for line in output.splitlines() if "checkpoints held" in line]
    assert len(warned) == 1 and "[rank0]" in warned[0], warned
    assert re.search(r"checkpoints held the loop \d+ % of this attempt's [\d.]+ s so far \(\d+ "
                     r"saves, \d+ ms each\): space them out with "
                     r"train.checkpoint_every_steps \(now 1\) or train.checkpoint_every_s "
                     r"\(now unset\), or write them in the background with "
                     r"train.async_checkpoint=true$", warned[0]), warned[0]
    # Background writes already on (trial): not suggested again.
    background = make_spec("ckpt-bg", epochs=1, checkpoint_every_steps=1, tracking=False,
                           async_checkpoint=True)
    _, output, _ = launch(background)
    warned = [line for line in output.splitlines() if "checkpoints held" in line]
    assert len(warned) <= 1 and not any("async_checkpoint" in line for line in warned), warned
    spaced = make_spec("ckpt-spaced", epochs=1, checkpoint_every_steps=1000, tracking=False)
    _, quiet, _ = launch(spaced)
    assert "checkpoints held" not in quiet


def test_user_error_fails_once_with_traceback(make_spec):
    spec = make_spec("bug", fail_at_step=5)
    attempts, output, _ = launch(spec)
    assert [a.outcome for a in attempts] == [Outcome.USER_ERROR]
    assert attempts[0].exit_code == 1
    assert "Traceback" in output and "simulated failure at step 5" in output
    client = MlflowClient(RunSpec.load(spec).tracking_uri)
    assert client.get_run((spec.parent / "mlflow_run_id").read_text()).info.status == "FAILED"


@pytest.mark.parametrize("every", [1, 2, 1000])
def test_a_diverged_loss_fails_before_its_step_is_checkpointed(make_spec, every):
    """An inf/NaN loss fails the run with a line naming train.lr, and no committed checkpoint
    holds the diverged step (each step's loss is checked before that step is saved; between
    checkpoints the losses are read in batches, off the critical path)."""
    spec = make_spec(f"diverged-{every}", tracking=False, epochs=1, lr=1e12,
                     checkpoint_every_steps=every)
    attempts, output, _ = launch(spec)
    assert [a.outcome for a in attempts] == [Outcome.USER_ERROR], output[-3000:]
    found = re.search(r"train loss is \S+ at step (\d+): training diverged \(check "
                      r"train\.lr=1000000000000\.0", output)
    assert found, output[-3000:]
    diverged = int(found.group(1))
    committed = [int(p.name.removeprefix("step-")) for p in
                 (spec.parent / "checkpoints").glob("step-*") if (p / MARKER).is_file()]
    assert all(step < diverged and step % every == 0 for step in committed), (committed, diverged)
    if every == 1:  # every step is a checkpoint step: the one before the diverged step is last
        assert committed and max(committed) == diverged - 1, (committed, diverged)


def test_agreement_interval_is_about_a_tenth_of_a_second_of_steps():
    from stoker.runtime.trainer import MAX_AGREE_STEPS, agreement_interval

    assert agreement_interval(0.012) == 8  # the demo's CPU steps
    assert agreement_interval(0.001) == MAX_AGREE_STEPS
    assert agreement_interval(0.5) == agreement_interval(0.1) == 1  # slow steps: each agreed
    assert agreement_interval(0.0) == agreement_interval(float("nan")) == 1


def test_fast_steps_share_an_agreement_and_every_step_is_still_reported(make_spec):
    """The ranks agree on losses and stop flags once for several fast steps (a collective per
    step cost 7-10 % of the wall time on 2 cores); each step still has its own progress event
    (in order, with its own time and loss), MLflow gets the mean loss of every 10 steps, and
    the job trains the same weights as before the batching (bitwise resume covers that)."""
    spec = make_spec("batched", epochs=3, checkpoint_every_steps=1000)
    attempts, output, _ = launch(spec)
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output[-3000:]
    profile = json.loads((spec.parent / "result.json").read_text())["profile"]
    steps = profile["steps"]
    # At least the first step, each epoch's end; fewer than one per step unless every step
    # took >= 0.1 s (a loaded machine): then one per step, never more.
    assert 4 <= profile["agreements"] <= steps, profile
    reported = [e for e in events(spec.parent) if e["event"] == "step"]
    step_s = sorted(64 / e["samples_per_s"] for e in reported)  # global batch 64
    if step_s[len(step_s) // 2] < 0.04:  # most steps well under 0.1 s: shared agreements
        assert profile["agreements"] < steps * 0.75, (profile, step_s[len(step_s) // 2])
    assert [e["step"] for e in reported] == list(range(1, steps + 1))
    times = [e["time"] for e in reported]
    assert times == sorted(times)
    # MLflow: every train.metrics_every_steps (10) steps and the last, the mean of their losses
    # (each ~0.08 ms of rank-0 CPU: a value per 10 ms step took ~0.8 % of it).
    history = loss_history(spec)
    assert [s for s, _ in history] == metric_steps(steps)
    losses = {e["step"]: e["loss"] for e in reported}
    previous = 0
    for step, value in history:
        window = [losses[k] for k in range(previous + 1, step + 1)]
        assert value == pytest.approx(sum(window) / len(window), rel=1e-12), step
        previous = step


def test_resume_at_other_world_sizes(make_spec):
    # Written at 2 ranks, resumed at 3: 48 samples per step split evenly over 1, 2 and 3 ranks.
    spec = make_spec("resize", epochs=2, global_batch_size=48)
    attempts, output, _ = launch(spec, preempt=[{"at_step": 8, "target": "tree"}],
                                 policy=RetryConfig(backoff_s=0, max_preemptions=0))
    assert attempts[-1].outcome is Outcome.PREEMPTED, output
    stopped = [e["step"] for e in events(spec.parent) if e["event"] == "end"][-1]
    attempts, output, _ = launch(spec, world_size=3)
    assert attempts[-1].outcome is Outcome.COMPLETED, output
    assert "written at world size 2, now 3" in output
    steps = [e["step"] for e in events(spec.parent) if e["event"] == "step"]
    assert steps == list(range(1, 2 * 29 + 1)), f"stopped at {stopped}"
    # 64 per step cannot be split over 3 ranks: refused by name, not continued silently.
    spec = make_spec("refuse", epochs=2, global_batch_size=64)
    attempts, output, _ = launch(spec, preempt=[{"at_step": 8, "target": "tree"}],
                                 policy=RetryConfig(backoff_s=0, max_preemptions=0))
    assert attempts[-1].outcome is Outcome.PREEMPTED, output
    attempts, output, _ = launch(spec, world_size=3)
    assert [a.exit_code for a in attempts] == [2]
    assert "train.global_batch_size=64 cannot be split evenly over world size 3" in output
    attempts, output, _ = launch(spec, world_size=1)
    assert attempts[-1].outcome is Outcome.COMPLETED, output
    steps = [e["step"] for e in events(spec.parent) if e["event"] == "step"]
    assert steps == list(range(1, 2 * 22 + 1))


SINGLE = DistEnv(0, 0, 1, torch.device("cpu"), None)


def test_strict_load_names_the_keys(make_spec):
    spec = RunSpec.load(make_spec("strict", tracking=False))
    trainer = Trainer(spec, SINGLE, StopFlag())
    state = trainer.state_dict()
    state["model"]["bogus.weight"] = torch.zeros(1)
    del state["model"]["head.4.bias"]
    ckpt = Checkpointer(spec.checkpoint_location, 0, 1)
    ckpt.save(1, state, {"rng": trainer._rng_state()})
    ckpt.wait()
    with pytest.raises(CheckpointError) as info:
        Trainer(spec, SINGLE, StopFlag())
    assert "bogus.weight" in str(info.value) and "head.4.bias" in str(info.value)


def test_changed_trajectory_is_refused(make_spec, tmp_path):
    spec = RunSpec.load(make_spec("trajectory", tracking=False))
    trainer = Trainer(spec, SINGLE, StopFlag())
    trainer.save()
    trainer.ckpt.wait()  # committed (the commit runs in the background)
    changed = spec.model_copy(update={"train": spec.train.model_copy(update={"epochs": 5})})
    with pytest.raises(CheckpointError, match=r"train.epochs: 2 -> 5"):
        Trainer(changed, SINGLE, StopFlag())


def test_rank_0_logs_an_epoch_line_at_most_every_10_s_and_always_the_first_and_last(
        monkeypatch):
    """New-user trial: 300 short epochs printed 300 lines. Between the first and the last epoch
    of an attempt a line is logged only once 10 s have passed since the one before."""
    from types import SimpleNamespace

    import stoker.runtime.trainer as trainer_module

    clock = [100.0]
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: clock[0])
    fake = SimpleNamespace(cfg=SimpleNamespace(epochs=300), _epoch_line_at=None)
    logged = []
    for epoch in range(300):  # 1 s per epoch
        if Trainer._epoch_line_due(fake, epoch):
            logged.append(epoch + 1)
        clock[0] += 1.0
    assert logged == [1, *range(11, 300, 10), 300]
    slow = SimpleNamespace(cfg=SimpleNamespace(epochs=3), _epoch_line_at=None)
    for _ in range(3):  # epochs of a minute: every one
        assert Trainer._epoch_line_due(slow, 0)
        clock[0] += 60.0
