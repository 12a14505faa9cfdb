"""Statistics of the benchmarks: per-pair ratios, a bootstrap interval of their median, verdicts.

A benchmark runs its baseline and its candidate in pairs (run i of each, back to back, the order
alternating). Each pair gives one ratio; the figure reported is the median of those per-pair
ratios, with their min and max and a confidence interval of the median from
``scipy.stats.bootstrap``. The verdict comes from the interval, not from one run or the extremes:

* ``met``: the whole interval meets the target;
* ``missed``: none of it does;
* ``undecided``: the interval straddles the target (more pairs would be needed), or there are too
  few pairs for an interval (one pair, as in a ``--quick`` run).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95
N_RESAMPLES = 9999
MET, MISSED, UNDECIDED = "met", "missed", "undecided"


def rounded(value: float | None) -> float | None:
    """``value`` to 6 significant digits (None and non-finite values pass through)."""
    if value is None or not math.isfinite(value):
        return value
    return float(f"{value:.6g}")


@dataclass(frozen=True)
class Target:
    """A target on a figure: ``op`` is ``<=`` or ``>=``; ``value`` in the figure's unit."""

    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"Target.op must be '<=' or '>=', got {self.op!r}")

    def met(self, figure: float) -> bool:
        return figure <= self.value if self.op == "<=" else figure >= self.value

    def verdict(self, interval: Sequence[float] | None) -> str:
        """``met`` / ``missed`` when both ends of ``interval`` agree, else ``undecided``."""
        if interval is None or not all(math.isfinite(v) for v in interval):
            return UNDECIDED
        low, high = self.met(interval[0]), self.met(interval[1])
        if low and high:
            return MET
        return MISSED if not (low or high) else UNDECIDED

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


def median_interval(values: Sequence[float],
                    confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A ``confidence`` interval of the median of ``values`` (percentile bootstrap, seeded).

    Percentile rather than BCa: with a handful of pairs and a median, BCa's jackknife is often
    degenerate (NaN). The resampling is seeded, so the same values give the same interval.

    Returns:
        (low, high) in the values' unit; None with fewer than 2 values (no interval exists).
    """
    import numpy as np
    from scipy import stats

    data = np.asarray(values, dtype=float)
    if data.size < 2:
        return None
    if np.all(data == data[0]):  # no spread: the bootstrap would warn and return NaN
        return float(data[0]), float(data[0])
    kwargs = {"confidence_level": confidence, "n_resamples": N_RESAMPLES,
              "method": "percentile"}
    try:
        result = stats.bootstrap((data,), np.median, rng=np.random.default_rng(0), **kwargs)
    except TypeError:  # scipy < 1.15 names the seed random_state
        result = stats.bootstrap((data,), np.median, random_state=np.random.default_rng(0),
                                 **kwargs)
    ci = result.confidence_interval
    return float(ci.low), float(ci.high)


def summary(values: Sequence[float], unit: str, name: str | None = None) -> dict[str, Any]:
    """Median, min, max, n, the interval of the median and every value (6 digits)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"{name or unit}: no values to summarise")
    ci = median_interval(values)
    out: dict[str, Any] = {"name": name} if name else {}
    return out | {"unit": unit, "median": rounded(statistics.median(values)),
                  "min": rounded(min(values)), "max": rounded(max(values)), "n": len(values),
                  "ci": None if ci is None else [rounded(v) for v in ci],
                  "confidence": CONFIDENCE, "values": [rounded(v) for v in values]}


def per_pair(baseline: Sequence[float], candidate: Sequence[float],
             ratio_of: Callable[[float, float], float]) -> list[float]:
    """``ratio_of(baseline[i], candidate[i])`` for every pair i.

    Raises:
        ValueError: the two sides have different lengths (pairs would be mixed).
    """
    if len(baseline) != len(candidate):
        raise ValueError(f"per-pair ratios need as many baseline runs as candidate runs, got "
                         f"{len(baseline)} and {len(candidate)}")
    return [ratio_of(b, c) for b, c in zip(baseline, candidate, strict=True)]


def ratio_summary(baseline: Sequence[float], candidate: Sequence[float],
                  ratio_of: Callable[[float, float], float],
                  target: Target | str | None = None) -> dict[str, Any]:
    """The per-pair ratios' summary (``summary``) and, with a Target, its ``verdict``."""
    out = summary(per_pair(baseline, candidate, ratio_of), "ratio")
    if isinstance(target, Target):
        out["verdict"] = target.verdict(out["ci"])
    return out


def check(name: str, values: Sequence[float], unit: str, target: Target,
          statistic: str = "median") -> dict[str, Any]:
    """One absolute figure against its target (for benchmarks with more than the ratio).

    With ``statistic="median"`` the figure is the median of ``values`` and the verdict comes
    from its interval. With ``"max"`` the figure is the worst value and is decided by itself
    (a bound that every run must keep, such as steps lost).
    """
    s = summary(values, unit, name)
    if statistic == "max":
        value, verdict = s["max"], MET if target.met(s["max"]) else MISSED
    elif statistic == "median":
        value, verdict = s["median"], target.verdict(s["ci"])
    else:
        raise ValueError(f"check statistic must be 'median' or 'max', got {statistic!r}")
    return s | {"statistic": statistic, "value": value, "target": str(target),
                "verdict": verdict}


def overall(verdicts: Sequence[str]) -> str | None:
    """One verdict for several: missed if any is, else undecided if any is, else met; None for
    none at all."""
    if not verdicts:
        return None
    if MISSED in verdicts:
        return MISSED
    return UNDECIDED if UNDECIDED in verdicts else MET
