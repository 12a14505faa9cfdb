"""The cost report in words: a table, CSV, JSON, markdown (the Prefect artifact) and a plot."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from stoker.tracking.pricing import PriceTable
from stoker.tracking.purchase_mix import Advice, Rates, advise
from stoker.tracking.spend import (
    COLUMNS,
    JobRow,
    as_dicts,
    attempt_windows,
    by_model,
    hourly_demand,
    job_rows,
    totals,
)


@dataclass(frozen=True)
class CostSummary:
    """The report of a period ``[since_s, until_s)`` (Unix seconds)."""

    since_s: float
    until_s: float
    rows: tuple[JobRow, ...]
    advice: Advice | None

    def to_json(self) -> dict:
        """Everything, for ``--format json``."""
        return {"since": _iso(self.since_s), "until": _iso(self.until_s),
                "jobs": as_dicts(self.rows), "by_model": by_model(self.rows),
                "totals": totals(self.rows), "guard_stops": self.guard_stops,
                "advice": self.advice.summary() if self.advice else None}

    @property
    def guard_stops(self) -> int:
        return sum(r.guard_stopped for r in self.rows)


def _iso(unix_s: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def collect(client, since_s: float, until_s: float, prices: PriceTable,
            gpu_model: str | None = None) -> CostSummary:
    """Read the period's jobs from the MLflow store and advise a purchase mix.

    Args:
        client: an ``MlflowClient`` of the store.
        since_s: start of the period, Unix seconds.
        until_s: its end (excluded), Unix seconds.
        prices: the price table the advice prices at.
        gpu_model: the GPU model whose rates the advice uses; None: the most used of the rows.

    Returns:
        The :class:`CostSummary` (advice None when no run logged its attempts' windows).
    """
    rows = tuple(job_rows(client, int(since_s * 1000), int(until_s * 1000)))
    windows = attempt_windows(client, rows)
    advice = None
    if windows:
        used: dict[str, float] = {}
        for r in rows:
            used[r.gpu_model] = used.get(r.gpu_model, 0.0) + r.gpu_hours
        model = gpu_model or max(used, key=used.get, default="default")
        table = {c: prices.price(model, c) for c in ("on_demand", "spot", "reserved")}
        demand, fallback = hourly_demand(windows, since_s, until_s)
        advice = advise(demand, fallback, Rates(**table))
    return CostSummary(since_s, until_s, rows, advice)


def render_csv(summary: CostSummary) -> str:
    """One CSV line per job, then a ``TOTAL`` line."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(as_dicts(summary.rows))
    writer.writerow({"job": "TOTAL", **totals(summary.rows)})
    return out.getvalue()


def render_json(summary: CostSummary) -> str:
    return json.dumps(summary.to_json(), indent=2)


_SHOWN = ("job", "model", "ended", "gpu_hours", "gpu_hours_on_demand", "gpu_hours_spot",
          "cost_usd", "goodput", "preemptions", "steps_lost", "steps_lost_cost_usd",
          "guard_stopped", "guard_saved_usd")


def render_markdown(summary: CostSummary) -> str:
    """The report as markdown: jobs, models, totals, and the advice with its assumptions."""
    lines = [f"# Cost {_iso(summary.since_s)} to {_iso(summary.until_s)}", "",
             "| " + " | ".join(_SHOWN) + " |", "|" + "---|" * len(_SHOWN)]
    for row in as_dicts(summary.rows):
        lines.append("| " + " | ".join(_cell(row[k]) for k in _SHOWN) + " |")
    total = totals(summary.rows)
    lines += ["", f"**Total**: ${total['cost_usd']:.2f} for {total['gpu_hours']:.3f} GPU-hours "
              f"({total['gpu_hours_on_demand']:.3f} on-demand, {total['gpu_hours_spot']:.3f} "
              f"spot, {total['gpu_hours_reserved']:.3f} reserved); {total['steps_lost']:g} "
              f"step(s) lost to preemption (${total['steps_lost_cost_usd']:.2f}); "
              f"{summary.guard_stops} job(s) stopped by the cost guard, saving up to "
              f"${total['guard_saved_usd']:.2f} (each stopped job's $/h from its stop to the "
              "end of the period).", "", "## By model", ""]
    for name, sums in by_model(summary.rows).items():
        lines.append(f"- {name or '(not registered)'}: ${sums['cost_usd']:.2f}, "
                     f"{sums['gpu_hours']:.3f} GPU-hours")
    lines += ["", "## Purchase mix", ""] + advice_lines(summary.advice)
    return "\n".join(lines) + "\n"


def render_table(summary: CostSummary) -> str:
    """The markdown report (it reads as a table in a terminal too)."""
    return render_markdown(summary)


def advice_lines(advice: Advice | None) -> list[str]:
    """The advice and its assumptions, one line each."""
    if advice is None:
        return ["no attempt windows in the period's runs: no advice"]
    return [f"Reserve {advice.reserved_gpus} GPU(s); above them spot, on-demand where spot "
            f"was reclaimed: ${advice.cost_usd:.2f} over {advice.hours} hour(s) against "
            f"${advice.all_on_demand_usd:.2f} all on-demand (saving ${advice.saving_usd:.2f}, "
            f"{advice.saving_fraction:.0%}); demand peak {advice.peak_gpus:g}, mean "
            f"{advice.mean_gpus:g} GPUs.", "", "Assumptions:", ""] + [
        f"- {a}" for a in advice.assumptions]


def _cell(value) -> str:
    if value is None:  # not logged: blank, not 0
        return ""
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".") or "0"
    return str(value).replace("|", "\\|")


def plot_spend(summary: CostSummary, out: Path) -> Path:
    """Cumulative spend over the period (USD against run end time) as a PNG at ``out``."""
    import datetime

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [datetime.datetime.fromisoformat(r.ended.replace("Z", "+00:00"))
             for r in summary.rows]
    spent, total = [], 0.0
    for row in summary.rows:
        total += row.cost_usd
        spent.append(total)
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    ax.step(times, spent, where="post", marker="o")
    ax.set_ylabel("cumulative spend (USD)")
    ax.set_xlabel("run end (UTC)")
    ax.set_title(f"spend {_iso(summary.since_s)} to {_iso(summary.until_s)}")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
