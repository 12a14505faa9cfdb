"""Prefect states for how attempts and runs end: named attempt states (Preempted,
InfrastructureFailure, StoppedByGuard), and Cancelled for a run someone stopped.

Ctrl-C or SIGTERM to ``stoker run``, or a stop requested by the cost guard or a user, ends the
flow run Cancelled with the reason.

Prefect records a KeyboardInterrupt as Crashed; a stop the user asked for is not a crash. The
flow body catches ``stoker run``'s stop (:class:`stoker.stopping.Interrupted`) once the training
tree has committed its stop checkpoint and returns Cancelled with the reason
(:func:`stopped_by_signal`), so the flow run never passes through Crashed. A stop that lands
outside the body (Prefect's own bookkeeping) still ends Crashed first; the flow's ``on_crashed``
hook then replaces it with Cancelled.

A Prefect cancel of a run on a worker reaches the flow process as SIGTERM (Prefect's
``TerminationSignal``, with the intent "cancel"); the launcher stops the training tree (the ranks
commit a stop checkpoint). :func:`cancelled_promptly` then records Cancelled itself and ends the
flow process as soon as its logs are sent: the worker would otherwise mark the run Cancelled
only after the process exits, and the interpreter's finalizers (torch, DVC's threads) held that
exit back for 15-25 s.

A cancel that no worker carries out (its worker was killed; a ``stoker run`` flow run, which has
none) left the run Cancelling while it trained on to the end. :class:`CancelWatcher` stops the
job itself then, as ``stoker stop`` does: the ranks commit a stop checkpoint and the run ends
Cancelled.
"""

from __future__ import annotations

import atexit
import contextlib

from prefect.client.orchestration import get_client
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed, State

from stoker.jobs.stop_request import StopRequest, TrainingStopped
from stoker.launch.retry import Outcome, describe_exit, outcome_of
from stoker.orchestration.flow_runs import (
    cancel_runs,
    cancel_stopped_at_once,
    cancelled,
    cancelling_run,
    untagged_task_runs,  # noqa: F401 - every flow wraps its body in it
)
from stoker.orchestration.stop_logs import NO_RETRY, install_stop_log_filter
from stoker.stopping import exit_now, on_kill, rearm, stop_reason


def attempt_state(code: int, request: StopRequest | None,
                  ended_by_rank: int | None = None, retried: bool = True) -> State:
    """The attempt task run's final state, named after its outcome; ``data`` is the exit code.
    ``ended_by_rank``: the rank whose own exit 137 ended the attempt (not a kill), if known.
    ``retried``: whether another attempt follows (:func:`stoker.launch.retry.will_retry`); when
    none does, a preemption or an infrastructure failure says ``no retry left`` (its budget,
    ``retry.max_preemptions`` or ``retry.max_infra_failures``, is spent)."""
    outcome = outcome_of(code, request is not None)
    message = f"exit {describe_exit(code, ended_by_rank)}: {outcome}"
    if outcome == Outcome.COMPLETED:
        return Completed(data=code, message=message)
    if outcome == Outcome.PREEMPTED:
        return Completed(name="Preempted", data=code, message=f"{message} (checkpoint "
                         f"committed, {'to be resumed' if retried else NO_RETRY})")
    if outcome == Outcome.STOPPED:
        name = {"cost-guard": "StoppedByGuard", "budget": "StoppedByBudget"}.get(
            request.by, "StoppedByUser")
        return Cancelled(name=name, data=code, message=f"{message}: {request.describe()}")
    if outcome == Outcome.INFRASTRUCTURE:
        return Failed(name="InfrastructureFailure", data=code,
                      message=message if retried else f"{message}, {NO_RETRY}")
    if outcome == Outcome.STORAGE:
        return Failed(name="StorageError", data=code, message=message)
    return Failed(name="UserError", data=code, message=message)


def stops_as_cancelled(body):
    """Decorate a flow's body: :class:`stoker.stopping.Interrupted` (``stoker run`` got Ctrl-C,
    SIGTERM or SIGHUP) returns :func:`stopped_by_signal`'s Cancelled state, not a crash. A run
    that is Cancelling at its end (a Prefect cancel no worker carried out: :class:`CancelWatcher`
    stopped the job, or it came after training) returns its Cancelled end too
    (:func:`prefect_cancel` says how, for ``stoker run``'s last line)."""
    import functools

    from stoker.stopping import Interrupted

    @functools.wraps(body)
    def wrapper(*args, **kwargs):
        from prefect.runtime import flow_run

        run_id = flow_run.get_id()
        try:
            with on_kill(lambda reason: cancel_stopped_at_once(run_id, reason)):
                result = body(*args, **kwargs)
        except Interrupted:
            return stopped_by_signal()
        except TrainingStopped as e:
            if cancelling_run(run_id) is None:
                raise  # stoker stop, the cost guard: Failed, then the on_failure hook's Cancelled
            return cancelled(run_id, str(e), stopped=True)
        if (run := cancelling_run(run_id)) is not None:  # nothing was left to stop
            return cancelled(run_id, f"flow run {run.name!r} was cancelled after training had "
                              "finished: nothing was left to stop, the run did all its work",
                              stopped=False, summary=result)
        return result

    return wrapper


def stopped_by_signal() -> State:
    """Inside a flow body, after ``stoker run`` got Ctrl-C, SIGTERM or SIGHUP (the training tree
    has committed its stop checkpoint): its task runs are set Cancelled and the Cancelled state
    returned is the flow run's final state, so the run never passes through Crashed (which
    Prefect automations and notifications would act on). ``stoker run`` exits 128 + the signal."""
    from prefect.runtime import flow_run

    message = f"stopped by {stop_reason()}"
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        cancel_runs(client, flow_run.get_id(), message, flow_run_too=False)
    return Cancelled(message=message)


def _drain_and_exit() -> None:
    """``atexit``: send Prefect's queued logs and events, then end the process at once."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)
    exit_now(0)  # what Prefect's engine exits with after a cancel it was told about


@contextlib.contextmanager
def cancelled_promptly():
    """Wrap a flow's body: after a Prefect cancel (SIGTERM with the intent "cancel", the
    training tree already stopped), record the flow run and its task runs Cancelled and end the
    process with 0 as soon as Prefect's logs and events are sent. Under ``stoker run``, SIGTERM
    is taken back from Prefect's bridge (:func:`stoker.stopping.rearm`): a stop like Ctrl-C."""
    install_stop_log_filter()
    rearm()
    try:
        yield
    except TerminationSignal:
        from prefect._internal.control_listener import get_intent
        from prefect.runtime import flow_run

        if get_intent() == "cancel" and flow_run.get_id():
            with contextlib.suppress(Exception), get_client(sync_client=True) as client:
                cancel_runs(client, flow_run.get_id(), "cancelled from Prefect: training "
                             "stopped at its stop checkpoint")
            atexit.register(_drain_and_exit)  # registered last: runs first
        raise


def cancel_stopped_flow_run(flow, flow_run, state) -> None:  # noqa: ARG001 - named as Prefect calls it
    """``on_crashed``/``on_failure`` hook of a flow: after a stop (a signal to ``stoker run``, or
    :class:`TrainingStopped`), the flow run and its crashed or failed task runs (``train``,
    ``attempt-N``) become Cancelled with the reason.

    The parameters are named as Prefect names them: a worker runs a crashed flow process's
    ``on_crashed`` hooks with keyword arguments (``flow=``, ``flow_run=``, ``state=``)."""
    if state.is_failed() and TrainingStopped.__name__ in (state.message or ""):
        message = (state.message or "").split(f"{TrainingStopped.__name__}: ", 1)[-1]
    elif state.is_crashed() and stop_reason() is not None:
        message = f"stopped by {stop_reason()}"
    else:  # a real failure or crash stays as it is
        return
    with get_client(sync_client=True) as client:
        cancel_runs(client, flow_run.id, message)
