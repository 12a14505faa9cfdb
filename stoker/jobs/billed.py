"""What a job's closed attempts were billed, for ``stoker jobs`` and ``stoker status`` before the
job is done (a done job's cost is in its summary, ``pipeline_done.json``).

The ``train`` task records it in ``<job_dir>/billed.json`` each time it closes attempts (an
attempt ended, one a dead run left open, a stop): every closed attempt's billed
``duration_s`` at the price of its capacity type, times the devices the job held
(:func:`stoker.jobs.budget.job_spend`), priced with the run's own ``cost.prices``. A job
stopped by ``stoker stop``, Ctrl-C or its budget thus shows what it cost so far. An attempt a
dead run left open is billed once the next run closes it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from stoker.jobs.attempts import AttemptLog
from stoker.jobs.budget import job_spend, started_gpu_model
from stoker.jobs.store import write_through
from stoker.runtime import private
from stoker.runtime.records import read_json, real_number
from stoker.tracking.pricing import PriceTable

BILLED_FILE = "billed.json"


def record_billed(job_dir: Path, devices: int, prices: PriceTable) -> None:
    """Record the billed cost of the job's closed attempts in ``billed.json`` (atomic, 0600).
    Nothing is written before rank 0 named its device (its ``start`` event: the price is not
    known), when a record's capacity type has no price, or when the job folder cannot be
    written (the cost stays unknown, nothing else fails).

    Args:
        job_dir: the job folder.
        devices: GPUs (or CPU worker processes) per attempt.
        prices: USD per device-hour (the run's ``cost.prices``).
    """
    job_dir = Path(job_dir)
    gpu_model = started_gpu_model(job_dir)
    if gpu_model is None:
        return
    history = AttemptLog(job_dir).history()
    try:
        spend = job_spend(history, time.time(), devices, gpu_model, prices)
    except KeyError:  # a record's capacity type the price table does not price: unknown
        return
    record = {"cost_usd": spend.cost_usd, "billed_s": spend.billed_s, "attempts": len(history),
              "gpu_model": gpu_model, "devices": devices, "time": time.time()}
    path = job_dir / BILLED_FILE
    tmp = path.with_name(f"{BILLED_FILE}.tmp-{os.getpid()}")
    try:
        private.write_text(tmp, json.dumps(record))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return
    write_through(job_dir, BILLED_FILE)  # a job store's other nodes list it too


def billed_cost(job_dir: Path) -> float | None:
    """The USD :func:`record_billed` recorded; None without a record, or with a value that is
    not a finite number >= 0 (the file is read as data)."""
    record = read_json(Path(job_dir) / BILLED_FILE, default=None, warn=lambda *_: None)
    cost = real_number(record.get("cost_usd")) if isinstance(record, dict) else None
    return cost if cost is not None and cost >= 0 else None
