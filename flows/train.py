"""Training alone: pull the dataset and train (resuming any unfinished job), no registration."""

from __future__ import annotations

from prefect import flow

from stoker.config import PipelineConfig
from tasks.data import pull
from tasks.train import train

DEFAULT_CONFIG = PipelineConfig()


@flow(name="train", log_prints=True)
def train_only(config: PipelineConfig = DEFAULT_CONFIG) -> dict:
    """Pull data at a pinned revision and train; returns the MLflow run id, metrics and cost."""
    dataset = pull(config)
    trained = train(config, dataset)
    return {"run_id": trained.run_id, "metrics": trained.metrics, "cost": trained.cost,
            "job_dir": trained.job_dir}
