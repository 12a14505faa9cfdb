"""Cost and goodput of a training job, computed from its attempts and progress events.

* Billed time is the wall time of every attempt (the GPUs are held from launch to exit, including
  start-up, evaluation, checkpoints and work later lost), times the devices the job held.
* Goodput is the time spent in training steps that count (restored from the last committed
  checkpoint on every resume, so lost steps are excluded) divided by billed wall time.
* Steps lost: per attempt, the step it reached minus the job's committed checkpoint step when it
  closed, as its record says (:func:`steps_lost`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stoker.runtime.records import integer, real_number
from stoker.tracking.pricing import PriceTable


@dataclass(frozen=True)
class CostReport:
    """Attributes: ``gpu_hours`` = devices x billed hours; ``cost_usd`` from ``prices``;
    ``goodput`` in 0..1; times in seconds; on CPU the devices are the worker processes and the
    price table's ``cpu`` entry applies. ``capacity_types``: the distinct capacity types of the
    attempts, in first-seen order (``("spot", "on_demand")``; each attempt's own is in its
    record)."""

    gpu_model: str
    devices: int
    billed_s: float
    useful_train_s: float
    gpu_hours: float
    cost_usd: float
    goodput: float
    attempts: int
    preemptions: int
    steps_lost: int
    capacity_types: tuple[str, ...]

    def metrics(self) -> dict[str, float]:
        """The numeric fields, as MLflow metrics."""
        return {k: float(v) for k, v in asdict(self).items() if isinstance(v, int | float)}

    def summary(self) -> dict:
        """Every field, for a person or a JSON summary: counts stay integers (``attempts: 1``,
        not ``1.0``), ``capacity_types`` a list."""
        return {**asdict(self), "capacity_types": list(self.capacity_types)}


def steps_lost(attempts: list[dict], events: list[dict]) -> int:
    """Steps a job trained past its last committed checkpoint and had to run again: the one
    figure ``stoker status``, the job summary and the ``steps_lost`` MLflow metric show.

    Args:
        attempts: the job's closed attempt records, oldest first. Each counts its own
            ``steps_lost``, written when it closed (the step rank 0 reached minus the job's
            committed checkpoint step; ``stoker.jobs.attempts.lost_steps``).
        events: the job's progress events (``progress.jsonl``), for a record written before
            attempts recorded it: the highest step reported between its start and the next
            attempt's, minus the step the next attempt resumed at (0 for the last attempt).

    Returns:
        The sum over the attempts (never negative); damaged records and events count 0.
    """
    def started(record: dict) -> float | None:
        return real_number(record.get("started"))

    timed = [e for e in events
             if integer(e.get("step")) is not None and real_number(e.get("time")) is not None]
    lost = 0
    for i, record in enumerate(attempts):
        own = record.get("steps_lost")
        if integer(own) is not None:
            lost += max(0, own)
            continue
        begin = started(record)
        after = next((t for r in attempts[i + 1:] if (t := started(r)) is not None), None)
        if begin is None or after is None:
            continue  # no window, or the last attempt: no resume to measure against
        reached = [e["step"] for e in timed if begin <= e["time"] < after
                   and e.get("event") in ("start", "step", "checkpoint", "end")]
        resumed = next((e["step"] for e in timed if e["time"] >= after
                        and e.get("event") == "start"), None)
        if reached and resumed is not None:
            lost += max(0, max(reached) - resumed)
    return lost


def cost_report(attempts: list[dict], events: list[dict], useful_train_s: float, devices: int,
                gpu_model: str, prices: PriceTable) -> CostReport:
    """Price a job.

    Args:
        attempts: dicts with ``duration_s``, ``outcome`` and ``capacity_type`` per attempt.
        events: the job's progress events (for steps lost of records without it:
            :func:`steps_lost`).
        useful_train_s: seconds in committed training steps (the runtime's ``train_time_s``).
        devices: GPUs (or CPU worker processes) held per attempt.
        gpu_model: NVML/CUDA device name, or ``cpu``.
    """
    billed_s = sum(a["duration_s"] for a in attempts)
    cost = sum(a["duration_s"] / 3600 * devices * prices.price(gpu_model, a["capacity_type"])
               for a in attempts)
    return CostReport(
        gpu_model=gpu_model, devices=devices, billed_s=round(billed_s, 3),
        useful_train_s=round(useful_train_s, 3),
        gpu_hours=round(devices * billed_s / 3600, 6), cost_usd=round(cost, 6),
        goodput=round(min(1.0, useful_train_s / billed_s), 4) if billed_s else 0.0,
        attempts=len(attempts), preemptions=sum(a["outcome"] == "preempted" for a in attempts),
        steps_lost=steps_lost(attempts, events),
        capacity_types=tuple(dict.fromkeys(a["capacity_type"] for a in attempts)),
    )
