"""A job's own budget: ``train.max_cost_usd`` and ``train.max_duration``, job-wide.

Spend counts every attempt of the job in ``attempts.jsonl``, whichever flow run made it: a
closed one for its billed ``duration_s``, the open one from its start to now, each at the price
of its capacity type (``cost.prices``) times the devices held. While an attempt trains, a
:class:`BudgetWatcher` in the flow checks every progress interval; once the spend one interval
from now would reach a limit, it stops the job as ``stoker stop`` does (a stop request by
``budget``: the ranks commit a checkpoint, the attempt ends ``StoppedByBudget``, ``stoker run``
exits 5). ``<job_dir>/spend.json`` keeps the last reading (spend, limits, GPU model, devices)
for ``stoker status`` and for the check before a run launches (:func:`check_at_start`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from stoker.jobs.attempts import AttemptLog, is_closed
from stoker.jobs.stop_request import TrainingStopped
from stoker.runtime import private
from stoker.runtime.progress import read_events
from stoker.runtime.records import read_json, real_number
from stoker.tracking.pricing import PriceTable

BUDGET_BY = "budget"  # who asks, in the stop request: the attempt's state is StoppedByBudget
SPEND_FILE = "spend.json"


@dataclass(frozen=True)
class Spend:
    """What a job spent so far: USD, billed seconds, and the USD per second it burns now."""

    cost_usd: float
    billed_s: float
    usd_per_s: float


def job_spend(records: list[dict], now_s: float, devices: int, gpu_model: str | None,
              prices: PriceTable) -> Spend:
    """The job's spend over its attempt records (:meth:`AttemptLog.records`).

    Args:
        records: every attempt, closed (``duration_s``) or open (``started``, Unix seconds).
        now_s: now, Unix seconds (an open attempt is billed up to it).
        devices: GPUs (or CPU worker processes) per attempt.
        gpu_model: NVML name or ``cpu``; None: not known yet (cost 0: only time counts).
        prices: USD per GPU-hour.

    Returns:
        The :class:`Spend`.
    """
    cost = billed = rate = 0.0
    for record in records:
        capacity = record.get("capacity_type", "on_demand")
        usd_per_s = 0.0 if gpu_model is None else devices * prices.price(gpu_model, capacity) / 3600
        if is_closed(record):
            seconds = real_number(record.get("duration_s")) or 0.0
        else:
            seconds = max(0.0, now_s - (real_number(record.get("started")) or now_s))
            rate += usd_per_s
        billed += seconds
        cost += seconds * usd_per_s
    return Spend(round(cost, 6), round(billed, 3), rate)


def over_budget(spend: Spend, max_cost_usd: float | None, max_duration_s: float | None,
                lookahead_s: float = 0.0) -> str | None:
    """Why the job must stop now (one line), or None.

    Args:
        spend: the job's :class:`Spend`.
        max_cost_usd: the cost limit (None: none).
        max_duration_s: the billed-time limit, seconds (None: none).
        lookahead_s: a limit the spend reaches within this many seconds counts as reached
            (one progress interval: the next check would be too late).
    """
    if max_cost_usd is not None and spend.cost_usd + spend.usd_per_s * lookahead_s \
            >= max_cost_usd:
        return (f"max_cost_usd ${max_cost_usd:g} reached: spent ${spend.cost_usd:.4f} over "
                f"{spend.billed_s:.0f} s billed")
    if max_duration_s is not None and spend.billed_s + lookahead_s >= max_duration_s:
        return (f"max_duration {max_duration_s:g} s reached: {spend.billed_s:.0f} s billed, "
                f"${spend.cost_usd:.4f} spent")
    return None


def describe(spend: Spend, max_cost_usd: float | None, max_duration_s: float | None,
             priced: bool = True) -> str:
    """Spend against budget in words: ``spent $0.4200 of $1 (42 %); billed 310 s of 3600 s``;
    ``priced=False`` (the GPU model not known yet): ``spent: not priced yet (...)``."""
    if not priced and max_cost_usd:
        parts = [f"spent: not priced yet of ${max_cost_usd:g} (the ranks have not said their "
                 "device yet; the billed time so far is priced once they do)"]
    else:
        parts = [f"spent ${spend.cost_usd:.4f}" + (
            f" of ${max_cost_usd:g} ({spend.cost_usd / max_cost_usd:.0%})"
            if max_cost_usd else "")]
    parts.append(f"billed {spend.billed_s:.0f} s" + (
        f" of {max_duration_s:g} s ({spend.billed_s / max_duration_s:.0%})"
        if max_duration_s else ""))
    return "; ".join(parts)


def write_spend(job_dir: Path, spend: Spend, gpu_model: str | None, devices: int,
                max_cost_usd: float | None, max_duration_s: float | None) -> None:
    """Record the last reading in ``<job_dir>/spend.json`` (atomic)."""
    path = Path(job_dir) / SPEND_FILE
    tmp = path.with_name(f"{SPEND_FILE}.tmp-{os.getpid()}")
    private.write_text(tmp, json.dumps({**asdict(spend), "gpu_model": gpu_model,
                                        "devices": devices, "max_cost_usd": max_cost_usd,
                                        "max_duration_s": max_duration_s, "time": time.time()}))
    tmp.replace(path)


def read_spend(job_dir: Path) -> dict | None:
    """The last reading :func:`write_spend` recorded, or None."""
    data = read_json(Path(job_dir) / SPEND_FILE, default=None, warn=lambda *_: None)
    return data if isinstance(data, dict) else None


def budget_line(job_dir: Path) -> str | None:
    """Spend against budget as the job's last reading says (``stoker status``), with its age;
    None when the job has no budget reading."""
    last = read_spend(job_dir)
    if last is None:
        return None
    spend = Spend(real_number(last.get("cost_usd")) or 0.0,
                  real_number(last.get("billed_s")) or 0.0, 0.0)
    at = real_number(last.get("time"))
    when = f" (read {time.time() - at:.0f} s ago)" if at is not None else ""
    return describe(spend, real_number(last.get("max_cost_usd")),
                    real_number(last.get("max_duration_s"))) + when


def budget_stop(message: str) -> TrainingStopped:
    """The error of a job its budget stopped (``by`` = :data:`BUDGET_BY`: exit 5)."""
    error = TrainingStopped(message)
    error.by = BUDGET_BY
    return error


def check_at_start(job_dir: Path, max_cost_usd: float | None, max_duration_s: float | None,
                   prices: PriceTable) -> None:
    """Refuse to launch a job whose budget is spent already (its closed attempts, at the GPU
    model and devices of its last reading).

    Raises:
        TrainingStopped: one line naming the limit and how to resume (``by`` = budget).
    """
    if max_cost_usd is None and max_duration_s is None:
        return
    last = read_spend(job_dir) or {}
    devices = last.get("devices") if isinstance(last.get("devices"), int) else 1
    model = last.get("gpu_model") if isinstance(last.get("gpu_model"), str) else None
    records = [r for r in AttemptLog(job_dir).records() if is_closed(r)]
    spend = job_spend(records, time.time(), devices, model, prices)
    if (why := over_budget(spend, max_cost_usd, max_duration_s)) is not None:
        raise budget_stop(f"job {Path(job_dir).name}: {why}; nothing launched: raise "
                          "train.max_cost_usd / train.max_duration and run the same command "
                          "to resume it")


class BudgetWatcher(threading.Thread):
    """Checks the job's spend every ``every_s`` seconds while an attempt trains and stops the
    job once a limit is one interval away; ``say`` gets the spend line each time it changes.

    ``stop`` is :func:`stoker.jobs.stop.stop_job` (passed in: the stop path reads job status,
    which reads budgets, so this module does not import it back); it raises
    :class:`stoker.jobs.stop.StopFailed` (or any error) when the job did not stop in time."""

    def __init__(self, job_dir: Path, max_cost_usd: float | None,
                 max_duration_s: float | None, prices: PriceTable, devices: int,
                 gpu_model: Callable[[], str | None], say: Callable[[str], None],
                 stop: Callable[..., object], every_s: float = 5.0,
                 warn: Callable[[str], None] | None = None):
        super().__init__(daemon=True, name="budget-watcher")
        self.job_dir, self.prices, self.devices = Path(job_dir), prices, devices
        self.max_cost_usd, self.max_duration_s = max_cost_usd, max_duration_s
        self.gpu_model, self.say, self.every_s = gpu_model, say, every_s
        self.stop_job = stop
        self.warn = warn or say  # a check that failed: the budget is not being enforced
        self.stopped = threading.Event()
        self.fired: str | None = None
        self._model: str | None = (read_spend(job_dir) or {}).get("gpu_model")

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - a failed check must not end the job
                self.warn(f"budget check failed: {e}")

    def gpu_model_known(self) -> str | None:
        """The GPU model this watcher read (or the job's last reading had); None if neither."""
        return self._model

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)

    def check(self) -> None:
        """One reading: record it, say it, and stop the job if a limit is near."""
        records = AttemptLog(self.job_dir).records()
        if self.fired or not any(not is_closed(r) for r in records):
            return
        # Known once rank 0 starts training (its start event), or from its MLflow run (a
        # slow tracking store took 20-28 s to open it: the spend read $0 until then, and the
        # job overshot its budget twice over in a new-user trial).
        self._model = self._model or started_gpu_model(self.job_dir) or self.gpu_model()
        spend = job_spend(records, time.time(), self.devices, self._model, self.prices)
        write_spend(self.job_dir, spend, self._model, self.devices, self.max_cost_usd,
                    self.max_duration_s)
        said = describe(spend, self.max_cost_usd, self.max_duration_s,
                        priced=self._model is not None)
        self.say(f"budget: {said}")
        why = over_budget(spend, self.max_cost_usd, self.max_duration_s, self.every_s)
        if why is None:
            return
        self.fired = why
        self.say(f"budget: {why}: stopping the job at a committed checkpoint")
        try:
            # Not waiting for the job to stop: this flow's lease makes it look trained until
            # the flow ends, so stop() would wait out its join timeout (10 s) on every stop.
            self.stop_job(self.job_dir, why, timeout_s=max(60.0, 4 * self.every_s),
                          by=BUDGET_BY, wait=False)
        except Exception as e:  # noqa: BLE001 - StopFailed: said, the attempt ends as it may
            self.say(f"budget: {e}")


def started_gpu_model(job_dir: Path) -> str | None:
    """The device rank 0 named in its last ``start`` event (``progress.jsonl``: an NVML/CUDA
    name or ``cpu``), None before one; a value that is not a short printable string is
    ignored (the file is the ranks', read as data)."""
    starts = [e for e in read_events(job_dir) if e.get("event") == "start"]
    model = starts[-1].get("gpu_model") if starts else None
    if isinstance(model, str) and 0 < len(model) <= 100 and model.isprintable():
        return model
    return None


def run_gpu_model(client, run_file: Path) -> str | None:
    """The GPU model rank 0 tagged on the job's MLflow run (``stoker.gpu_model``: an NVML name
    or ``cpu``); None before the run is open or when the store does not answer."""
    try:
        run_id = Path(run_file).read_text().strip()
        return client.get_run(run_id).data.tags.get("stoker.gpu_model") if run_id else None
    except Exception:  # noqa: BLE001 - not known yet: asked again at the next check
        return None


def usd_per_hour(config, devices: int, gpu_model: str | None,
                 capacities: dict[int, str]) -> float:
    """USD per hour the job's ``devices`` cost on its last attempt's capacity type
    (``capacities``: attempt number -> type; the config's when empty); 0 for an unknown model."""
    if gpu_model is None:
        return 0.0
    capacity = capacities[max(capacities)] if capacities else config.cost.capacity_type
    return devices * config.cost.prices.price(gpu_model, capacity)
