"""Where the money went: the cost report across jobs, read from the MLflow store.

A job's MLflow run gets its cost when its training completes (the ``train`` task):
``cost_usd``, ``gpu_hours``, ``goodput``, ``steps_lost``, ``preemptions`` (as ever), and, per
capacity type, ``gpu_hours_<type>`` and ``cost_usd_<type>`` with its attempts' time windows
as the artifact ``stoker/attempts.json`` (:func:`log_cost_records`). :func:`job_rows` reads them
back for a period: a run counts in the period its end falls in. The cost of steps lost is the
job's cost per trained step times the steps lost (steps trained = final step + steps lost).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from stoker.tracking.cost import CostReport, cost_report, steps_lost
from stoker.tracking.pricing import PriceTable

CAPACITY_TYPES = ("on_demand", "spot", "reserved")
ATTEMPTS_ARTIFACT = "stoker/attempts.json"


def capacity_metrics(history: list[dict], devices: int, gpu_model: str,
                     prices: PriceTable) -> dict[str, float]:
    """GPU-hours and USD per capacity type of a job's closed attempts.

    Args:
        history: closed attempt records (``duration_s`` in seconds, ``capacity_type``).
        devices: GPUs (or CPU worker processes) held per attempt.
        gpu_model: NVML name or ``cpu``, for ``prices``.
        prices: the job's price table.

    Returns:
        ``{"gpu_hours_<type>": h, "cost_usd_<type>": usd}`` for each of :data:`CAPACITY_TYPES`.
    """
    out: dict[str, float] = {}
    for capacity in CAPACITY_TYPES:
        seconds = sum(a["duration_s"] for a in history if a.get("capacity_type") == capacity)
        out[f"gpu_hours_{capacity}"] = round(devices * seconds / 3600, 6)
        out[f"cost_usd_{capacity}"] = round(
            devices * seconds / 3600 * prices.price(gpu_model, capacity), 6)
    return out


def log_cost_records(client, run_id: str, history: list[dict], devices: int, gpu_model: str,
                     prices: PriceTable, step: int) -> None:
    """Log :func:`capacity_metrics` at ``step`` and the attempts' windows (``started`` Unix
    seconds, ``duration_s``, ``capacity_type``, ``outcome``, ``devices``) as
    :data:`ATTEMPTS_ARTIFACT` on the job's MLflow run, for ``stoker cost``."""
    import time

    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    metrics = capacity_metrics(history, devices, gpu_model, prices)
    client.log_batch(run_id, metrics=[Metric(k, v, now_ms, step) for k, v in metrics.items()])
    windows = [{"started": a.get("started"), "duration_s": a.get("duration_s"),
                "capacity_type": a.get("capacity_type"), "outcome": a.get("outcome"),
                "devices": devices} for a in history]
    client.log_dict(run_id, {"gpu_model": gpu_model, "attempts": windows}, ATTEMPTS_ARTIFACT)


def log_completed_cost(client, result: dict, history: list[dict], events: list[dict],
                       devices: int, prices: PriceTable) -> CostReport:
    """Price a completed job on its MLflow run (``result``: the job's ``result.json``, with
    ``run_id``, ``step``, ``train_time_s`` and ``gpu_model``): the cost metrics at the last
    step, the ``stoker.capacity_types``, ``stoker.attempts`` and ``stoker.preemptions`` tags
    and :func:`log_cost_records`. Returns the report (:func:`stoker.tracking.cost.cost_report`
    over ``history``, every attempt, and ``events``, the job's progress events)."""
    import time

    from mlflow.entities import Metric, RunTag

    report = cost_report(history, events, result["train_time_s"], devices, result["gpu_model"],
                         prices)
    now_ms = int(time.time() * 1000)
    client.log_batch(
        result["run_id"],
        metrics=[Metric(k, v, now_ms, result["step"]) for k, v in report.metrics().items()],
        tags=[RunTag("stoker.capacity_types", ",".join(report.capacity_types)),
              RunTag("stoker.attempts", str(report.attempts)),
              RunTag("stoker.preemptions", str(report.preemptions))])
    log_cost_records(client, result["run_id"], history, devices, result["gpu_model"], prices,
                     result["step"])  # for `stoker cost`
    return report


def log_stopped_cost(client, run_id: str | None, history: list[dict], devices: int,
                     gpu_model: str | None, prices: PriceTable, usd_per_hour: float,
                     events: list[dict] | None = None) -> None:
    """Log the cost so far of a job a stop request ended (its budget, the cost guard, a user):
    ``cost_usd``, ``gpu_hours``, ``attempts``, ``preemptions``, ``steps_lost``
    (:func:`stoker.tracking.cost.steps_lost` over the closed attempts), ``usd_per_hour``
    (devices x price: what the stop released per hour) and :func:`log_cost_records`, so that
    ``stoker cost`` counts it. A later completion logs the job's full cost over them. Never
    raises: tracking must not mask the stop.

    Args:
        gpu_model: NVML name or ``cpu``; None (rank 0 never tagged it): nothing is logged.
        usd_per_hour: USD per hour the job's devices cost when it stopped.
        events: the job's progress events, which settle each attempt's steps lost against
            the step the next one resumed at (None: the records' own figures).
    """
    if not run_id or gpu_model is None:
        return
    import time

    from mlflow.entities import Metric

    try:
        step = max((x.step for x in client.get_metric_history(run_id, "train_loss")), default=0)
        cost = sum(a["duration_s"] / 3600 * devices * prices.price(gpu_model, a["capacity_type"])
                   for a in history)
        billed = sum(a["duration_s"] for a in history)
        now_ms = int(time.time() * 1000)
        values = {"cost_usd": round(cost, 6), "gpu_hours": round(devices * billed / 3600, 6),
                  "attempts": len(history), "usd_per_hour": usd_per_hour,
                  "preemptions": sum(a.get("outcome") == "preempted" for a in history),
                  "steps_lost": steps_lost(history, events or [])}
        client.log_batch(run_id, metrics=[Metric(k, float(v), now_ms, step)
                                          for k, v in values.items()])
        log_cost_records(client, run_id, history, devices, gpu_model, prices, step)
    except Exception:  # noqa: BLE001 - the report lacks this job; the stop stands
        return


@dataclass(frozen=True)
class JobRow:
    """One job's cost in the report. Hours are GPU-hours, money USD, times ISO 8601 UTC."""

    job: str
    run_id: str
    model: str
    ended: str
    gpu_model: str
    gpu_hours: float
    gpu_hours_on_demand: float
    gpu_hours_spot: float
    gpu_hours_reserved: float
    cost_usd: float
    goodput: float | None  # None: not logged (a stopped job logs its cost, not goodput)
    preemptions: int
    steps_lost: int
    steps_lost_cost_usd: float
    guard_stopped: bool
    guard_saved_usd_per_hour: float
    guard_saved_usd: float = 0.0


COLUMNS = tuple(f.name for f in fields(JobRow))
TOTALLED = ("gpu_hours", "gpu_hours_on_demand", "gpu_hours_spot", "gpu_hours_reserved",
            "cost_usd", "preemptions", "steps_lost", "steps_lost_cost_usd",
            "guard_saved_usd_per_hour", "guard_saved_usd")


def _iso(ms: int | None) -> str:
    import datetime

    if not ms:
        return ""
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _row(client, run, models: dict[str, str], held_until_ms: int) -> JobRow:
    """A :class:`JobRow` from an MLflow run (``models``: run id -> registered model name).

    A guard stop saved ``usd_per_hour`` for every hour from the stop (the run's end) to
    ``held_until_ms``: the end of the period, or now if earlier. That is what the GPUs would
    have cost had they stayed held through the period; an upper bound, since someone might
    have noticed the idle job sooner."""
    m, tags = run.data.metrics, run.data.tags
    history = client.get_metric_history(run.info.run_id, "cost_usd")
    final_step = max((x.step for x in history), default=0)
    lost, cost = int(m.get("steps_lost", 0)), float(m.get("cost_usd", 0.0))
    hours = {c: float(m.get(f"gpu_hours_{c}", 0.0)) for c in CAPACITY_TYPES}
    types = [t for t in tags.get("stoker.capacity_types", "").split(",") if t]
    if not any(hours.values()) and len(types) == 1 and types[0] in hours:
        hours[types[0]] = float(m.get("gpu_hours", 0.0))  # a run logged before the split
    return JobRow(
        job=tags.get("stoker.job", ""), run_id=run.info.run_id,
        model=models.get(run.info.run_id, ""), ended=_iso(run.info.end_time),
        gpu_model=tags.get("stoker.gpu_model", ""), gpu_hours=float(m.get("gpu_hours", 0.0)),
        gpu_hours_on_demand=hours["on_demand"], gpu_hours_spot=hours["spot"],
        gpu_hours_reserved=hours["reserved"], cost_usd=cost,
        goodput=float(m["goodput"]) if "goodput" in m else None,
        preemptions=int(m.get("preemptions", 0)),
        steps_lost=lost, steps_lost_cost_usd=round(
            cost * lost / (final_step + lost), 6) if final_step + lost else 0.0,
        # The last attempt's stop (a run resumed after a guard stop and completed is not one;
        # runs tagged before the tag was cleared on a later attempt keep it: the outcome says)
        guard_stopped=(guard := tags.get("stoker.stopped_by", "").startswith("cost-guard")
                       and tags.get("stoker.last_outcome") == "stopped"),
        guard_saved_usd_per_hour=(per_hour := float(m.get("usd_per_hour", 0.0)) if guard
                                  else 0.0),
        guard_saved_usd=round(per_hour * max(0, held_until_ms - (run.info.end_time or 0))
                              / 3_600_000, 6) if guard and run.info.end_time else 0.0)


def job_rows(client, since_ms: int, until_ms: int, now_ms: int | None = None) -> list[JobRow]:
    """Every Stoker job run (tag ``stoker.job``) that ended in ``[since_ms, until_ms)``.

    Args:
        client: an ``MlflowClient`` of the store.
        since_ms: start of the period, Unix milliseconds.
        until_ms: end of the period (excluded), Unix milliseconds.
        now_ms: the time now (Unix milliseconds; None: the clock's), which caps the hours a
            guard stop saved.

    Returns:
        One row per run, oldest end first.
    """
    from mlflow.entities import ViewType

    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs = []
    for start in range(0, len(experiments), 100):
        page_token = None
        while True:
            page = client.search_runs(
                experiments[start:start + 100],
                filter_string=f"attributes.end_time >= {since_ms} and "
                              f"attributes.end_time < {until_ms}",
                run_view_type=ViewType.ALL, max_results=1000, page_token=page_token)
            runs += [r for r in page if "stoker.job" in r.data.tags]
            page_token = page.token
            if not page_token:
                break
    models = {v.run_id: v.name for v in client.search_model_versions()}
    import time

    held_until = min(until_ms, int(time.time() * 1000) if now_ms is None else now_ms)
    rows = [_row(client, run, models, held_until) for run in runs]
    return sorted(rows, key=lambda r: (r.ended, r.job))


def totals(rows: Iterable[JobRow]) -> dict[str, float]:
    """The sum of each of :data:`TOTALLED` over ``rows`` (USD rounded to the cent's 1/10000)."""
    rows = list(rows)
    return {k: round(sum(getattr(r, k) for r in rows), 6) for k in TOTALLED}


def by_model(rows: Iterable[JobRow]) -> dict[str, dict[str, float]]:
    """:func:`totals` per registered model name (``""``: runs with no registered version)."""
    groups: dict[str, list[JobRow]] = {}
    for row in rows:
        groups.setdefault(row.model, []).append(row)
    return {name: totals(group) for name, group in sorted(groups.items())}


def attempt_windows(client, rows: Iterable[JobRow]) -> list[dict]:
    """The attempts of ``rows``' runs as logged (:data:`ATTEMPTS_ARTIFACT`), each with its job
    and ``fallback`` (on-demand after a spot preemption of the same job); runs without the
    artifact (logged before it) give none."""
    windows = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            try:
                path = client.download_artifacts(row.run_id, ATTEMPTS_ARTIFACT, tmp)
                attempts = json.loads(Path(path).read_text()).get("attempts", [])
            except Exception:  # noqa: BLE001 - no artifact: an older run
                continue
            reclaimed = False
            for a in attempts:
                windows.append({**a, "job": row.job, "fallback": reclaimed
                                and a.get("capacity_type") == "on_demand"})
                reclaimed |= a.get("capacity_type") == "spot" and a.get("outcome") == "preempted"
    return windows


def hourly_demand(windows: list[dict], since_s: float, until_s: float
                  ) -> tuple[list[float], list[float]]:
    """GPUs in use per hour from ``since_s`` to ``until_s`` (Unix seconds), and the part of it
    that ran on on-demand after a spot reclaim: GPU-seconds in each hour / 3600."""
    hours = max(0, int((until_s - since_s + 3599) // 3600))
    demand, fallback = [0.0] * hours, [0.0] * hours
    for w in windows:
        start, length = w.get("started"), w.get("duration_s")
        if not isinstance(start, int | float) or not isinstance(length, int | float):
            continue
        for h in range(hours):
            lo = since_s + 3600 * h
            overlap = max(0.0, min(start + length, lo + 3600) - max(start, lo))
            gpus = overlap / 3600 * int(w.get("devices") or 1)
            demand[h] += gpus
            if w.get("fallback"):
                fallback[h] += gpus
    return demand, fallback


def as_dicts(rows: Iterable[JobRow]) -> list[dict]:
    """The rows as dicts, for JSON and CSV."""
    return [asdict(r) for r in rows]
