"""Flow runs on the Prefect server, for how a run ends: Cancelled for a run someone stopped,
Crashed for a run whose process is gone, and the thread that carries out a cancel no worker does.

These read and set states through Prefect's client; the task and flow hooks that call them are
in ``tasks/stopping.py`` (see there for the whole story of how a stop reaches Prefect).
"""

from __future__ import annotations

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
from prefect.states import Cancelled, State

from stoker.stopping import stop_reason


def cancel_runs(client, flow_run_id, message: str, flow_run_too: bool = True) -> None:
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


_PREFECT_CANCEL: dict = {}  # how a Prefect cancel no worker carried out ended this process's run


def prefect_cancel() -> dict | None:
    """How a Prefect cancel that no worker carried out ended this process's flow run, for
    ``stoker run``'s last line and exit code: ``message``, ``stopped`` (True: the job was
    stopped, resumable; False: it came after training, nothing was stopped) and the flow's
    ``summary`` when it did all its work. None when there was none."""
    return dict(_PREFECT_CANCEL) or None


def cancelled(flow_run_id: str, message: str, **outcome) -> State:
    """The Cancelled end of a flow run that is Cancelling (its task runs too). Prefect refuses
    a Failed from Cancelling (the run stayed Cancelling) and then takes a Failed after a forced
    Cancelled; a Cancelled returned by the flow is the one accepted end."""
    _PREFECT_CANCEL.update(message=message, **outcome)
    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        cancel_runs(client, flow_run_id, message, flow_run_too=False)
    return Cancelled(message=message)


def cancel_stopped_at_once(flow_run_id: str | None, reason: str) -> None:
    """A second stop signal ends ``stoker run`` at once (:func:`stoker.stopping.on_kill`): its
    flow run and open task runs become Cancelled, ``stopped at once (a second signal after
    SIGINT (Ctrl-C))``, as a single Ctrl-C's do (trial: left Running, then marked Crashed, "its
    process died", by the next command)."""
    if flow_run_id:
        with get_client(sync_client=True) as client:
            cancel_runs(client, flow_run_id, f"stopped at once (a second signal after {reason})")


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


def cancelling_run(flow_run_id: str | None):
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
    stop`` does (:func:`stoker.jobs.stop.stop_job`): a stop request by ``a Prefect
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
        run = cancelling_run(self.flow_run_id)
        return None if run is None else f"a Prefect cancel of flow run {run.name!r}"

    def run(self) -> None:
        self._context.run(self._watch)

    def _watch(self) -> None:
        from stoker.jobs.attempts import AttemptLog, is_closed
        from stoker.jobs.stop import stop_job
        from stoker.jobs.stop_request import read_stop_request
        from stoker.runtime.preemption import signal_sender

        while not self.stopped.wait(self.every_s):
            run = cancelling_run(self.flow_run_id)
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
