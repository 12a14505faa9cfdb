"""Training alone: pull the dataset and train (resuming any unfinished job), no registration."""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow
from prefect.runtime import flow_run

from stoker.config import PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.forms import TrainForm
from stoker.images.spec import ImageRequest
from stoker.jobs.job import JobClaim
from stoker.launch.factory import check_before_pull, needs_image
from stoker.launch.supervisor import TrainResult
from stoker.server_auth import check_mlflow_server
from tasks.data import pull
from tasks.images import build_image
from tasks.stopping import cancelled_promptly, stops_as_cancelled, untagged_task_runs
from tasks.train import train

DEFAULT_CONFIG = PipelineConfig()
DEFAULT_IMAGE = ImageRequest()


@flow(name="train", log_prints=True)
def train_only(config: PipelineConfig = DEFAULT_CONFIG, image: ImageRequest = DEFAULT_IMAGE
               ) -> dict:
    """Pull data at a pinned revision and train; returns the MLflow run id, metrics and cost."""
    return run_training(config, image)


@flow(name="train", log_prints=True)
def train_local(config: TrainForm = TrainForm()) -> dict:  # noqa: B008 - frozen
    """The ``train`` deployment: pull and train on the worker's machine, no registration."""
    return run_training(config.to_config(), DEFAULT_IMAGE)


@stops_as_cancelled  # Ctrl-C, SIGTERM or SIGHUP to the command: a stop, not a crash
def run_training(config: PipelineConfig, image: ImageRequest) -> dict:
    """Pull and train inside a flow run; the job is leased meanwhile (see ``flows.pipeline``)."""
    check_mlflow_server(config.tracking_uri())  # a refused credential: one line, nothing written
    with cancelled_promptly(), untagged_task_runs(), JobClaim(config, flow_run.get_id()) as job:
        pulled = pull_and_train(config, image, job)
        if not isinstance(pulled, tuple):
            return pulled
        _dataset, trained = pulled
    return {"run_id": trained.run_id, "metrics": trained.metrics, "cost": trained.cost,
            "job_dir": trained.job_dir}


def pull_and_train(config: PipelineConfig, image: ImageRequest, job: JobClaim,
                   on_train_start: Callable[[], object] | None = None,
                   ) -> dict | tuple[DatasetRef, TrainResult]:
    """The steps every training flow shares, inside ``job``'s claim: pull the dataset, bind the
    job to its hash, build the image when training runs in containers, train (calling
    ``on_train_start`` first). Returns the done job's summary when the job already finished,
    else ``(dataset, trained)``."""
    if job.done is not None:
        return job.done
    check_before_pull(config)
    dataset = pull(config)
    job_dir = job.bind(dataset.md5)
    if job.done is not None:
        return job.done
    training_image = build_image(image) if needs_image(config) else None
    if on_train_start is not None:
        on_train_start()
    return dataset, train(config, dataset, training_image, job_dir)
