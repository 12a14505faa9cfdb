"""The train task: write the run spec, launch torchrun per attempt, retry preemptions, price it."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout
from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from stoker.config import PipelineConfig
from stoker.cost import cost_report
from stoker.dataset import DatasetRef
from stoker.images import ImageResult
from stoker.jobs import resolve_job_dir
from stoker.launcher import Attempt, Outcome, run_with_retries
from stoker.launchers import make_launcher
from stoker.lineage import code_version
from stoker.preflight import preflight_image
from stoker.runtime.progress import read_events
from stoker.runtime.spec import RunSpec


class JobBusy(RuntimeError):
    """Another process holds the job's lock: it is training this job right now."""


class TrainingFailed(RuntimeError):
    """The job ended without completing (budget spent, or an error not worth retrying)."""


@dataclass(frozen=True)
class TrainResult:
    """What training produced: the MLflow run, metrics, final weights, attempts and cost."""

    job_dir: str
    run_id: str
    metrics: dict
    result: dict
    attempts: list[dict]
    cost: dict


def nproc(config: PipelineConfig) -> int:
    """Processes per node: the configured number, or one per GPU, or 2 on a CPU machine."""
    if config.train.nproc_per_node != "auto":
        return int(config.train.nproc_per_node)
    import torch

    return torch.cuda.device_count() or 2


def lineage_tags(config: PipelineConfig, dataset: DatasetRef, world_size: int,
                 image: ImageResult | None = None) -> dict[str, str]:
    """Tags every run carries: code version, dataset, orchestrator run, launcher, world size."""
    code = code_version()
    tags = {
        "mlflow.source.git.commit": code["git_commit"], "stoker.git_commit": code["git_commit"],
        "stoker.git_dirty": code["git_dirty"], "dvc.repo": dataset.repo_url,
        "dvc.rev": dataset.rev, "dvc.commit": dataset.commit, "dvc.path": dataset.path,
        "dvc.md5": dataset.md5, "stoker.launcher": config.launcher.kind,
        "stoker.world_size": str(world_size), "stoker.capacity_type": config.cost.capacity_type,
    }
    if image is not None:
        tags.update(image.lineage_tags())
    elif config.launcher.kind == "docker" and config.launcher.docker.image:
        tags["stoker.image"] = config.launcher.docker.image
    run_id = flow_run.get_id()
    if run_id:
        tags["prefect.flow_run_id"] = str(run_id)
        url = flow_run.get_flow_run_ui_url()
        if url:
            tags["prefect.flow_run_url"] = url
    return tags


def write_spec(config: PipelineConfig, dataset: DatasetRef, job_dir: Path,
               world_size: int, image: ImageResult | None = None) -> Path:
    """Write ``<job_dir>/spec.yaml`` for the runtime (rewritten each run with current lineage)."""
    spec = RunSpec(
        train=config.train, data_dir=dataset.local_path, job_dir=str(job_dir),
        tracking_uri=config.tracking_uri(), experiment=config.tracking.experiment,
        artifact_location=None if config.tracking.tracking_uri
        else (config.work_dir.resolve() / "mlartifacts").as_uri(),
        run_name=job_dir.name, tags=lineage_tags(config, dataset, world_size, image),
        system_metrics_interval_s=config.tracking.system_metrics_interval_s,
    )
    job_dir.mkdir(parents=True, exist_ok=True)
    spec.dump(job_dir / "spec.yaml")
    return job_dir / "spec.yaml"


def capacity_for(config: PipelineConfig, preemptions_so_far: int) -> str:
    """Capacity type of the next attempt: spot falls back to on-demand after N preemptions."""
    after = config.retry.on_demand_after_preemptions
    if config.cost.capacity_type == "spot" and after is not None and preemptions_so_far >= after:
        return "on_demand"
    return config.cost.capacity_type


class ProgressWatcher(threading.Thread):
    """Mirrors the runtime's progress events into a Prefect progress artifact and the task log
    (step, throughput, ETA) every ``every_s`` seconds."""

    def __init__(self, job_dir: Path, logger, every_s: float = 5.0):
        super().__init__(daemon=True, name="progress-watcher")
        self.job_dir, self.logger, self.every_s = job_dir, logger, every_s
        self.stopped = threading.Event()
        self.artifact_id = create_progress_artifact(
            progress=0.0, key=None, description=f"training progress of {job_dir.name}")

    def poll(self) -> None:
        events = read_events(self.job_dir)
        starts = [e for e in events if e["event"] == "start"]
        steps = [e for e in events if e["event"] == "step"]
        if not starts or not steps:
            return
        total, last = starts[-1].get("total_steps") or 1, steps[-1]
        update_progress_artifact(self.artifact_id, progress=round(100 * last["step"] / total, 1))
        rate = last.get("samples_per_s") or 0.0
        step_rate = len([e for e in steps if e["time"] >= last["time"] - 30]) / 30
        eta = (total - last["step"]) / step_rate if step_rate else float("nan")
        self.logger.info("step %d/%d, %.0f samples/s, ETA %.0f s", last["step"], total, rate, eta)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.poll()

    def stop(self) -> None:
        self.stopped.set()
        self.poll()


def finish_run(client: MlflowClient, run_id: str | None, status: str) -> None:
    """Close a run an attempt left RUNNING (a SIGKILL gives the runtime no chance to)."""
    if run_id and client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status=status)


@task(name="train", cache_policy=NO_CACHE)
def train(config: PipelineConfig, dataset: DatasetRef, image: ImageResult | None = None
          ) -> TrainResult:
    """Train (or resume) the job for ``config`` on ``dataset`` with torchrun.

    Each attempt runs as a nested task run ``attempt-N`` (visible in the Prefect UI with its exit
    code and outcome); preemptions and infrastructure failures resume from the last committed
    checkpoint within their budgets.

    Raises:
        TrainingFailed: the last attempt did not complete; the message lists every attempt.
    """
    logger = get_run_logger()
    world_size = nproc(config)
    job_dir = resolve_job_dir(config, dataset.md5)
    spec_path = write_spec(config, dataset, job_dir, world_size, image)
    logger.info("job %s: %d process(es) per node, spec %s", job_dir.name, world_size, spec_path)
    if image is not None and config.launcher.kind == "docker" \
            and config.launcher.docker.gpus not in ("0", "none"):
        # Refuse before any GPU is rented: the host driver must run the image's CUDA version.
        host = preflight_image(image.ref, docker_host=config.launcher.docker.docker_host)
        logger.info("preflight: image CUDA fits the host driver (%s)", host)
    launcher = make_launcher(config, world_size, image.pinned_ref if image else None)
    client = MlflowClient(config.tracking_uri())
    run_file = job_dir / "mlflow_run_id"
    capacities: dict[int, str] = {}
    preempted = 0

    # Our own deadline, not Prefect's timeout_seconds: a sync task's timeout cannot interrupt a
    # blocking wait, while the launcher's wait(timeout) ends the attempt and its process tree.
    deadline = (time.monotonic() + config.train_timeout_s) if config.train_timeout_s else None

    @task(name="attempt", cache_policy=NO_CACHE)
    def attempt_task(number: int, capacity_type: str) -> int:
        get_run_logger().info("attempt %d on %s capacity", number, capacity_type)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return launcher.run(spec_path, on_line=get_run_logger().info, timeout_s=left)
        except (subprocess.TimeoutExpired, TimeoutError):
            raise TimeoutError(f"train_timeout_s={config.train_timeout_s:g} s reached: job "
                               f"{job_dir.name} stopped (process tree terminated)") from None

    def launch(number: int) -> int:
        capacities[number] = capacity_for(config, preempted)
        return attempt_task.with_options(task_run_name=f"attempt-{number}")(
            number, capacities[number])

    def record(attempt: Attempt) -> None:
        nonlocal preempted
        preempted += attempt.outcome == Outcome.PREEMPTED
        entry = {**attempt.to_dict(), "capacity_type": capacities[attempt.number]}
        with open(job_dir / "attempts.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        level = logger.info if attempt.outcome == Outcome.COMPLETED else logger.warning
        level("attempt %d ended: %s (exit %d) after %.1f s", attempt.number, attempt.outcome,
              attempt.exit_code, attempt.duration_s)
        if attempt.outcome == Outcome.INFRASTRUCTURE and run_file.exists():
            finish_run(client, run_file.read_text().strip(), "KILLED")

    # One trainer per job: a second `stoker run` of the same config must not train it at once.
    lock = FileLock(job_dir / ".train.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise JobBusy(f"job {job_dir.name} is being trained by another process (lock "
                      f"{lock.lock_file}); wait for it, or set job_id to start another job") \
            from None
    watcher = ProgressWatcher(job_dir, logger)
    watcher.start()
    try:
        attempts = run_with_retries(launch, config.retry, on_attempt=record)
    except BaseException:  # cancelled or timed out: the tree is already gone, close the run
        if run_file.exists():
            finish_run(client, run_file.read_text().strip(), "KILLED")
        raise
    finally:
        watcher.stop()
        lock.release()
    history = [json.loads(line) for line in (job_dir / "attempts.jsonl").read_text().splitlines()]
    history = history[-len(attempts):]  # this run's attempts (earlier runs of the job precede)
    if attempts[-1].outcome != Outcome.COMPLETED:
        if run_file.exists():
            finish_run(client, run_file.read_text().strip(), "FAILED")
        summary = ", ".join(f"#{a.number} {a.outcome} (exit {a.exit_code})" for a in attempts)
        raise TrainingFailed(f"job {job_dir.name} did not complete: {summary}")

    result = json.loads((job_dir / "result.json").read_text())
    report = cost_report(history, read_events(job_dir), result["train_time_s"], world_size,
                         result["gpu_model"], config.cost.prices)
    now_ms = int(time.time() * 1000)
    client.log_batch(
        result["run_id"],
        metrics=[Metric(k, v, now_ms, result["step"]) for k, v in report.metrics().items()],
        tags=[RunTag("stoker.capacity_types", ",".join(report.capacity_types)),
              RunTag("stoker.attempts", str(report.attempts)),
              RunTag("stoker.preemptions", str(report.preemptions))])
    logger.info("cost: %.4f device-hours on %s, $%.4f, goodput %.2f, %d preemption(s), "
                "%d step(s) lost", report.gpu_hours, report.gpu_model, report.cost_usd,
                report.goodput, report.preemptions, report.steps_lost)
    return TrainResult(str(job_dir), result["run_id"], result["metrics"], result, history,
                       report.metrics())
