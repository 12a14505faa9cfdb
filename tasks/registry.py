"""Model registry task: log the trained model, register a version, apply the promotion gate."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from stoker.config import PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.launch.supervisor import TrainResult
from stoker.tracking.events import model_event
from stoker.tracking.plots import plot_curves
from stoker.tracking.registry import (
    Registration,
    champion_outcome,
    input_example,
    log_and_register,
    logged_model,
)


@task(name="register-model", cache_policy=NO_CACHE)
def register(config: PipelineConfig, dataset: DatasetRef, trained: TrainResult) -> Registration:
    """Register the trained model; ``champion`` moves only if the promotion metric improves."""
    logger = get_run_logger()
    metric = config.tracking.promote_metric
    if metric not in trained.metrics:
        raise KeyError(f"tracking.promote_metric {metric!r}: not among the run's final metrics "
                       f"{sorted(trained.metrics)}")
    run_tags = MlflowClient(config.tracking_uri()).get_run(trained.run_id).data.tags
    tags = {k: v for k, v in run_tags.items() if k.startswith(("dvc.", "stoker.", "prefect."))}
    tags["mlflow.run_id"] = trained.run_id
    registration = log_and_register(
        config.tracking_uri(), trained.run_id, config.registered_model(),
        trained.result, lambda: input_example(dataset, trained.result), tags, metric,
        float(trained.metrics[metric]), config.tracking.promote_direction,
        logged_model_uri=logged_model(trained.job_dir, trained.run_id),
    )
    if config.tracking.plot_curves:
        with tempfile.TemporaryDirectory() as tmp:
            curves = plot_curves(config.tracking_uri(), trained.run_id, Path(tmp) / "curves.png")
            MlflowClient(config.tracking_uri()).log_artifact(trained.run_id, str(curves), "plots")
    job = Path(trained.job_dir).name
    details = {"metric": metric, "value": registration.value,
               "previous_champion": registration.previous_champion,
               "model_uri": registration.model_uri}
    emit_event(**model_event("registered", registration.name, registration.version, job,
                             trained.run_id, **details))
    if registration.promoted:
        emit_event(**model_event("promoted", registration.name, registration.version, job,
                                 trained.run_id, **details))
    logger.info("registered %s version %s (%s=%.4f); champion %s", registration.name,
                registration.version, metric, registration.value,
                champion_outcome(registration))
    return registration
