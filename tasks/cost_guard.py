"""Cost-guard tasks: one sweep, its Markdown artifact and its Prefect events; the Prefect actor.

The logic is in :mod:`stoker.costguard`; these wrappers add what needs Prefect: cancelling flow
runs, the artifact and events (``stoker.cost-guard.idle``, ``.stalled``, ``.leak``, ``.unknown``,
``.action``, ``.swept``, and ``.failed`` when a sweep crashes) to which users attach automations.
"""

from __future__ import annotations

from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.events import emit_event
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling

from stoker.costguard.actions import ActionResult
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.host import sweep_host
from stoker.costguard.inventory import Resource
from stoker.costguard.report import (
    event_payload,
    event_resource,
    failure_payload,
    log_line,
    render_failure,
    render_markdown,
)
from stoker.costguard.sweep import SweepReport
from stoker.ownership import PREFECT_OWNER_TAG

ARTIFACT_KEY = "stoker-cost-guard"
EVENT_PREFIX = "stoker.cost-guard"
_CANCELLABLE = {StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED}
_ACTED = {"stopped", "cancelled", "refused", "failed"}


class PrefectActor:
    """Cancels the flow run of an idle or stalled local job, only if tagged ``stoker:owned``.

    Cancelling lets the worker stop the flow's process; the train task then terminates torchrun
    (SIGTERM first, so the job checkpoints).
    """

    kind = "job"

    def act(self, resource: Resource) -> ActionResult:
        if not resource.flow_run_id:
            return ActionResult("refused", f"job {resource.name} records no Prefect flow run")
        with get_client(sync_client=True) as client:
            try:
                run = client.read_flow_run(UUID(resource.flow_run_id))
            except (ObjectNotFound, ValueError):
                return ActionResult("gone", f"flow run {resource.flow_run_id} not found")
            if PREFECT_OWNER_TAG not in (run.tags or []):
                return ActionResult("refused", f"flow run {run.name} has no "
                                    f"{PREFECT_OWNER_TAG} tag")
            if run.state_type not in _CANCELLABLE:
                return ActionResult("gone", f"flow run {run.name} is {run.state_name}")
            result = client.set_flow_run_state(run.id, Cancelling(
                message=f"Stoker cost guard: job {resource.name} idle or stalled"))
        if result.status != SetStateStatus.ACCEPT:
            reason = getattr(result.details, "reason", None)
            return ActionResult("failed", f"flow run {run.name}: {result.status.value} {reason}")
        return ActionResult("cancelled", f"flow run {run.name} cancelling")


@task(name="cost-guard-sweep", cache_policy=NO_CACHE)
def sweep(config: CostGuardConfig) -> SweepReport:
    """Sample GPUs over the window, judge every Stoker-owned resource and act unless dry-run."""
    logger = get_run_logger()
    try:
        report = sweep_host(config, {"job": PrefectActor()} if config.prefect.enabled else None)
    except Exception as e:
        publish_failure(config, e)  # the operator sees what failed, then the task fails
        raise
    for row in (*report.gpus, *report.resources):
        logger.info("%s", log_line(row))
    return report


def publish_failure(config: CostGuardConfig, error: BaseException) -> None:
    """A crashed sweep still leaves the artifact and a ``stoker.cost-guard.failed`` event."""
    create_markdown_artifact(markdown=render_failure(error, config.dry_run), key=ARTIFACT_KEY,
                             description="Cost guard: the sweep failed")
    emit_event(f"{EVENT_PREFIX}.failed", resource={
        "prefect.resource.id": "stoker.cost-guard", "prefect.resource.name": "cost guard"},
        payload=failure_payload(error, config.dry_run))


def emit_events(report: SweepReport) -> list:
    """One event per idle, stalled, leaking or unknown GPU/resource, one per action taken, one
    for the sweep.

    Returns:
        The emitted events (None entries where events are switched off).
    """
    emitted = []
    for row in (*report.gpus, *report.resources):
        verdict = str(row.decision.verdict)
        related = ([{"prefect.resource.id": f"prefect.flow-run.{row.flow_run_id}",
                     "prefect.resource.role": "stoker-job"}] if row.flow_run_id else None)
        if verdict in ("idle", "stalled", "leak", "unknown"):
            emitted.append(emit_event(f"{EVENT_PREFIX}.{verdict}", resource=event_resource(row),
                                      related=related,
                                      payload=event_payload(row, report.dry_run)))
        if row.action_status in _ACTED:
            emitted.append(emit_event(f"{EVENT_PREFIX}.action", resource=event_resource(row),
                                      related=related,
                                      payload=event_payload(row, report.dry_run)))
    emitted.append(emit_event(f"{EVENT_PREFIX}.swept", resource={
        "prefect.resource.id": "stoker.cost-guard", "prefect.resource.name": "cost guard"},
        payload={"dry_run": report.dry_run, "gpus": len(report.gpus),
                 "resources": len(report.resources),
                 "idle_gpu_hours": round(report.idle_gpu_hours, 4),
                 "usd_per_hour": round(report.usd_per_hour, 4)}))
    return emitted


@task(name="cost-guard-report", cache_policy=NO_CACHE)
def report(result: SweepReport) -> str:
    """Publish the sweep as a Markdown artifact and as Prefect events."""
    markdown = render_markdown(result)
    create_markdown_artifact(markdown=markdown, key=ARTIFACT_KEY,
                             description="Cost guard: GPU signals, verdicts, actions, $ per hour")
    emit_events(result)
    return markdown
