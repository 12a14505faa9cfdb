"""Cost and goodput of a training job, computed from its attempts and progress events.

* Billed time is the wall time of every attempt (the GPUs are held from launch to exit, including
  start-up, evaluation, checkpoints and work later lost), times the devices the job held.
* Goodput is the time spent in training steps that count (restored from the last committed
  checkpoint on every resume, so lost steps are excluded) divided by billed wall time.
* Steps lost: per attempt, the highest step it reached minus the step the next attempt resumed at.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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


def steps_lost(events: list[dict]) -> int:
    """Steps that had to be run again, from ``progress.jsonl`` events (``start`` then ``step``)."""
    lost, reached = 0, None
    for event in events:
        if not isinstance(event.get("step"), int):
            continue  # a foreign or damaged record
        if event.get("event") == "start":
            if reached is not None:
                lost += max(0, reached - event["step"])
            reached = event["step"]
        elif event.get("event") in ("step", "checkpoint", "end") and reached is not None:
            reached = max(reached, event["step"])
    return lost


def cost_report(attempts: list[dict], events: list[dict], useful_train_s: float, devices: int,
                gpu_model: str, prices: PriceTable) -> CostReport:
    """Price a job.

    Args:
        attempts: dicts with ``duration_s``, ``outcome`` and ``capacity_type`` per attempt.
        events: the job's progress events (for steps lost).
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
        steps_lost=steps_lost(events),
        capacity_types=tuple(dict.fromkeys(a["capacity_type"] for a in attempts)),
    )
