"""What the orchestrator (Prefect, in ``tasks/train.py``) gives a training run and gets back
from each attempt: :class:`FlowRunHooks` and :class:`AttemptEnd`. Plain Python."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stoker.jobs.stop_request import StopRequest


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended, for its task run's state: the exit code, the stop request that
    made it a stop (or None), the rank whose own exit 137 ended it, and whether another attempt
    follows."""

    code: int
    request: StopRequest | None
    ended_by_rank: int | None
    retried: bool


@dataclass
class FlowRunHooks:
    """What the orchestrator (Prefect) gives a training run.

    ``emit(**event)`` sends a Prefect event (:func:`stoker.tracking.events.training_event`).
    ``run_attempt(number, capacity_type, body)`` runs ``body(logger)`` (which launches the
    attempt, logging to the attempt's own logger, and returns its :class:`AttemptEnd`) as the
    attempt's own task run and returns its exit code, or raises what ``body`` raised.
    ``stopped_by(error)``: who stopped the flow when ``error`` interrupted it (a Prefect
    cancel), else None. ``crash_orphan(flow_run_id)`` marks the flow run of the job's dead
    owner Crashed. ``cancels``: a thread that stops the job for a cancel no worker carries out
    (``start``/``stop``/``cancelled_by``), or None."""

    logger: logging.Logger | logging.LoggerAdapter
    flow_run_id: str | None
    flow_run_url: str | None
    emit: Callable[..., None]
    run_attempt: Callable[[int, str, Callable[..., AttemptEnd]], int]
    stopped_by: Callable[[BaseException], str | None]
    crash_orphan: Callable[[str | None], None]
    cancels: object | None = None


def lease_lost_line(job_dir: Path, why: str | None, number: int) -> str:
    """``stoker run``'s error when its attempt ``number`` ended after another run took the job
    over (this one was stopped past its lease, e.g. ``kill -STOP``): the other run closed that
    attempt and trains the job now, so this one records nothing more."""
    return (f"job {job_dir.name}: lease lost ({why}) while attempt {number} ran; that run "
            "closed the attempt and trains the job now: this run records nothing more")
