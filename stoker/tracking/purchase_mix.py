"""Purchase-mix advice: how many GPUs to reserve, from a team's own hour-by-hour demand.

The model, for one GPU type over ``H`` hours of history:

* ``demand[h]``: GPUs in use in hour ``h`` (GPU-seconds in that hour / 3600, so fractional);
* ``fallback[h]``: the part of it that ran on on-demand because spot was reclaimed (a job that
  fell back after preemptions, ``retry.on_demand_after_preemptions``): it cannot go on spot;
* ``R`` reserved GPUs are paid for every hour, used or not. They cover the fallback demand
  first (it is the dearest to buy otherwise), then the rest; what is above them runs on spot,
  except the fallback, which runs on on-demand.

The cost of an hour, ``R*p_res + od(h, R)*p_od + spot(h, R)*p_spot``, is convex in ``R``: the
``R``-th reserved GPU saves ``p_od`` in an hour whose fallback demand reaches it, ``p_spot`` in
one whose demand only does, nothing above. So the best ``R`` is the largest whose saving over
the history still exceeds its price (:func:`best_reserved`); ``tests/test_purchase_mix.py``
checks it against a brute-force minimum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rates:
    """USD per GPU-hour of one GPU type, by capacity type."""

    on_demand: float
    spot: float
    reserved: float


def hour_cost(demand: float, fallback: float, reserved: int, rates: Rates) -> float:
    """USD for one hour with ``reserved`` GPUs reserved.

    Args:
        demand: GPUs in use in the hour (fractional: GPU-seconds / 3600).
        fallback: the part of ``demand`` that must run on on-demand (spot was reclaimed).
        reserved: GPUs reserved (paid whether used or not).
        rates: the prices.

    Returns:
        USD: reserved GPUs, on-demand for the fallback above them, spot for the rest above them.
    """
    fallback = min(max(0.0, fallback), demand)
    on_demand = max(0.0, fallback - reserved)
    left = max(0.0, reserved - fallback)  # reserved GPUs the fallback leaves free
    spot = max(0.0, (demand - fallback) - left)
    return reserved * rates.reserved + on_demand * rates.on_demand + spot * rates.spot


def mix_cost(demand: Sequence[float], fallback: Sequence[float], reserved: int,
             rates: Rates) -> float:
    """USD over the whole history with ``reserved`` GPUs reserved (:func:`hour_cost` summed)."""
    return sum(hour_cost(d, f, reserved, rates) for d, f in zip(demand, fallback, strict=True))


def _unit_saving(demand: float, fallback: float, unit: int, rates: Rates) -> float:
    """USD the ``unit``-th reserved GPU (1-based) saves in one hour, before its own price."""
    def covered(level: float) -> float:  # share of the unit's slot [unit-1, unit) under level
        return min(1.0, max(0.0, level - (unit - 1)))

    fallback = min(max(0.0, fallback), demand)
    return covered(fallback) * rates.on_demand + (covered(demand) - covered(fallback)) * rates.spot


def best_reserved(demand: Sequence[float], fallback: Sequence[float], rates: Rates) -> int:
    """The reserved GPU count that minimizes :func:`mix_cost` (the smallest of equal minima).

    Args:
        demand: GPUs in use per hour, oldest first.
        fallback: per hour, the on-demand part of ``demand`` that spot reclaims forced.
        rates: the prices.

    Returns:
        GPUs to reserve (0 when the history is empty or reserving never pays).
    """
    hours = len(demand)
    unit = 0
    while unit < math.ceil(max(demand, default=0.0)):
        saving = sum(_unit_saving(d, f, unit + 1, rates)
                     for d, f in zip(demand, fallback, strict=True))
        # Convex: no later unit saves more. A tie (a millionth of a dollar: sums of equal
        # prices round differently) reserves nothing more.
        if saving <= hours * rates.reserved + 1e-6:
            break
        unit += 1
    return unit


@dataclass(frozen=True)
class Advice:
    """The advised mix and what it costs. USD over the history's hours."""

    hours: int
    peak_gpus: float
    mean_gpus: float
    reserved_gpus: int
    cost_usd: float
    all_on_demand_usd: float
    saving_usd: float
    saving_fraction: float
    rates: Rates
    assumptions: tuple[str, ...]

    def summary(self) -> dict:
        """Every field, for JSON output."""
        return {**asdict(self), "assumptions": list(self.assumptions)}


def advise(demand: Sequence[float], fallback: Sequence[float], rates: Rates) -> Advice:
    """The purchase mix of least cost for an hour-by-hour demand history.

    Args:
        demand: GPUs in use per hour (GPU-seconds in the hour / 3600), oldest first.
        fallback: per hour, the part of ``demand`` that ran on on-demand after spot reclaims.
        rates: USD per GPU-hour by capacity type (:class:`Rates`).

    Returns:
        The :class:`Advice`, with the saving against buying every GPU-hour on demand.
    """
    reserved = best_reserved(demand, fallback, rates)
    cost = mix_cost(demand, fallback, reserved, rates)
    baseline = sum(demand) * rates.on_demand
    hours = len(demand)
    return Advice(
        hours=hours, peak_gpus=round(max(demand, default=0.0), 3),
        mean_gpus=round(sum(demand) / hours, 3) if hours else 0.0, reserved_gpus=reserved,
        cost_usd=round(cost, 2), all_on_demand_usd=round(baseline, 2),
        saving_usd=round(baseline - cost, 2),
        saving_fraction=round((baseline - cost) / baseline, 4) if baseline else 0.0,
        rates=rates, assumptions=(
            "reserved GPUs are paid every hour of the period, used or not, at the price "
            f"table's reserved rate (${rates.reserved:.2f}/GPU-hour)",
            f"demand above them runs on spot (${rates.spot:.2f}/GPU-hour) and never waits",
            "the on-demand hours a spot reclaim forced (a job's fallback after preemptions) "
            f"stay on on-demand (${rates.on_demand:.2f}/GPU-hour) unless reserved GPUs are "
            "free to cover them",
            "the future repeats the period's demand; one GPU type (the price table entry of "
            "the jobs' GPU model)",
            *(("the price table gives this device no price ($0/GPU-hour: the built-in `cpu` "
               "row), so every mix costs $0: pass the table your jobs were billed at "
               "(stoker cost --prices FILE)",) if not rates.on_demand else ()),
        ))
