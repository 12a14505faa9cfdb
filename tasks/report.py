"""Report task: a Prefect markdown artifact summarizing the pipeline run."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from stoker.config import TrackingConfig
from stoker.data.pull import DatasetRef
from stoker.launch.supervisor import TrainResult
from stoker.tracking.registry import Registration
from stoker.tracking.report import render, run_page, ui_base


@task(name="report", cache_policy=NO_CACHE)
def report(dataset: DatasetRef, trained: TrainResult, registration: Registration,
           tracking: TrackingConfig, tracking_uri: str) -> str:
    """Publish the run summary as the ``stoker-pipeline`` markdown artifact; returns it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(trained.run_id).info.experiment_id
    losses = [m.value for m in sorted(client.get_metric_history(trained.run_id, "train_loss"),
                                      key=lambda m: m.step)]
    base = ui_base(tracking, tracking_uri)
    markdown = render(dataset, trained, registration, tracking_uri, base, experiment_id, losses,
                      curves_plot=tracking.plot_curves)
    if base:  # the run's link, once (MLflow's own links stay off stdout: quiet_run_links)
        get_run_logger().info("MLflow run: %s", run_page(base, experiment_id, trained.run_id))
    create_markdown_artifact(markdown=markdown, key="stoker-pipeline",
                             description="Dataset, metrics, MLflow run and model version")
    return markdown
