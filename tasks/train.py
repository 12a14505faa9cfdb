"""The train task: Prefect's side of training a job (its logger, events, progress artifact and
one task run per attempt) around the plain :class:`stoker.orchestration.training.TrainingRun`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run
from prefect.states import State
from prefect.transactions import CommitMode, transaction
from prefect.utilities.urls import url_for

from stoker.config import PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.images.build import ImageResult
from stoker.jobs.job import JobClaim
from stoker.jobs.lease import held_lease
from stoker.launch.supervisor import TrainingFailed, TrainResult
from stoker.orchestration.flow_runs import CancelWatcher, crash_orphaned_flow_run
from stoker.orchestration.training import AttemptEnd, FlowRunHooks, TrainingRun
from tasks.stopping import attempt_state


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
        job_dir = Path(job_dir)
        logger = get_run_logger()
        hooks = FlowRunHooks(
            logger=logger, flow_run_id=flow_run.get_id(),
            flow_run_url=flow_run_page(),
            emit=emit_event,
            run_attempt=run_attempt, stopped_by=prefect_sender,
            crash_orphan=lambda previous: crash_orphaned_flow_run(
                previous, job_dir.name, str(flow_run.get_id())),
            cancels=CancelWatcher(job_dir, flow_run.get_id(), logger)
            if flow_run.get_id() else None)
        return TrainingRun(config, dataset, image, job_dir, hooks).run(
            lambda: progress_artifact(job_dir, logger))


def flow_run_page() -> str | None:
    """The UI page of this flow run as Prefect's own ``View at`` line links it
    (``<ui>/runs/flow-run/<id>``; ``prefect.runtime.flow_run.get_flow_run_ui_url`` builds the
    older ``/flow-runs/flow-run/<id>``, which only the new UI redirects); None outside a flow
    run or without a UI address."""
    run_id = flow_run.get_id()
    return url_for("flow-run", obj_id=run_id) if run_id else None


def progress_artifact(job_dir: Path, logger) -> Callable[[float, str], None]:
    """A progress artifact for the job's training, and the sink that moves it and logs each
    progress line."""
    artifact_id = create_progress_artifact(
        progress=0.0, key=None, description=f"training progress of {job_dir.name}")

    def on_progress(percent: float, message: str) -> None:
        update_progress_artifact(artifact_id, progress=percent)
        logger.info(message)

    return on_progress


def run_attempt(number: int, capacity_type: str, body: Callable[..., AttemptEnd]) -> int:
    """Run one attempt as its own task run ``attempt-N`` whose final state names its outcome
    (Preempted, InfrastructureFailure, StoppedByUser, ...); its exit code, or what it raised."""
    ended: list[AttemptEnd] = []

    @task(name="attempt", cache_policy=NO_CACHE)
    def attempt_task(number: int, capacity_type: str) -> State:
        end = body(get_run_logger())
        ended.append(end)
        return attempt_state(end.code, end.request, end.ended_by_rank, retried=end.retried)

    # Committed at once: a finished attempt's named state stays, even if `train` fails later
    # (a lazy transaction would roll it back to "RolledBack").
    with transaction(commit_mode=CommitMode.EAGER):
        state = attempt_task.with_options(task_run_name=f"attempt-{number}")(
            number, capacity_type, return_state=True)
    if not ended:
        state.result()  # the attempt raised (timeout, cancel): raise it here
    return ended[-1].code


def prefect_sender(error: BaseException) -> str | None:
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
