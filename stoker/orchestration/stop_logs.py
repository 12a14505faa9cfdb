"""How Prefect's own log lines read after a stop: not as a crash or an error (a user's Ctrl-C,
a Prefect cancel, a stop request), and a retried infrastructure failure as a warning."""

from __future__ import annotations

import ast
import logging

from stoker.jobs.stop_request import TrainingStopped
from stoker.stopping import stop_reason

NO_RETRY = "no retry left"  # an attempt's state message when its retry budget is spent




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
