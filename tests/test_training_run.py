"""The train task's logic without Prefect (issue 42: tasks are thin glue over plain functions):
``TrainingRun`` trains a real job with torchrun under a lease, with the orchestrator's side
given as plain callables, and logs its cost to a real MLflow store."""

from __future__ import annotations

import logging

import pytest
from mlflow import MlflowClient

from stoker.config import PipelineConfig
from stoker.jobs import Job
from stoker.orchestration.training import AttemptEnd, FlowRunHooks, TrainingRun


@pytest.mark.integration
def test_a_training_run_needs_no_prefect(dataset, tmp_path):
    config = PipelineConfig.model_validate({
        "work_dir": str(tmp_path), "job_id": "plain",
        "train": {"epochs": 1, "checkpoint_every_steps": 10}})
    events: list[dict] = []
    attempts: list[tuple[int, str]] = []
    progress: list[float] = []

    def run_attempt(number: int, capacity: str, body) -> int:
        attempts.append((number, capacity))
        end = body(logging.getLogger("attempt"))
        assert isinstance(end, AttemptEnd) and end.request is None
        return end.code

    hooks = FlowRunHooks(logger=logging.getLogger("train"), flow_run_id=None, flow_run_url=None,
                         emit=lambda **event: events.append(event), run_attempt=run_attempt,
                         stopped_by=lambda error: None, crash_orphan=lambda run: None)
    with Job.claim(config) as claim:
        job_dir = claim.bind(dataset.md5)
        result = TrainingRun(config, dataset, None, job_dir, hooks).run(
            lambda: lambda percent, message: progress.append(percent))
    assert attempts == [(1, "on_demand")]
    assert [e["event"] for e in events] == ["stoker.training.started", "stoker.training.completed"]
    assert [a["outcome"] for a in Job(job_dir).attempts()] == ["completed"]
    run = MlflowClient(config.tracking_uri()).get_run(result.run_id)  # read back from the store
    assert run.info.status == "FINISHED" and run.data.tags["stoker.attempts"] == "1"
    assert "cost_usd" in run.data.metrics


@pytest.mark.integration
def test_a_rank_killed_by_a_signal_is_named_on_the_attempts_end_line(dataset, tmp_path,
                                                                     caplog):
    """Trial: `kill -9` of a rank showed torchrun's raw `E1207 … failed (exitcode: -9)
    local_rank: 1 (pid: N) …` line. The attempt's end line now says it in Stoker's words, the
    record keeps it (`stoker status`), and the raw line stays in train.log only."""
    import threading
    import time

    import psutil
    from conftest import last_step, rank_processes

    config = PipelineConfig.model_validate({
        "work_dir": str(tmp_path), "job_id": "killed",
        "train": {"epochs": 2, "checkpoint_every_steps": 5}})
    killed: list[int] = []

    def kill_rank_1(job_dir) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if last_step(job_dir) >= 8 and (
                    rank := rank_processes(psutil.Process()).get(1)) is not None:
                killed.append(rank.pid)
                rank.kill()
                return
            time.sleep(0.05)

    def run_attempt(number: int, capacity: str, body) -> int:
        return body(logging.getLogger("attempt")).code

    hooks = FlowRunHooks(logger=logging.getLogger("train"), flow_run_id=None, flow_run_url=None,
                         emit=lambda **event: None, run_attempt=run_attempt,
                         stopped_by=lambda error: None, crash_orphan=lambda run: None)
    caplog.set_level(logging.INFO)
    with Job.claim(config) as claim:
        job_dir = claim.bind(dataset.md5)
        killer = threading.Thread(target=kill_rank_1, args=(job_dir,), daemon=True)
        killer.start()
        TrainingRun(config, dataset, None, job_dir, hooks).run(
            lambda: lambda percent, message: None)
    assert killed, "rank 1 was never seen training"
    said = f"local rank 1 (pid {killed[0]}) was killed by SIGKILL"
    records = Job(job_dir).attempts()
    assert [a["outcome"] for a in records] == ["infrastructure_failure", "completed"], records
    assert records[0]["killed"] == said
    ends = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attempt 1 ended")]
    assert ends == [f"attempt 1 ended: infrastructure_failure (exit 137 (SIGKILL): {said}) "
                    f"after {records[0]['duration_s']:.1f} s"], ends
    assert not any("failed (exitcode: -9)" in r.getMessage() for r in caplog.records)
    assert "failed (exitcode: -9) local_rank: 1" in (job_dir / "train.log").read_text()
