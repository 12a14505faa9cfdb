"""Event names, resources and payloads for automations (the emission itself is read back from a
real Prefect server in test_pipeline)."""

from __future__ import annotations

import pytest

from stoker.tracking.events import model_event, training_event


def test_training_event_names_the_job_and_its_run():
    event = training_event("preempted", "abc-2026", "run1", attempt=2, exit_code=75, step=None)
    assert event["event"] == "stoker.training.preempted"
    assert event["resource"]["prefect.resource.id"] == "stoker.job.abc-2026"
    assert event["related"] == [{"prefect.resource.id": "mlflow.run.run1",
                                 "prefect.resource.role": "mlflow-run",
                                 "prefect.resource.name": "run1"}]
    assert event["payload"] == {"attempt": 2, "exit_code": 75}  # no None values
    assert training_event("started", "abc-2026")["related"] == []  # run not known yet


def test_model_event_and_unknown_kinds():
    event = model_event("promoted", "my-model", "3", "abc-2026", "run1", value=0.9)
    assert event["resource"]["prefect.resource.id"] == "stoker.model.my-model.3"
    assert {r["prefect.resource.id"] for r in event["related"]} == {
        "stoker.job.abc-2026", "mlflow.run.run1"}
    with pytest.raises(ValueError, match="training event kind 'paused'"):
        training_event("paused", "j")
    with pytest.raises(ValueError, match="model event kind 'deleted'"):
        model_event("deleted", "m", "1", "j", "r")
