"""The train task: write the run spec, launch torchrun per attempt, retry preemptions, price it."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import State
from prefect.transactions import CommitMode, transaction

from stoker.config import ConfigError, PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.images.build import ImageResult
from stoker.jobs.attempts import (
    AttemptLog,
    describe_interrupted,
    lost_steps,
)
from stoker.launch.factory import make_launcher
from stoker.jobs.budget import (
    BudgetWatcher,
    check_at_start,
    run_gpu_model,
    usd_per_hour,
)
from stoker.jobs.job import JobClaim, check_resumable, completed_training, job_store
from stoker.jobs.lease import JobBusy, held_lease
from stoker.launch.local import discard_standby
from stoker.launch.retry import (
    Attempt,
    Outcome,
    budget_spent,
    describe_exit,
    outcome_of,
    run_with_retries,
    will_retry,
)
from stoker.jobs.status import JOB_LOG
from stoker.jobs.stop_request import (
    TrainingStopped,
    clear_stop_request,
    read_stop_request,
    refuse_stalled,
    stopped,
)
from stoker.jobs.store import RecordSync
from stoker.launch.supervisor import (
    LineLog,
    ProgressWatcher,
    TrainingFailed,
    TrainResult,
    at_rank_level,
    capacity_for,
    close_left_open,
    finish_run,
    lineage_tags,
    nproc,
    tag_outcome,
    write_spec,
)
from stoker.runtime import CheckpointWriteError
from stoker.runtime.preemption import SENDER_PREFIX, mark_stopped_at_once, record_stop_sender
from stoker.runtime.progress import read_events
from stoker.runtime.records import read_json, read_text
from stoker.runtime.spec import RunSpec
from stoker.runtime.tracking import ensure_store
from stoker.stopping import (
    note_outcome,
    on_interrupt,
    on_stop,
    on_stop_at_once,
    outcome_probe,
    stop_reason,
)
from stoker.tracking.cost import cost_report, steps_lost
from stoker.tracking.events import training_event
from stoker.tracking.spend import log_cost_records, log_stopped_cost
from tasks.stopping import CancelWatcher, attempt_state, crash_orphaned_flow_run


@task(name="train", cache_policy=NO_CACHE)
def train(config: PipelineConfig, dataset: DatasetRef, image: ImageResult | None = None,
          job_dir: Path | None = None) -> TrainResult:
    """Train (or resume) the job for ``config`` on ``dataset`` with torchrun.

    ``job_dir`` is the job the calling flow leased (``JobClaim``); without it the task leases
    the job itself for the time it trains. Each attempt runs as a nested task run ``attempt-N``
    (visible in the Prefect UI with its exit code and outcome); preemptions and infrastructure
    failures resume from the last committed checkpoint within their budgets.

    Raises:
        JobBusy: another live run owns the job (one line naming it; nothing written).
        TrainingFailed: the last attempt did not complete; the message lists every attempt.
    """
    with contextlib.ExitStack() as stack:
        if job_dir is None or held_lease(job_dir) is None:
            claim = stack.enter_context(JobClaim(config, flow_run.get_id()))
            job_dir = claim.bind(dataset.md5) if job_dir is None else claim.take(job_dir)
            if claim.done is not None:
                raise TrainingFailed(f"job {job_dir.name} is already done; nothing to train")
        return _train(config, dataset, image, Path(job_dir))


def _stopped_by(error: BaseException) -> str | None:
    """Who stopped the training by interrupting its flow: a signal to ``stoker run`` or a
    Prefect cancel (``a Prefect cancel of flow run 'brave-fox'``); None for anything else (a
    timeout, a bug)."""
    if stop_reason() is not None:
        return stop_reason()
    return _prefect_sender(error)


def _prefect_sender(error: BaseException) -> str | None:
    """For a SIGTERM to a worker's flow process (Prefect's ``TerminationSignal``, raised into
    the launcher's wait): who sends it, when Prefect's runner said so before it sent the signal
    (its control intent): ``a Prefect cancel of flow run 'brave-fox'``. None without an intent
    (the worker's infrastructure, a plain ``kill``: SIGTERM is all that is known)."""
    if not isinstance(error, TerminationSignal):
        return None
    from prefect._internal.control_listener import get_intent

    intent = get_intent()
    if intent is None:
        return None
    name = flow_run.get_name() or flow_run.get_id()
    return (f"a Prefect cancel of flow run {name!r}" if intent == "cancel"
            else f"Prefect's runner ({intent}) of flow run {name!r}")


def _said_of(job_dir: Path, what: str | None) -> str | None:
    """``what`` the stop left, as ``stoker run``'s last line names it: ``job NAME: what``."""
    return f"job {job_dir.name}: {what}" if what else None


def _record_prefect_sender(job_dir: Path, error: BaseException) -> None:
    """Record :func:`_prefect_sender` for the ranks' stop line (``stop requested (SIGTERM: a
    Prefect cancel of flow run 'brave-fox')``); nothing when it is None."""
    sender = _prefect_sender(error)
    if sender is not None:
        record_stop_sender(job_dir, sender)


def _lease_lost_line(job_dir: Path, why: str | None, number: int) -> str:
    """``stoker run``'s error when its attempt ``number`` ended after another run took the job
    over (this one was stopped past its lease, e.g. ``kill -STOP``): the other run closed that
    attempt and trains the job now, so this one records nothing more."""
    return (f"job {job_dir.name}: lease lost ({why}) while attempt {number} ran; that run "
            "closed the attempt and trains the job now: this run records nothing more")


def _train(config: PipelineConfig, dataset: DatasetRef, image: ImageResult | None,
           job_dir: Path) -> TrainResult:
    logger = get_run_logger()
    stall = refuse_stalled(job_dir, config.retry.resume_stalled)  # raises unless overridden
    if stall is not None:
        logger.warning("resuming job %s although it %s (retry.resume_stalled=true)",
                       job_dir.name, stall.describe())
    lease = held_lease(job_dir)
    if lease.previous:  # the owner died: its flow run would stay Running forever
        crash_orphaned_flow_run(lease.previous.get("flow_run_id"), job_dir.name,
                                str(flow_run.get_id()))
    world_size = nproc(config)
    tags = lineage_tags(config, dataset, world_size, image, flow_run.get_id(),
                        flow_run.get_flow_run_ui_url())
    check_resumable(job_dir, config, dataset.md5)  # its own data and trajectory, or refused
    spec_path = write_spec(config, dataset, job_dir, world_size, tags, lease.token)
    logger.info("job %s: %d process(es) per node, spec %s", job_dir.name, world_size, spec_path)
    # The docker launcher runs the CUDA preflight before each GPU container, whatever the image.
    launcher = make_launcher(config, world_size, image.pinned_ref if image else None)
    ensure_store(config.tracking_uri())
    client = MlflowClient(config.tracking_uri())
    run_file = job_dir / "mlflow_run_id"
    attempts_log = AttemptLog(job_dir)
    checkpoints = RunSpec.load(spec_path).checkpoint_location
    # A flow run that died mid-attempt (kill -9, a second Ctrl-C): its steps lost go on the
    # job's MLflow run now, at the step it reached, as a live run's would have.
    def log_steps_lost(reached: int) -> None:
        """The job's steps lost so far (:func:`steps_lost`) on its MLflow run, at the step the
        attempt that lost them reached."""
        try:
            if read_text(run_file):
                client.log_metric(read_text(run_file), "steps_lost",
                                  steps_lost(attempts_log.history(), read_events(job_dir)),
                                  step=reached)
        except Exception as e:  # tracking must not mask the attempt's outcome
            logger.warning("could not log steps_lost to MLflow: %s", e)

    left = close_left_open(attempts_log, checkpoints, logger.warning)
    if left and left[-1].get("steps_lost"):
        log_steps_lost(left[-1].get("reached_step", 0))
    finished = completed_training(job_dir)  # the orchestrator died after the ranks finished
    if finished is None:  # a spent budget launches nothing (one line, exit 5)
        check_at_start(job_dir, config.train.max_cost_usd, config.train.max_duration,
                       config.cost.prices)
    if finished is not None:
        logger.info("job %s: training already completed (step %d/%d); going on to registration "
                    "without launching", job_dir.name, finished["step"], finished["total_steps"])
    first_number = attempts_log.next_number()
    capacities: dict[int, str] = {}
    preempted = sum(a["outcome"] == Outcome.PREEMPTED for a in attempts_log.history())

    # Our own deadline, not Prefect's timeout_seconds: a sync task's timeout cannot interrupt a
    # blocking wait, while the launcher's wait(timeout) ends the attempt and its process tree.
    deadline = (time.monotonic() + config.train_timeout_s) if config.train_timeout_s else None

    codes: dict[int, int] = {}
    rank_errors: dict[int, str | None] = {}  # attempt -> the first ERROR line of a rank
    ended_by: dict[int, int | None] = {}  # attempt -> the rank whose own exit 137 ended it

    @task(name="attempt", cache_policy=NO_CACHE)
    def attempt_task(number: int, capacity_type: str) -> State:
        lines = LineLog(job_dir / JOB_LOG, at_rank_level(get_run_logger()))
        lines(f"attempt {number} on {capacity_type} capacity")
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            try:
                codes[number] = launcher.run(spec_path, on_line=lines, timeout_s=left)
            finally:
                lines.close()
                rank_errors[number] = lines.first_error
                ended_by[number] = lines.ended_by_rank
        except (subprocess.TimeoutExpired, TimeoutError):
            raise TimeoutError(f"train_timeout_s={config.train_timeout_s:g} s reached: job "
                               f"{job_dir.name} stopped (process tree terminated)") from None
        request = read_stop_request(job_dir)
        ended = Attempt(number, codes[number], outcome_of(codes[number], request is not None),
                        0.0, 0.0)  # for the retry decision only (record() keeps the real one)
        return attempt_state(codes[number], request, ended_by.get(number),
                             retried=will_retry(config.retry, [*this_run, ended]))

    def launch(number: int) -> int:
        if lease.lost:  # another run took the job over: never launch a second trainer
            raise JobBusy(f"job {job_dir.name}: lease lost ({lease.lost}); not launching")
        if cancels is not None and (by := cancels.cancelled_by()) is not None:
            raise TrainingStopped(f"job {job_dir.name} stopped by {by} before attempt "
                                  f"{number + first_number - 1} started; run the same command "
                                  "to resume it")
        if number == 1:
            clear_stop_request(job_dir)  # an earlier run's stop request is not this run's
        number += first_number - 1  # numbering continues over every run of the job
        capacities[number] = capacity_for(config, preempted)
        attempts_log.start(number, capacities[number], flow_run.get_id(),
                           config.launcher.kind)
        emit_event(**training_event("started" if number == 1 else "resumed", job_dir.name,
                                    read_text(run_file), attempt=number,
                                    capacity_type=capacities[number]))
        # Committed at once: a finished attempt's named state stays, even if `train` fails later
        # (a lazy transaction would roll it back to "RolledBack").
        with transaction(commit_mode=CommitMode.EAGER):
            state = attempt_task.with_options(task_run_name=f"attempt-{number}")(
                number, capacities[number], return_state=True)
        if number not in codes:
            state.result()  # the attempt raised (timeout, cancel): raise it here
        return codes[number]

    this_run: list[Attempt] = []  # this run's attempts so far, for the retry decision

    def record(attempt: Attempt) -> None:
        nonlocal preempted
        if not lease.check():  # stalled past its lease (kill -STOP): the job is another run's
            raise JobBusy(_lease_lost_line(job_dir, lease.lost, attempt.number + first_number - 1))
        preempted += attempt.outcome == Outcome.PREEMPTED
        number = attempt.number + first_number - 1
        lost, reached, committed = (0, 0, 0) if attempt.outcome == Outcome.COMPLETED \
            else lost_steps(job_dir, attempt.started, checkpoints)
        request = read_stop_request(job_dir) if attempt.outcome == Outcome.STOPPED else None
        ended = {**attempt.to_dict(), "capacity_type": capacities[number], "steps_lost": lost,
                 **({"ended_by_rank": ended_by[number]}
                    if ended_by.get(number) is not None else {}),
                 # `stoker status`: who stopped it, as for a Ctrl-C (trial)
                 **({"stopped_by": f"{request.by}: {request.reason}"}
                    if request is not None else {})}
        attempts_log.end(number, ended)
        tag_outcome(client, read_text(run_file), ended)  # as attempts.jsonl says, on MLflow
        if lost:
            logger.warning("attempt %d lost %d step(s): it reached step %d, the last committed "
                           "checkpoint is step %d", number, lost, reached, committed)
            log_steps_lost(reached)
        if attempt.outcome == Outcome.PREEMPTED:
            emit_event(**training_event("preempted", job_dir.name, read_text(run_file),
                                        attempt=number, exit_code=attempt.exit_code))
        # A stop someone asked for is no warning (a Ctrl-C's attempt line is INFO too).
        level = logger.info if attempt.outcome in (Outcome.COMPLETED, Outcome.STOPPED) \
            else logger.warning
        level("attempt %d ended: %s (exit %s) after %.1f s", number, attempt.outcome,
              describe_exit(attempt.exit_code, ended_by.get(number)), attempt.duration_s)
        # Its last progress line ("restarting ...", or "no retry left"), after the line above
        # and before the next attempt starts (the watcher alone could say it up to 5 s later,
        # after "attempt N+1 on").
        this_run.append(attempt)
        watcher.report_now(number, will_retry(config.retry, this_run))
        if attempt.outcome == Outcome.INFRASTRUCTURE and read_text(run_file):
            finish_run(client, read_text(run_file), "KILLED")

    artifact_id = create_progress_artifact(
        progress=0.0, key=None, description=f"training progress of {job_dir.name}")

    def on_progress(percent: float, message: str) -> None:
        update_progress_artifact(artifact_id, progress=percent)
        logger.info(message)

    watcher = ProgressWatcher(job_dir, on_progress)
    watcher.start()
    budget = BudgetWatcher(job_dir, config.train.max_cost_usd, config.train.max_duration,
                           config.cost.prices, world_size,
                           lambda: run_gpu_model(client, run_file), logger.info)
    if config.train.max_cost_usd or config.train.max_duration:  # spend against budget
        budget.start()
    cancels = CancelWatcher(job_dir, flow_run.get_id(), logger) if flow_run.get_id() else None
    if cancels is not None:  # a cancel that no worker carries out still stops the job
        cancels.start()
    store = job_store(config)
    sync = RecordSync(store, job_dir) if store is not None else None
    if sync is not None:  # attempts, heartbeat, MLflow run id reach the bucket while training
        sync.start()
    try:
        # Ctrl-C, SIGTERM or SIGHUP to stoker run: the ranks' stop line says so (they see a
        # SIGTERM from the launcher).
        # On a worker a Prefect cancel is a SIGTERM to this process, raised as Prefect's
        # TerminationSignal into the launcher's wait: the ranks' stop line names it too.
        with on_stop(lambda reason: record_stop_sender(job_dir, f"{SENDER_PREFIX}{reason}")), \
                on_stop_at_once(lambda: mark_stopped_at_once(job_dir)), \
                on_interrupt(lambda error: _record_prefect_sender(job_dir, error)), \
                outcome_probe(lambda: _said_of(job_dir, attempts_log.open_attempt_end(
                    checkpoints))):
            attempts = [] if finished is not None else run_with_retries(
                launch, config.retry, on_attempt=record,
                stop_requested=lambda: read_stop_request(job_dir) is not None)
    except BaseException as e:  # cancelled or timed out: the tree is already gone, close the run
        if isinstance(e, JobBusy) or not lease.check():
            raise  # the job is another run's now: its attempts, records and MLflow run are too
        # The attempt is recorded now (billed time, what the ranks did), not by the next run,
        # with who stopped it (`stoker jobs` then says stopped, not unfinished).
        with contextlib.suppress(Exception):
            closed = attempts_log.close_interrupted(stopped_by=_stopped_by(e))
            if closed and (what := describe_interrupted(closed[-1])):
                note_outcome(f"job {job_dir.name}: {what}")  # stoker run's last line says it
            if closed and closed[-1].get("steps_lost"):  # a stop whose checkpoint did not commit
                log_steps_lost(closed[-1].get("reached_step", 0))
            if closed:
                tag_outcome(client, read_text(run_file), closed[-1])
        if read_text(run_file):
            finish_run(client, read_text(run_file), "KILLED")
        raise
    finally:
        discard_standby()  # a launcher parked for a retry that did not come
        watcher.stop()
        if budget.is_alive():
            budget.stop()
        if cancels is not None:
            cancels.stop()
        if sync is not None:
            sync.stop()
    history = attempts_log.history()  # every attempt of the job, whichever flow run made it
    if attempts and attempts[-1].outcome == Outcome.STOPPED:
        model = budget.gpu_model_known() or run_gpu_model(client, run_file)
        log_stopped_cost(client, read_text(run_file), history, world_size, model,
                         config.cost.prices, usd_per_hour(config, world_size, model, capacities))
        stopped(client, run_file, read_stop_request(job_dir), job_dir.name)
    if attempts and attempts[-1].outcome != Outcome.COMPLETED:
        if read_text(run_file):
            finish_run(client, read_text(run_file), "FAILED")
        summary = ", ".join(f"#{a['number']} {a['outcome']} "
                            f"(exit {describe_exit(a['exit_code'], a.get('ended_by_rank'))})"
                            for a in history[-len(attempts):])
        emit_event(**training_event("failed", job_dir.name, read_text(run_file),
                                    attempts=len(history), outcome=str(attempts[-1].outcome),
                                    exit_code=attempts[-1].exit_code))
        error = rank_errors.get(attempts[-1].number + first_number - 1)
        if attempts[-1].exit_code == 2 and error:  # the ranks named bad input: say it
            raise ConfigError(f"{error} (job {job_dir.name}; its output: stoker logs "
                              f"{job_dir.name})")
        if attempts[-1].outcome == Outcome.STORAGE and error:  # a full disk: the ranks' line
            raise CheckpointWriteError(f"{error} (job {job_dir.name}; its output: stoker logs "
                                       f"{job_dir.name})")
        spent = budget_spent(config.retry, attempts)
        raise TrainingFailed(
            f"job {job_dir.name} did not complete: {summary}" + (
                f"; no retry left ({spent}); once its cause is fixed, the same command "
                "resumes from the last checkpoint"
                if spent else ""))

    result = read_json(job_dir / "result.json")
    if not isinstance(result, dict) or "run_id" not in result:
        raise TrainingFailed(f"job {job_dir.name}: {job_dir / 'result.json'} missing or "
                             "unreadable after a completed attempt")
    report = cost_report(history, read_events(job_dir), result["train_time_s"], world_size,
                         result["gpu_model"], config.cost.prices)
    now_ms = int(time.time() * 1000)
    client.log_batch(
        result["run_id"],
        metrics=[Metric(k, v, now_ms, result["step"]) for k, v in report.metrics().items()],
        tags=[RunTag("stoker.capacity_types", ",".join(report.capacity_types)),
              RunTag("stoker.attempts", str(report.attempts)),
              RunTag("stoker.preemptions", str(report.preemptions))])
    log_cost_records(client, result["run_id"], history, world_size, result["gpu_model"],
                     config.cost.prices, result["step"])  # for `stoker cost`
    logger.info("cost: %.4f device-hours on %s, $%.4f, goodput %.2f, %d preemption(s), "
                "%d step(s) lost", report.gpu_hours, report.gpu_model, report.cost_usd,
                report.goodput, report.preemptions, report.steps_lost)
    emit_event(**training_event("completed", job_dir.name, result["run_id"],
                                step=result.get("step"), attempts=report.attempts,
                                preemptions=report.preemptions))
    return TrainResult(str(job_dir), result["run_id"], result["metrics"], result, history,
                       report.summary())
