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

import ast
import atexit
import contextlib
import contextvars
import logging
import threading
import time
from pathlib import Path
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed, State

from stoker.launch.retry import Outcome, describe_exit, outcome_of
from stoker.jobs.stop_request import StopRequest, TrainingStopped
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


NO_RETRY = "no retry left"  # an attempt's state message when its retry budget is spent


def _cancel_runs(client, flow_run_id, message: str, flow_run_too: bool = True) -> None:
    """Set the flow run and its crashed, failed or running task runs (``train``, ``attempt-N``)
    Cancelled with ``message``; an earlier attempt's own outcome stays."""
    open_or_crashed = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(
            any_=[StateType.CRASHED, StateType.FAILED, StateType.RUNNING]))))
    for task_run in open_or_crashed:
        if task_run.state and task_run.state.name in (
                "InfrastructureFailure", "StorageError", "UserError"):
            continue  # an earlier attempt's own outcome
        client.set_task_run_state(task_run.id, Cancelled(message=message), force=True)
    if flow_run_too:
        client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)


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
            if _cancelling_run(run_id) is None:
                raise  # stoker stop, the cost guard: Failed, then the on_failure hook's Cancelled
            return _cancelled(run_id, str(e), stopped=True)
        if (run := _cancelling_run(run_id)) is not None:  # nothing was left to stop
            return _cancelled(run_id, f"flow run {run.name!r} was cancelled after training had "
                              "finished: nothing was left to stop, the run did all its work",
                              stopped=False, summary=result)
        return result

    return wrapper


_PREFECT_CANCEL: dict = {}  # how a Prefect cancel no worker carried out ended this process's run


def prefect_cancel() -> dict | None:
    """How a Prefect cancel that no worker carried out ended this process's flow run, for
    ``stoker run``'s last line and exit code: ``message``, ``stopped`` (True: the job was
    stopped, resumable; False: it came after training, nothing was stopped) and the flow's
    ``summary`` when it did all its work. None when there was none."""
    return dict(_PREFECT_CANCEL) or None


def _cancelled(flow_run_id: str, message: str, **outcome) -> State:
    """The Cancelled end of a flow run that is Cancelling (its task runs too). Prefect refuses
    a Failed from Cancelling (the run stayed Cancelling) and then takes a Failed after a forced
    Cancelled; a Cancelled returned by the flow is the one accepted end."""
    _PREFECT_CANCEL.update(message=message, **outcome)
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        _cancel_runs(client, flow_run_id, message, flow_run_too=False)
    return Cancelled(message=message)


def cancel_stopped_at_once(flow_run_id: str | None, reason: str) -> None:
    """A second stop signal ends ``stoker run`` at once (:func:`stoker.stopping.on_kill`): its
    flow run and open task runs become Cancelled, ``stopped at once (a second signal after
    SIGINT (Ctrl-C))``, as a single Ctrl-C's do (trial: left Running, then marked Crashed, "its
    process died", by the next command)."""
    if flow_run_id:
        with get_client(sync_client=True) as client:
            _cancel_runs(client, flow_run_id, f"stopped at once (a second signal after {reason})")


def stopped_by_signal() -> State:
    """Inside a flow body, after ``stoker run`` got Ctrl-C, SIGTERM or SIGHUP (the training tree
    has committed its stop checkpoint): its task runs are set Cancelled and the Cancelled state
    returned is the flow run's final state, so the run never passes through Crashed (which
    Prefect automations and notifications would act on). ``stoker run`` exits 128 + the signal."""
    from prefect.runtime import flow_run

    message = f"stopped by {stop_reason()}"
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        _cancel_runs(client, flow_run.get_id(), message, flow_run_too=False)
    return Cancelled(message=message)


def _drain_and_exit() -> None:
    """``atexit``: send Prefect's queued logs and events, then end the process at once."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)
    exit_now(0)  # what Prefect's engine exits with after a cancel it was told about


def _stop_in_progress() -> str | None:
    """Why this flow process is stopping (a signal to ``stoker run``, a Prefect cancel), or None."""
    if stop_reason() is not None:
        return f"stopped by {stop_reason()}"
    from prefect._internal.control_listener import get_intent

    return "cancelled from Prefect" if get_intent() == "cancel" else None


def _state_message(line: str) -> str:
    """The message of Prefect's ``Finished in state Failed('...')`` line as it was raised: Prefect
    writes the state's message as a Python literal (``it\\'s``), which would be escaped twice
    when written as one again. The line itself where it is not one."""
    literal = line.partition("(")[2].removesuffix(")")
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return line
    return value if isinstance(value, str) else line


class StopLogFilter(logging.Filter):
    """Prefect's engine logs a stop as a crash ("Crash detected! ...", "Finished in state
    Crashed(...)", then "Running()" while the state is being replaced) just before Stoker records
    the run Cancelled: after a stop the first says what happened instead, at INFO, once per run;
    the "Finished in state ..." lines are dropped. A stop request's :class:`TrainingStopped`
    (logged as a failed task and flow run, then recorded Cancelled) reads ``stopped on request:
    recorded as Cancelled``, at INFO, without a traceback. An attempt's InfrastructureFailure,
    which is retried, is a WARNING, not an ERROR (both of Prefect's lines for it)."""

    CRASH_LINE = "Crash detected!"
    FINISHED_LINES = ("Finished in state Crashed", "Finished in state Running")

    FAILED_LINES = ("Task run failed with exception", "Encountered exception during execution")
    STOPPED_STATES = ("Finished in state StoppedByUser", "Finished in state StoppedByGuard")
    # Prefect's two lines for a task run that returned this state (the second: "Task run failed
    # with state: InfrastructureFailure(message=...)", logged with exc_info).
    INFRASTRUCTURE_LINES = ("Finished in state InfrastructureFailure",
                            "Task run failed with state: InfrastructureFailure")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.INFRASTRUCTURE_LINES) and record.levelno > logging.WARNING:
            # An attempt that lost its node, a rank or its data workers: retried from the last
            # checkpoint while retry.max_infra_failures allows. Expected on spot capacity: a
            # warning, not an error. One that is not retried (its state says "no retry left")
            # stays an ERROR (trial: a WARNING, though the job had failed). Neither carries a
            # traceback (Prefect attaches an empty one to a returned Failed state).
            if NO_RETRY not in message:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
            return True
        if message.startswith("Finished in state Failed") and TrainingStopped.__name__ in message:
            if record.name != "prefect.flow_runs":
                return False  # a task run's: said once already, by the line below
            # The flow run's last line, as after a Ctrl-C: the state its hook records next.
            stopped = _state_message(message).split(f"{TrainingStopped.__name__}: ", 1)[-1]
            record.msg, record.args = f"Finished in state Cancelled({stopped!r})", ()
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
            return True
        if message.startswith(self.FAILED_LINES) and TrainingStopped.__name__ in message \
                and record.name == "prefect.flow_runs":
            return False  # the flow run's "Finished in state Cancelled(...)" line says it
        if message.startswith(self.FAILED_LINES) and TrainingStopped.__name__ in message \
                or message.startswith(self.STOPPED_STATES):
            # A stop request (the cost guard, stoker stop) ends the task by raising; its hook
            # records the runs Cancelled. Not an ERROR with a traceback on the terminal (second
            # new-user trial); stoker run's last line says who stopped it.
            record.msg, record.args = ("stopped on request: recorded as Cancelled"
                                       if TrainingStopped.__name__ in message else message), ()
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
            return True
        if not message.startswith((self.CRASH_LINE, *self.FINISHED_LINES)):
            return True
        reason = _stop_in_progress()
        if reason is None:
            return True
        if message.startswith(self.FINISHED_LINES):
            return False  # said once already, by the rewritten "Crash detected!" line
        record.msg, record.args = f"{reason}: recorded as Cancelled", ()
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = None
        return True


def install_stop_log_filter() -> None:
    """Put :class:`StopLogFilter` on Prefect's flow-run and task-run loggers (once)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, StopLogFilter) for f in logger.filters):
            logger.addFilter(StopLogFilter())


@contextlib.contextmanager
def untagged_task_runs():
    """Wrap a flow's body: its task runs do not inherit ``stoker run``'s ``stoker:process=``
    tag, which belongs to the flow run (:func:`crash_runs_of_gone_processes` reads it there).

    Prefect checks a tagged task run against the tag concurrency limits before it starts, and
    the answer "no limit" is cached for 5 s only. After a training attempt of more than 5 s the
    next task asked the server again; that check is a write to the server's database, and on
    the local sqlite server it met the writes of the attempt's logs and events ("database is
    locked", HTTP 503), which Prefect's client retries after about 2 s: 2 s of every run,
    spent before registration. Tags given with ``prefect.tags`` or a task's own tags stay."""
    from prefect.context import TagsContext

    from stoker.local_server import PROCESS_TAG

    current = TagsContext.get().current_tags
    with TagsContext(current_tags={t for t in current if not t.startswith(PROCESS_TAG)}):
        yield


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
                _cancel_runs(client, flow_run.get_id(), "cancelled from Prefect: training "
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
        _cancel_runs(client, flow_run.id, message)


def crash_orphaned_flow_run(flow_run_id: str | None, job: str, current: str | None) -> None:
    """Mark the flow run of a dead owner whose lease was taken over Crashed (its ``stoker run``
    or worker was killed, so nothing else ever ends it). Runs still Running or Pending only; a
    run the server does not know (another Prefect database) is left alone."""
    if not flow_run_id or flow_run_id == current:
        return
    from uuid import UUID

    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(UUID(str(flow_run_id)))
        except (ObjectNotFound, ValueError):
            return
        if run.state is None or run.state.type not in (StateType.RUNNING, StateType.PENDING):
            return
        _crash_run(client, run.id, f"its process died; job {job} was taken over by flow run "
                   f"{current}")



def crash_runs_of_gone_processes() -> list[str]:
    """Mark Crashed every flow run left Running, Pending or Cancelling by a command whose process
    is gone (its ``stoker:process=`` tag names a dead pid on this host): a SIGKILLed
    ``stoker run`` leaves its run so on the long-lived local server. Returns their ids."""
    from prefect.client.schemas.filters import FlowRunFilterState, FlowRunFilterStateType

    from stoker.local_server import process_gone

    crashed = []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING,
                                              StateType.CANCELLING]))))
        for run in runs:
            pid = process_gone(list(run.tags or []))
            if pid is None:
                continue
            _crash_run(client, run.id, f"its process (pid {pid}) died; marked by the next "
                       "command")
            crashed.append(str(run.id))
    return crashed


def _crash_run(client, flow_run_id, message: str) -> None:
    """Set a flow run whose process is gone Crashed with ``message``, and its task runs left
    Running or Pending (``train``, ``attempt-N``: the UI would show them training forever)."""
    from prefect.states import Crashed

    client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    left = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(
            any_=[StateType.RUNNING, StateType.PENDING]))))
    for task_run in left:
        client.set_task_run_state(task_run.id, Crashed(message=message), force=True)


def _cancelling_run(flow_run_id: str | None):
    """The flow run when it is Cancelling, else None (also when it cannot be read)."""
    if not flow_run_id:
        return None
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(str(flow_run_id)))
        if run.state is not None and run.state.type == StateType.CANCELLING:
            return run
    return None


def cancel_reason(run, grace_s: float) -> str:
    """Why the flow stops its job for the Prefect cancel of ``run`` itself (the request's
    ``reason``; its ``by`` is ``a Prefect cancel of flow run 'name'``)."""
    if run.work_pool_name is None:
        return "stoker run has no worker, so the flow stops the job itself"
    return f"no worker carried it out in {grace_s:g} s, so the flow stops the job itself"


class CancelWatcher(threading.Thread):
    """Stops the job when its flow run is cancelled and nobody else stops it.

    A Prefect cancel sets the flow run Cancelling; on a worker the worker then sends SIGTERM to
    the flow process. When the worker is gone (killed, its machine lost), or the run has no
    worker (``stoker run``), nothing does (Prefect's known gap: PrefectHQ/prefect#21616) and
    the job trained on to its end, the run Cancelling all along. This thread reads the flow
    run's state every ``every_s`` seconds; Cancelling for ``grace_s`` seconds since the state
    was set (a worker's run: its worker acts within one or two) or at once (no worker), and no
    signal received already (the worker's SIGTERM, a Ctrl-C), it stops the job as ``stoker
    stop`` does (:func:`stoker.jobs.stop_request.stop_job`): a stop request by ``a Prefect
    cancel of flow run 'name'`` (or the cost guard's, which writes its request before it sets
    Cancelling), SIGTERM to the launcher, a stop checkpoint; the flow then ends Cancelled
    (:func:`stops_as_cancelled`). A failed read is retried at the next poll.
    """

    def __init__(self, job_dir: Path, flow_run_id: str,
                 logger: logging.Logger | logging.LoggerAdapter, every_s: float = 5.0,
                 grace_s: float = 15.0):
        super().__init__(daemon=True, name="cancel-watcher")
        self.job_dir, self.flow_run_id, self.logger = Path(job_dir), flow_run_id, logger
        self.every_s, self.grace_s = every_s, grace_s
        self.stopped = threading.Event()
        self._since = time.time()
        self._context = contextvars.copy_context()  # this run's Prefect settings and client

    def cancelled_by(self) -> str | None:
        """``a Prefect cancel of flow run 'name'`` when the flow run is Cancelling now (read
        from the server, in the caller's thread); else None. Before an attempt launches: a run
        cancelled while it pulled its data trains nothing."""
        run = _cancelling_run(self.flow_run_id)
        return None if run is None else f"a Prefect cancel of flow run {run.name!r}"

    def run(self) -> None:
        self._context.run(self._watch)

    def _watch(self) -> None:
        from stoker.jobs.attempts import AttemptLog, is_closed
        from stoker.jobs.stop_request import read_stop_request, stop_job
        from stoker.runtime.preemption import signal_sender

        while not self.stopped.wait(self.every_s):
            run = _cancelling_run(self.flow_run_id)
            if run is None:
                continue
            on_worker = run.work_pool_name is not None
            since = run.state.timestamp.timestamp() if run.state.timestamp else time.time()
            if on_worker and time.time() - since < self.grace_s:
                continue  # the worker's SIGTERM comes first
            if stop_reason() is not None or signal_sender(self.job_dir, self._since):
                return  # a stop is under way already (the worker's SIGTERM, a Ctrl-C)
            records = AttemptLog(self.job_dir).records()
            if not records or is_closed(records[-1]):
                continue  # no attempt trains (between two, or after the last): none to stop
            by, reason = f"a Prefect cancel of flow run {run.name!r}", cancel_reason(
                run, self.grace_s)
            request = read_stop_request(self.job_dir)
            if request is not None and request.time >= self._since:
                by, reason = request.by, request.reason  # the cost guard's: it set Cancelling
            self.logger.info("flow run %r is Cancelling and %s: job %s (the ranks commit a "
                             "stop checkpoint)", run.name, reason, self.job_dir.name)
            try:
                stop_job(self.job_dir, reason, by=by)
            except Exception as e:  # noqa: BLE001 - said; the request stays recorded
                self.logger.warning("could not stop job %s for %s: %s", self.job_dir.name, by, e)
            return

    def stop(self) -> None:
        self.stopped.set()
