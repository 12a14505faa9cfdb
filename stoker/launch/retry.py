"""How an attempt ended (from the runtime's exit-code contract) and which attempts to retry.

No Prefect here: the ``train`` task wraps these functions. The exit-code contract is the runtime's
(see ``stoker.runtime.launch``): 0 done, 75 preempted, 137 killed (infrastructure), 74 the
checkpoint storage refused a write (a full disk), else a bug or bad input.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum

from tenacity import Retrying, retry_if_result, stop_never, wait_exponential

from stoker.config import RetryConfig
from stoker.runtime import EXIT_INFRASTRUCTURE, EXIT_OK, EXIT_PREEMPTED, EXIT_STORAGE


class Outcome(StrEnum):
    COMPLETED = "completed"
    PREEMPTED = "preempted"
    INFRASTRUCTURE = "infrastructure_failure"
    USER_ERROR = "user_error"
    STORAGE = "storage_error"  # the checkpoint storage refused a write: not retried
    STOPPED = "stopped"  # the cost guard or a user asked for the stop: not retried


def classify_exit(code: int) -> Outcome:
    """Map an attempt's exit code to its outcome (negative codes: killed by that signal)."""
    if code == EXIT_OK:
        return Outcome.COMPLETED
    if code == EXIT_PREEMPTED:
        return Outcome.PREEMPTED
    if code in (137, -signal.SIGKILL):
        return Outcome.INFRASTRUCTURE
    if code == EXIT_STORAGE:
        return Outcome.STORAGE
    return Outcome.USER_ERROR


def describe_exit(code: int, ended_by_rank: object = None, hang: object = None,
                  killed: object = None) -> str:
    """An exit code as a shell reports it, with the signal it stands for: ``"137 (SIGKILL)"``
    for 137 and for -9 (``Popen``'s form of a death by signal 9), ``"75"`` for 75.

    ``ended_by_rank``: the rank whose own exit 137 ended the attempt (the launcher said so: a
    stall or a lost peer that rank found), when known: ``"137 from rank 1 itself, not a kill"``;
    anything but a rank number (a record's field, untrusted) is ignored. ``hang``: the hang
    watchdog's summary when it ended the attempt (``"137: hang: no rank progressed ..."``);
    anything but a string is ignored, control characters are dropped, 300 characters at most.
    ``killed``: which rank a signal ended, in words (``LineLog.killed``: ``"local rank 1 (pid
    4321) was killed by SIGKILL"``), added after the code when it did not complete (0).
    """
    if code != 0 and isinstance(killed, str) and killed.strip():
        said = "".join(c for c in killed if c.isprintable())[:300]
        return f"{describe_exit(code, ended_by_rank, hang)}: {said}"
    if code == EXIT_INFRASTRUCTURE and isinstance(hang, str) and hang.strip():
        said = "".join(c for c in hang if c.isprintable())[:300]
        return f"{code}: hang: {said}"
    if code == EXIT_INFRASTRUCTURE and type(ended_by_rank) is int and ended_by_rank >= 0:
        return f"{code} from rank {ended_by_rank} itself, not a kill"
    if code < 0:
        code = 128 - code
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(code - 128).name})"
    return str(code)


def describe_recorded_exit(record: dict) -> str:
    """:func:`describe_exit` of an attempt record (``attempts.jsonl``: untrusted, each field
    checked there)."""
    return describe_exit(record["exit_code"], record.get("ended_by_rank"), record.get("hang"),
                         record.get("killed"))


def outcome_of(code: int, stop_requested: bool) -> Outcome:
    """The attempt's outcome: a stop someone asked for (``stop_requested``) is STOPPED, whatever
    the exit code, unless the attempt completed anyway."""
    outcome = classify_exit(code)
    return Outcome.STOPPED if stop_requested and outcome != Outcome.COMPLETED else outcome


@dataclass(frozen=True)
class Attempt:
    """One launch of the runtime. Times are Unix seconds; ``duration_s`` in seconds."""

    number: int
    exit_code: int
    outcome: Outcome
    started: float
    duration_s: float

    def to_dict(self) -> dict:
        return {**asdict(self), "outcome": str(self.outcome)}


RETRYABLE = {Outcome.PREEMPTED, Outcome.INFRASTRUCTURE, Outcome.USER_ERROR}


def budget_for(policy: RetryConfig, outcome: Outcome) -> int:
    """How many attempts ending with ``outcome`` may be retried."""
    return {Outcome.PREEMPTED: policy.max_preemptions,
            Outcome.INFRASTRUCTURE: policy.max_infra_failures,
            Outcome.USER_ERROR: policy.max_user_errors}.get(outcome, 0)


BUDGET_FIELDS = {Outcome.PREEMPTED: "retry.max_preemptions",
                 Outcome.INFRASTRUCTURE: "retry.max_infra_failures"}


def will_retry(policy: RetryConfig, attempts: list[Attempt]) -> bool:
    """Whether the last of ``attempts`` (this run's, oldest first) is retried: its outcome is
    one that retries and its budget (``budget_for``) covers every attempt that ended so."""
    if not attempts or attempts[-1].outcome not in RETRYABLE:
        return False
    outcome = attempts[-1].outcome
    return sum(a.outcome == outcome for a in attempts) <= budget_for(policy, outcome)


def budget_spent(policy: RetryConfig, attempts: list[Attempt]) -> str | None:
    """Why retrying stopped, when the last attempt's outcome ran out of its budget, in words:
    ``"3 infrastructure_failure attempts, more than retry.max_infra_failures=2"``; None when the
    last outcome is not one that retries (completed, stopped, a failure in user code)."""
    if not attempts or attempts[-1].outcome not in BUDGET_FIELDS:
        return None
    outcome = attempts[-1].outcome
    used = sum(a.outcome == outcome for a in attempts)
    field = BUDGET_FIELDS[outcome]
    return (f"{used} {outcome} attempt{'s' if used != 1 else ''}, more than "
            f"{field}={budget_for(policy, outcome)}"
            if used > budget_for(policy, outcome) else None)


def run_with_retries(launch: Callable[[int], int], policy: RetryConfig,
                     on_attempt: Callable[[Attempt], None] = lambda a: None,
                     sleep: Callable[[float], None] = time.sleep,
                     stop_requested: Callable[[], bool] = lambda: False) -> list[Attempt]:
    """Call ``launch(attempt_number)`` until it completes or a retry budget is spent.

    Each outcome has its own budget (``policy``). An attempt that ends while
    ``stop_requested()`` is true is STOPPED and never retried. A preempted attempt is resumed at
    once; after failures the wait grows exponentially from ``policy.backoff_s`` up to
    ``policy.backoff_max_s`` seconds.

    Returns:
        All attempts, oldest first; the last one's outcome is the job's.
    """
    attempts: list[Attempt] = []

    def once() -> Attempt:
        started = time.time()
        code = launch(len(attempts) + 1)
        attempt = Attempt(len(attempts) + 1, code, outcome_of(code, stop_requested()), started,
                          round(time.time() - started, 3))
        attempts.append(attempt)
        on_attempt(attempt)
        return attempt

    backoff = wait_exponential(multiplier=policy.backoff_s, max=policy.backoff_max_s)

    def wait(state) -> float:
        # A preempted attempt committed its checkpoint: resume at once. Failures back off.
        if state.outcome.result().outcome == Outcome.PREEMPTED:
            return 0.0
        return backoff(state)

    retrying = Retrying(retry=retry_if_result(lambda _: will_retry(policy, attempts)),
                        stop=stop_never, sleep=sleep, wait=wait)
    retrying(once)
    return attempts
