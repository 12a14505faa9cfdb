"""Purchase-mix advice (issue 48) against a brute-force minimum.

The synthetic demand history: four weeks (672 hours) of one team's GPUs. A base of 6 GPUs
around the clock; 10 more on weekdays 09:00-18:00; a 24-GPU burst on the afternoons of days 10
and 20; hours in half GPUs where jobs started or ended mid-hour (0.5 GPU = 1800 GPU-seconds);
and on days 10-12 a spot reclaim wave: 4 GPUs of each of those hours fell back to on-demand.
"""

from __future__ import annotations

import random

import pytest

from stoker.tracking.pricing import PriceTable
from stoker.tracking.purchase_mix import Rates, advise, best_reserved, hour_cost, mix_cost


def synthetic_history() -> tuple[list[float], list[float]]:
    """(demand, fallback) per hour over four weeks, as the module docstring describes."""
    demand, fallback = [], []
    for hour in range(28 * 24):
        day, clock = divmod(hour, 24)
        gpus = 6.0
        if day % 7 < 5 and 9 <= clock < 18:
            gpus += 10.0
        if day in (10, 20) and 13 <= clock < 17:
            gpus += 24.0
        if clock in (9, 18) and day % 7 < 5:
            gpus += 0.5  # a job starting or ending mid-hour
        demand.append(gpus)
        fallback.append(4.0 if 10 <= day <= 12 else 0.0)
    return demand, fallback


def brute_force(demand, fallback, rates) -> tuple[int, float]:
    """Every reserved count from 0 to the peak, priced hour by hour: the cheapest (the smallest
    count of those within a millionth of a dollar of the minimum: rounding of equal costs)."""
    costs = [mix_cost(demand, fallback, r, rates) for r in range(int(max(demand)) + 2)]
    reserved = next(r for r, c in enumerate(costs) if c <= min(costs) + 1e-6)
    return reserved, costs[reserved]


@pytest.mark.parametrize("gpu", ["H100", "H200", "A100", "L4", "default"])
def test_the_advice_is_the_brute_force_minimum_on_the_documented_history(gpu):
    prices = PriceTable().usd_per_gpu_hour[gpu]
    rates = Rates(prices["on_demand"], prices["spot"], prices["reserved"])
    demand, fallback = synthetic_history()
    advice = advise(demand, fallback, rates)
    reserved, cost = brute_force(demand, fallback, rates)
    assert advice.reserved_gpus == reserved
    assert advice.cost_usd == pytest.approx(cost, abs=0.01)
    assert advice.all_on_demand_usd == pytest.approx(sum(demand) * rates.on_demand, abs=0.01)
    assert advice.saving_usd == pytest.approx(advice.all_on_demand_usd - cost, abs=0.02)
    assert advice.saving_usd > 0 and len(advice.assumptions) >= 3


def test_reserving_pays_for_the_base_load_only_when_spot_is_dearer_than_reserved_hours():
    demand, fallback = synthetic_history()
    # The base of 6 GPUs runs every hour: reserved at 2.70 beats spot at 3.00, not at 1.70.
    assert best_reserved(demand, fallback, Rates(4.0, 3.0, 2.7)) >= 6
    assert best_reserved(demand, fallback, Rates(4.0, 1.7, 2.7)) < 6


def test_random_histories_match_brute_force():
    rng = random.Random(48)
    for _ in range(200):
        hours = rng.randint(0, 60)
        demand = [round(rng.uniform(0, 12) * rng.random(), 2) for _ in range(hours)]
        fallback = [round(d * rng.choice([0, 0, 0.3, 1.0]), 2) for d in demand]
        rates = Rates(on_demand=rng.uniform(1, 5), spot=rng.uniform(0, 1),
                      reserved=rng.uniform(0.2, 4))
        reserved, cost = brute_force(demand, fallback, rates) if hours else (0, 0.0)
        assert mix_cost(demand, fallback, best_reserved(demand, fallback, rates), rates) \
            == pytest.approx(cost, abs=1e-9)
        assert best_reserved(demand, fallback, rates) == reserved


def test_an_hour_puts_the_fallback_on_reserved_gpus_first():
    rates = Rates(on_demand=4.0, spot=1.0, reserved=2.0)
    # 5 GPUs, 2 forced to on-demand; 2 reserved cover those two, 3 go to spot.
    assert hour_cost(5, 2, 2, rates) == pytest.approx(2 * 2.0 + 3 * 1.0)
    assert hour_cost(5, 2, 0, rates) == pytest.approx(2 * 4.0 + 3 * 1.0)
    assert hour_cost(1, 0, 3, rates) == pytest.approx(3 * 2.0)  # idle reserved GPUs are paid


def test_an_unpriced_device_says_so_in_the_assumptions():
    """The built-in `cpu` row is $0: the advice says every mix costs $0 and how to price it
    (trial: "$0.00 vs $0.00" beside a job that cost $1.62, with no word why)."""
    demand, fallback = synthetic_history()
    unpriced = advise(demand, fallback, Rates(0.0, 0.0, 0.0))
    assert any("stoker cost --prices FILE" in line for line in unpriced.assumptions)
    priced = advise(demand, fallback, Rates(4.0, 1.7, 1.6))
    assert not any("--prices" in line for line in priced.assumptions)
