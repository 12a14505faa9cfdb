"""Promotion gate against a real MLflow store (sqlite) and registry."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from stoker.tracking.registry import CHALLENGER, CHAMPION, beats, log_and_register, pip_requirements

pytestmark = pytest.mark.integration


def test_beats():
    assert beats(0.9, None, "max") and beats(0.9, 0.8, "max") and not beats(0.8, 0.8, "max")
    assert beats(0.1, 0.2, "min") and not beats(0.3, 0.2, "min")


def test_requirements_have_no_local_version_suffix():
    assert all("+" not in r and "==" in r for r in pip_requirements())


MODEL = f"gate-model-{uuid.uuid4().hex[:6]}"


def register(uri: str, value: float, direction: str = "max", artifacts: str | None = None):
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("gate") or client.get_experiment(
        client.create_experiment("gate", artifact_location=artifacts))
    run = client.create_run(experiment.experiment_id)
    client.log_metric(run.info.run_id, "val_accuracy", value)
    client.set_terminated(run.info.run_id, "FINISHED")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval()
    example = np.zeros((2, 1, 2, 2), dtype=np.float32)
    return log_and_register(uri, run.info.run_id, MODEL, model, example,
                            {"dvc.rev": "v1"}, "val_accuracy", value, direction), client


@pytest.fixture(params=["sqlite", "http"])
def store(request, tmp_path):
    """(tracking URI, artifact location for new experiments)."""
    if request.param == "http":
        return request.getfixturevalue("mlflow_http").uri, None  # the server serves artifacts
    return f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri()


def test_champion_moves_only_when_better(store):
    uri, artifacts = store
    first, client = register(uri, 0.90, artifacts=artifacts)
    assert first.version == "1" and first.promoted and first.previous_champion is None
    worse, _ = register(uri, 0.85, artifacts=artifacts)
    assert not worse.promoted and worse.previous_champion == "1"
    tie, _ = register(uri, 0.90, artifacts=artifacts)
    assert not tie.promoted
    better, _ = register(uri, 0.93, artifacts=artifacts)
    assert better.promoted and better.previous_value == pytest.approx(0.90)
    assert str(client.get_model_version_by_alias(MODEL, CHAMPION).version) == "4"
    assert str(client.get_model_version_by_alias(MODEL, CHALLENGER).version) == "4"
    version = client.get_model_version(MODEL, "2")
    assert version.tags["dvc.rev"] == "v1" and version.tags["val_accuracy"] == "0.85"
    # The run that produced a version keeps its final status.
    assert client.get_run(version.run_id).info.status == "FINISHED"
