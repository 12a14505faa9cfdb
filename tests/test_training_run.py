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
