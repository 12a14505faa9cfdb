"""The train task: write the run spec, launch torchrun, retry preemptions, return the result."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import RunTag
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from stoker.config import PipelineConfig
from stoker.dataset import DatasetRef
from stoker.jobs import resolve_job_dir
from stoker.launcher import Attempt, LocalLauncher, Outcome, run_with_retries
from stoker.lineage import code_version
from stoker.runtime.spec import RunSpec


class TrainingFailed(RuntimeError):
    """The job ended without completing (budget spent, or an error not worth retrying)."""


@dataclass(frozen=True)
class TrainResult:
    """What training produced: the MLflow run, metrics, final weights and the attempts made."""

    job_dir: str
    run_id: str
    metrics: dict
    result: dict
    attempts: list[dict]


def nproc(config: PipelineConfig) -> int:
    """Processes per node: the configured number, or one per GPU, or 2 on a CPU machine."""
    if config.train.nproc_per_node != "auto":
        return int(config.train.nproc_per_node)
    import torch

    return torch.cuda.device_count() or 2


def lineage_tags(config: PipelineConfig, dataset: DatasetRef, world_size: int) -> dict[str, str]:
    code = code_version()
    tags = {
        "mlflow.source.git.commit": code["git_commit"], "stoker.git_commit": code["git_commit"],
        "stoker.git_dirty": code["git_dirty"], "dvc.repo": dataset.repo_url,
        "dvc.rev": dataset.rev, "dvc.commit": dataset.commit, "dvc.path": dataset.path,
        "dvc.md5": dataset.md5, "stoker.launcher": "local", "stoker.world_size": str(world_size),
    }
    run_id = flow_run.get_id()
    if run_id:
        tags["prefect.flow_run_id"] = str(run_id)
        url = flow_run.get_flow_run_ui_url()
        if url:
            tags["prefect.flow_run_url"] = url
    return tags


def write_spec(config: PipelineConfig, dataset: DatasetRef, job_dir: Path,
               world_size: int) -> Path:
    spec = RunSpec(
        train=config.train, data_dir=dataset.local_path, job_dir=str(job_dir),
        tracking_uri=config.tracking_uri(), experiment=config.tracking.experiment,
        artifact_location=None if config.tracking.tracking_uri
        else (config.work_dir.resolve() / "mlartifacts").as_uri(),
        run_name=job_dir.name, tags=lineage_tags(config, dataset, world_size),
    )
    job_dir.mkdir(parents=True, exist_ok=True)
    spec.dump(job_dir / "spec.yaml")
    return job_dir / "spec.yaml"


@task(name="train", cache_policy=NO_CACHE)
def train(config: PipelineConfig, dataset: DatasetRef) -> TrainResult:
    """Train (or resume) the job for ``config`` on ``dataset`` with torchrun.

    Raises:
        TrainingFailed: the last attempt did not complete; the message gives each attempt.
    """
    logger = get_run_logger()
    world_size = nproc(config)
    job_dir = resolve_job_dir(config, dataset.md5)
    spec_path = write_spec(config, dataset, job_dir, world_size)
    logger.info("job %s: %d process(es) per node, spec %s", job_dir.name, world_size, spec_path)
    launcher = LocalLauncher(world_size, shutdown_grace_s=config.train.preemption_grace_s)

    def record(attempt: Attempt) -> None:
        with open(job_dir / "attempts.jsonl", "a") as f:
            f.write(json.dumps(attempt.to_dict()) + "\n")
        level = logger.info if attempt.outcome == Outcome.COMPLETED else logger.warning
        level("attempt %d ended: %s (exit %d) after %.1f s", attempt.number, attempt.outcome,
              attempt.exit_code, attempt.duration_s)

    attempts = run_with_retries(lambda n: launcher.run(spec_path, on_line=logger.info),
                                config.retry, on_attempt=record)
    if attempts[-1].outcome != Outcome.COMPLETED:
        history = ", ".join(f"#{a.number} {a.outcome} (exit {a.exit_code})" for a in attempts)
        raise TrainingFailed(f"job {job_dir.name} did not complete: {history}")
    result = json.loads((job_dir / "result.json").read_text())
    preemptions = sum(a.outcome == Outcome.PREEMPTED for a in attempts)
    MlflowClient(config.tracking_uri()).log_batch(result["run_id"], tags=[
        RunTag("stoker.attempts", str(len(attempts))),
        RunTag("stoker.preemptions", str(preemptions))])
    return TrainResult(str(job_dir), result["run_id"], result["metrics"], result,
                       [a.to_dict() for a in attempts])
