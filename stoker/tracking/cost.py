"""Cost and goodput of a training job, computed from its attempts and progress events.

* Billed time is the wall time of every attempt (the GPUs are held from launch to exit, including
  start-up, evaluation, checkpoints and work later lost), times the devices the job held.
* Goodput is the time spent in training steps that count (restored from the last committed
  checkpoint on every resume, so lost steps are excluded) divided by billed wall time.
* Steps lost: per attempt, the highest step its ranks trained minus the step the next attempt
  resumed at (the last attempt: its record's own figure, written when it closed;
  :func:`attempt_steps_lost`).
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
        attempts: the job's closed attempt records, oldest first.
        events: the job's progress events (``progress.jsonl``), oldest first.

    Returns:
        The sum of :func:`attempt_steps_lost` (never negative).
    """
    return sum(attempt_steps_lost(attempts, events))


def attempt_steps_lost(attempts: list[dict], events: list[dict]) -> list[int]:
    """Per closed attempt, the steps it trained that no later attempt could load.

    An attempt followed by another whose ranks started: the highest step its own ranks
    reported (their events carry the runtime's ``attempt`` number, also the ones written after
    the next run took the job over; and the record's ``reached_step``) minus the step the next
    ranks started at. A leftover (an
    owner that lost its lease) may commit its stop checkpoint after the takeover: loaded by the
    next attempt, those steps are not lost; committed too late, all it trained past the step
    the next attempt loaded is. Otherwise (the last attempt, or no events to tell) the
    record's own ``steps_lost``, written when it closed (the step rank 0 reached minus the
    job's committed checkpoint step; ``stoker.jobs.attempts.lost_steps``), also for a record
    written before records kept ``reached_step`` beside it.

    Args:
        attempts: the job's closed attempt records, oldest first (``started``: Unix seconds).
        events: the job's progress events (``progress.jsonl``), oldest first.

    Returns:
        Steps lost per attempt, in their order (each >= 0); a damaged record or event counts 0.
    """
    timed = [e for e in events
             if integer(e.get("step")) is not None and real_number(e.get("time")) is not None]
    starts = [e for e in timed if e.get("event") == "start"]
    begins = [real_number(r.get("started")) for r in attempts]
    lost = []
    for i, record in enumerate(attempts):
        own, reached = integer(record.get("steps_lost")), integer(record.get("reached_step"))
        after = next((t for t in begins[i + 1:] if t is not None), None)
        resumed = None if after is None else next(
            (e["step"] for e in starts if e["time"] >= after), None)
        if resumed is None or begins[i] is None or (own is not None and reached is None):
            lost.append(max(0, own or 0))  # nothing to measure against, or an older record
            continue
        # The heartbeat (in reached_step) runs ahead of the step events (every N steps).
        trained = max((s for s in (_trained_step(timed, starts, begins[i], after), reached)
                       if s is not None), default=None)
        lost.append(max(0, own or 0) if trained is None else max(0, trained - resumed))
    return lost


def _trained_step(timed: list[dict], starts: list[dict], begin: float,
                  after: float) -> int | None:
    """The highest step the ranks of the attempt that ran from ``begin`` until the next began
    (``after``; Unix seconds) reported: every event of the runtime attempts that started in
    that window, whenever written; without runtime numbers (older files), the events of the
    window. None when they reported none."""
    kinds = ("start", "step", "checkpoint", "end")
    own = {integer(e.get("attempt")) for e in starts if begin <= e["time"] < after} - {None}
    if own:
        steps = [e["step"] for e in timed
                 if e.get("event") in kinds and integer(e.get("attempt")) in own]
    else:
        steps = [e["step"] for e in timed if begin <= e["time"] < after
                 and e.get("event") in kinds and integer(e.get("attempt")) is None]
    return max(steps, default=None)


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
