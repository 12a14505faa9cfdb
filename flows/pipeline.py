"""The main job: pull the dataset, train with torchrun, register the model, report."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from flows.train import pull_and_train
from stoker import stopping
from stoker.config import PipelineConfig
from stoker.forms import DockerPipelineForm, PipelineForm, SlurmPipelineForm
from stoker.images.spec import ImageRequest
from stoker.jobs.job import JobClaim, mark_done
from stoker.launch.supervisor import rank_0_logs_model
from stoker.runtime.tracking import quiet_run_links
from stoker.server_auth import check_mlflow_server
from stoker.stdio import guard_stdio
from stoker.tracking.registry import warm_up_registration
from tasks.registry import register
from tasks.report import report
from tasks.stopping import (
    cancel_stopped_flow_run,
    cancelled_promptly,
    stops_as_cancelled,
    untagged_task_runs,
)

DEFAULT_CONFIG = PipelineConfig()
DEFAULT_IMAGE = ImageRequest()


_HOOKS = {"on_crashed": [cancel_stopped_flow_run], "on_failure": [cancel_stopped_flow_run]}


@flow(name="pipeline", log_prints=True, **_HOOKS)
def pipeline(config: PipelineConfig = DEFAULT_CONFIG, image: ImageRequest = DEFAULT_IMAGE) -> dict:
    """Pull data at a pinned revision, build the training image when training runs in
    containers, train (resuming any unfinished job), register, report (``stoker run``)."""
    return run_pipeline(config, image)


@flow(name="pipeline", log_prints=True, **_HOOKS)
def pipeline_local(config: PipelineForm = PipelineForm()) -> dict:  # noqa: B008 - frozen
    """The ``pipeline`` deployment: train on the worker's machine (torchrun)."""
    return run_pipeline(config.to_config(), DEFAULT_IMAGE)


@flow(name="pipeline", log_prints=True, **_HOOKS)
def pipeline_docker(config: DockerPipelineForm) -> dict:
    """The ``pipeline-docker`` deployment: train in the training image's containers."""
    return run_pipeline(config.to_config(), DEFAULT_IMAGE)


@flow(name="pipeline", log_prints=True, **_HOOKS)
def pipeline_slurm(config: SlurmPipelineForm) -> dict:
    """The ``pipeline-slurm`` deployment: train as one Slurm batch job per attempt."""
    return run_pipeline(config.to_config(), DEFAULT_IMAGE)


@stops_as_cancelled  # Ctrl-C, SIGTERM or SIGHUP to `stoker run`: a stop, not a crash
def run_pipeline(config: PipelineConfig, image: ImageRequest) -> dict:
    """The pipeline's steps, inside a flow run.

    The job is owned (leased) from before anything in its folder is written until it is marked
    done: with ``job_id`` before the pull, otherwise right after it. A done ``job_id`` returns
    its summary and does nothing."""
    check_mlflow_server(config.tracking_uri())  # a refused credential: one line, nothing written
    quiet_run_links()  # on a worker as under `stoker run`: the report task logs the link once
    guard_stdio(Path(config.work_dir) / "logs" / "output.log")  # a dead worker's pipe fails nothing
    with cancelled_promptly(), untagged_task_runs(), JobClaim(config, flow_run.get_id()) as job:
        # Registration's imports load while the launcher starts (one core is idle then): the
        # plotting library's with tracking.plot_curves; those of logging the model where the
        # ranks run in an image and do not log it.
        pulled = pull_and_train(config, image, job, on_train_start=lambda: warm_up_registration(
            logs_model=not rank_0_logs_model(config), plots=config.tracking.plot_curves))
        if not isinstance(pulled, tuple):
            return pulled
        dataset, trained = pulled
        registration = register(config, dataset, trained)
        report(dataset, trained, registration, config.tracking, config.tracking_uri())
        summary = {"job_dir": str(trained.job_dir), "dataset": asdict(dataset),
                   "run_id": trained.run_id,
                   "metrics": trained.metrics, "cost": trained.cost,
                   "registration": registration.to_dict()}
        mark_done(Path(trained.job_dir), summary)
        stopping.note_done()  # a stop signal from here on has nothing to stop (stoker run)
    return summary
