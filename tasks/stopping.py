"""Prefect states for a stopped run: Ctrl-C or SIGTERM to ``stoker run`` ends it Cancelled.

Prefect records a KeyboardInterrupt as Crashed; a stop the user asked for is not a crash. The
flow's ``on_crashed`` hook, run once Prefect has recorded the crash, replaces it with Cancelled
and the reason.
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled

from stoker.stopping import stop_reason


def cancel_stopped_flow_run(_flow, flow_run, _state) -> None:
    """``on_crashed`` hook of a flow: after a stop, the flow run and its crashed task runs
    (``train``, ``attempt-N``) become Cancelled ("stopped by SIGINT (Ctrl-C)")."""
    reason = stop_reason()
    if reason is None:  # a real crash stays Crashed
        return
    message = f"stopped by {reason}"
    with get_client(sync_client=True) as client:
        crashed = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(
                type=TaskRunFilterStateType(any_=[StateType.CRASHED]))))
        for task_run in crashed:
            client.set_task_run_state(task_run.id, Cancelled(message=message), force=True)
        client.set_flow_run_state(flow_run.id, Cancelled(message=message), force=True)
