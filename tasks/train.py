"""The train task: write the run spec, launch torchrun per attempt, retry preemptions, price it."""

from __future__ import annotations

import json
import subprocess
import time

from filelock import FileLock, Timeout
from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import State
from prefect.transactions import CommitMode, transaction

from stoker.config import PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.images.build import ImageResult
from stoker.images.preflight import preflight_image
from stoker.launch.factory import make_launcher
from stoker.launch.job import resolve_job_dir
from stoker.launch.retry import Attempt, Outcome, run_with_retries
from stoker.launch.stop_request import clear_stop_request, read_stop_request
from stoker.launch.supervisor import (
    JobBusy,
    ProgressWatcher,
    TrainingFailed,
    TrainResult,
    capacity_for,
    finish_run,
    lineage_tags,
    nproc,
    write_spec,
)
from stoker.runtime.progress import read_events
from stoker.tracking.cost import cost_report
from tasks.stopping import attempt_state, stopped


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
    tags = lineage_tags(config, dataset, world_size, image, flow_run.get_id(),
                        flow_run.get_flow_run_ui_url())
    spec_path = write_spec(config, dataset, job_dir, world_size, tags)
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

    codes: dict[int, int] = {}

    @task(name="attempt", cache_policy=NO_CACHE)
    def attempt_task(number: int, capacity_type: str) -> State:
        get_run_logger().info("attempt %d on %s capacity", number, capacity_type)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            codes[number] = launcher.run(spec_path, on_line=get_run_logger().info,
                                         timeout_s=left)
        except (subprocess.TimeoutExpired, TimeoutError):
            raise TimeoutError(f"train_timeout_s={config.train_timeout_s:g} s reached: job "
                               f"{job_dir.name} stopped (process tree terminated)") from None
        return attempt_state(codes[number], read_stop_request(job_dir))

    def launch(number: int) -> int:
        if number == 1:
            clear_stop_request(job_dir)  # an earlier run's stop request is not this run's
        capacities[number] = capacity_for(config, preempted)
        # Committed at once: a finished attempt's named state stays, even if `train` fails later
        # (a lazy transaction would roll it back to "RolledBack").
        with transaction(commit_mode=CommitMode.EAGER):
            state = attempt_task.with_options(task_run_name=f"attempt-{number}")(
                number, capacities[number], return_state=True)
        if number not in codes:
            state.result()  # the attempt raised (timeout, cancel): raise it here
        return codes[number]

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
    artifact_id = create_progress_artifact(
        progress=0.0, key=None, description=f"training progress of {job_dir.name}")

    def on_progress(percent: float, message: str) -> None:
        update_progress_artifact(artifact_id, progress=percent)
        logger.info(message)

    watcher = ProgressWatcher(job_dir, on_progress)
    watcher.start()
    try:
        attempts = run_with_retries(launch, config.retry, on_attempt=record,
                                    stop_requested=lambda: read_stop_request(job_dir) is not None)
    except BaseException:  # cancelled or timed out: the tree is already gone, close the run
        if run_file.exists():
            finish_run(client, run_file.read_text().strip(), "KILLED")
        raise
    finally:
        watcher.stop()
        lock.release()
    history = [json.loads(line) for line in (job_dir / "attempts.jsonl").read_text().splitlines()]
    history = history[-len(attempts):]  # this run's attempts (earlier runs of the job precede)
    if attempts[-1].outcome == Outcome.STOPPED:
        stopped(client, run_file, read_stop_request(job_dir), job_dir.name)
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
