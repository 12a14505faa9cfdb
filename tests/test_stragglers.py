"""Slow ranks under real torchrun (2 gloo ranks on CPU): a rank twice as slow is named in a
warning and a progress event, and every rank's own step time and data wait reach the real MLflow
store; the scores and windows alone; the settings' validation."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from conftest import events
from mlflow.tracking import MlflowClient

from stoker.config import ConfigError, RetryConfig, TrainConfig
from stoker.launch.local import LocalLauncher
from stoker.launch.retry import Outcome, run_with_retries
from stoker.runtime.stragglers import StragglerWindows, relative_scores

WARNING = "straggler: rank"


def launch(spec: Path, env: dict[str, str]) -> tuple[list, str]:
    """Run a job to its end; returns the attempts and the ranks' output."""
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable, env=env)
    output: list[str] = []
    attempts = run_with_retries(
        lambda number: launcher.run(spec, on_line=output.append, timeout_s=600),
        RetryConfig(backoff_s=0), sleep=lambda s: None)
    return attempts, "\n".join(output)


def metric_history(tmp_path: Path, job_dir: Path, name: str) -> list[float]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (job_dir / "mlflow_run_id").read_text().strip()
    return [m.value for m in client.get_metric_history(run_id, name)]


@pytest.mark.integration
def test_a_rank_three_times_as_slow_is_named_and_its_step_times_are_in_mlflow(make_spec, tmp_path):
    """STOKER_TEST_SLOW=1:3 (rank 1's steps last three times as long: a 2x slowdown scored 1.3-2.4
    under load, its waits partly in rank 0's time): one warning naming rank 1 and
    how much slower, one straggler event, and per-rank step times read back from MLflow with
    rank 1's well above rank 0's (rank 0 waits for it, but its waits are not its own time)."""
    spec = make_spec("slow", epochs=3, straggler={"window_steps": 10, "min_window_s": 0})
    attempts, output = launch(spec, env={"STOKER_TEST_SLOW": "1:3"})
    assert [a.outcome for a in attempts] == [Outcome.COMPLETED], output
    # (once per crossing: a score that dips under the threshold and back may say it again)
    warnings = [line for line in output.splitlines() if WARNING in line]
    assert warnings and all("straggler: rank 1 is" in line for line in warnings), output
    assert "x slower than the median rank" in warnings[0]
    slow = [e for e in events(spec.parent) if e["event"] == "straggler"]
    assert {e["rank"] for e in slow} == {1} and len(slow) == len(warnings)
    assert slow[0]["relative_score"] >= 1.5 and slow[0]["step_s"] > slow[0]["median_step_s"]

    job = spec.parent
    rank_0 = metric_history(tmp_path, job, "rank_0_step_s")
    rank_1 = metric_history(tmp_path, job, "rank_1_step_s")
    assert len(rank_0) == len(rank_1) >= 3  # 44 steps in windows of at least 10
    assert statistics.median(rank_1) / statistics.median(rank_0) >= 1.5, (rank_0, rank_1)
    scores = metric_history(tmp_path, job, "rank_1_relative_score")
    assert statistics.median(scores) >= 1.5, scores
    assert set(metric_history(tmp_path, job, "rank_0_relative_score")) == {1.0}, rank_0
    assert metric_history(tmp_path, job, "straggler_score")
    assert all(v >= 0 for v in metric_history(tmp_path, job, "rank_0_data_wait_s"))
    assert metric_history(tmp_path, job, "rank_1_individual_score")


def test_the_relative_score_is_over_the_lower_median():
    """Two ranks: the faster one is the reference (2.0 and 1.0, not 1.33 and 0.67); one slow
    rank of five does not move the median."""
    assert relative_scores([0.02, 0.04]) == [1.0, 2.0]
    assert relative_scores([0.01, 0.01, 0.011, 0.01, 0.03]) == pytest.approx(
        [1.0, 1.0, 1.1, 1.0, 3.0])
    assert relative_scores([0.0, 0.0]) == [1.0, 1.0]


def test_a_window_closes_after_its_steps_and_a_rank_is_reported_when_it_becomes_slow():
    """Sums arrive per agreement (here 4 steps); a window of 8 steps closes at the second; a
    rank already slow in the last window is not reported again; one that recovered and slows
    again is."""
    windows = StragglerWindows(world_size=3, window_steps=8, threshold=1.5, windows=1)
    fast, slow = [0.08, 0.0, 0.08, 0.0, 0.08, 0.0], [0.04, 0.0, 0.12, 0.08, 0.04, 0.0]
    assert windows.add(slow, 4, 4) is None
    report = windows.add(slow, 4, 8)
    assert report is not None and report.new_stragglers == [1]
    assert (report.first_step, report.last_step) == (1, 8)
    assert report.step_s[1] == pytest.approx(0.03) and report.data_wait_s[1] == pytest.approx(0.02)
    assert report.metrics()["rank_1_relative_score"] == pytest.approx(3.0)
    assert "rank 1 is 3.0x slower" in report.line(1, 1.5) and "steps 1-8" in report.line(1, 1.5)
    windows.add(slow, 4, 12)
    assert windows.add(slow, 4, 16).new_stragglers == []
    windows.add(fast, 8, 24)
    windows.add(slow, 4, 28)
    again = windows.add(slow, 4, 32)
    assert again.new_stragglers == [1] and again.individual[1] == pytest.approx(3.0)


def test_one_noisy_window_is_not_a_straggler():
    """windows=2: a rank over the threshold in one window, then not, is never reported; in two
    windows in a row it is, at the second."""
    windows = StragglerWindows(world_size=2, window_steps=4, threshold=1.5, windows=2)
    even, spike = [0.04, 0.0, 0.04, 0.0], [0.04, 0.0, 0.1, 0.0]
    assert windows.add(spike, 4, 4).new_stragglers == []
    assert windows.add(even, 4, 8).new_stragglers == []
    assert windows.add(spike, 4, 12).new_stragglers == []
    assert windows.add(spike, 4, 16).new_stragglers == [1]


@pytest.mark.parametrize("override", ["train.straggler.threshold=1", "train.straggler.threshold=-2",
                                      "train.straggler.window_steps=0",
                                      "train.straggler.windows=0",
                                      "train.straggler.windows=two"])
def test_a_bad_straggler_setting_exits_2_in_one_line_naming_it(override):
    from typer.testing import CliRunner

    from stoker.cli import app

    field = override.split("=")[0]
    with pytest.raises((ConfigError, ValueError), match=field.split(".")[-1]):
        TrainConfig(straggler={field.split(".")[-1]: override.split("=")[1]})
    result = CliRunner().invoke(app, ["show-config", override])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert result.output.startswith(f"error: {field}: ")


def test_the_flow_forwards_new_straggler_events_once(tmp_path):
    """ProgressWatcher hands each new ``straggler`` line of a real progress.jsonl to on_event
    (not those an earlier run left, not other kinds); straggler_notice makes the flow's line
    and a ``stoker.training.straggler`` event, and skips a record missing a field."""
    from stoker.launch.supervisor import ProgressWatcher
    from stoker.runtime.progress import ProgressWriter
    from stoker.tracking.events import straggler_notice

    record = {"rank": 1, "relative_score": 2.04, "step_s": 0.031, "median_step_s": 0.0152,
              "data_wait_s": 0.001, "first_step": 11, "threshold": 1.5}
    writer = ProgressWriter(tmp_path, 2)
    writer.event("start", 0)
    writer.event("straggler", 10, **{**record, "first_step": 1})  # before the watcher
    forwarded: list[dict] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: None, on_event=forwarded.append)
    writer.event("step", 11, epoch=0, loss=1.0, lr=0.1, samples_per_s=10.0)
    writer.event("straggler", 20, **record)
    writer.close()
    watcher.poll()
    watcher.poll()
    assert [(e["step"], e["rank"]) for e in forwarded] == [(20, 1)]

    line, event = straggler_notice("job-1", "run1", forwarded[0])
    assert line == ("straggler: rank 1 is 2.0x slower than the median rank (31 ms vs 15 ms of "
                    "its own time per step) over steps 11-20")
    assert event["event"] == "stoker.training.straggler"
    assert event["resource"]["prefect.resource.id"] == "stoker.job.job-1"
    assert event["payload"]["rank"] == 1 and event["payload"]["step"] == 20
    assert straggler_notice("job-1", None, {**forwarded[0], "rank": "1; rm -rf"}) is None
    assert straggler_notice("job-1", None, {"event": "straggler", "step": 3}) is None


def test_a_window_also_lasts_its_minimum_time():
    """Fast steps (trial: 50 steps were ~1 s, and a burst of another process on the host made
    rank 0 a "straggler" in 36 of 184 windows): with min_window_s=30 a window of 4 steps that
    took 10 s stays open, and closes once 30 s have passed, over all the steps since."""
    now = [0.0]
    windows = StragglerWindows(world_size=2, window_steps=4, threshold=1.5, windows=1,
                               min_window_s=30, clock=lambda: now[0])
    burst = [0.04, 0.0, 0.01, 0.0]  # rank 0 slowed for a moment
    even = [0.01, 0.0, 0.01, 0.0]
    assert windows.add(burst, 4, 4) is None  # opened at 0 s
    now[0] = 10.0
    assert windows.add(even, 4, 8) is None  # 8 steps, but only 10 s
    reports = {}
    for step in range(12, 44, 4):
        now[0] += 3.0  # 13, 16, ..., 31 s at step 36
        reports[step] = windows.add(even, 4, step)
    report = reports[36]
    assert [s for s, r in reports.items() if r is not None] == [36]
    assert (report.first_step, report.last_step) == (1, 36)
    assert report.new_stragglers == []  # the burst is averaged over 36 steps
    assert report.relative[0] < 1.5
