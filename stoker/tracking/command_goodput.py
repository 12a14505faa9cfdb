"""Goodput as the user waits for it: useful step time over the wall time of the whole command.

The job's ``goodput`` (stoker.tracking.cost) bills the training attempts only; the user of
``stoker run`` also waits for the imports, the local Prefect server, the data pull, the image,
evaluation and registration. ``command_goodput`` divides the useful step time this command
committed by the wall time from the command's process start (its imports included) to the moment
it reports. A resumed job's earlier commands trained the steps its checkpoint holds: their step
time is not this command's (each attempt's ``start`` progress event says how much there was).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)


def command_started_at() -> float:
    """The Unix time (s) this process started: the moment the user's command began.

    On Linux from the process's start in clock ticks since boot and the uptime now (10 ms);
    psutil's ``create_time`` adds a boot time rounded to the second, so it can be a second off.
    """
    try:
        with open("/proc/self/stat") as stat:  # field 22 (after the parenthesised name)
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            uptime_s = float(uptime.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return psutil.Process().create_time()


def command_goodput(useful_train_s: float, started_at: float, ended_at: float) -> float:
    """Useful step time over the command's wall time.

    Args:
        useful_train_s: seconds in training steps this command committed
            (:func:`command_useful_train_s`).
        started_at: Unix time (s) the command started.
        ended_at: Unix time (s) it ended (or reports).

    Returns:
        A share in 0..1 (0 for no wall time).

    Raises:
        ValueError: ``useful_train_s`` is negative or ``ended_at`` is before ``started_at``.
    """
    if useful_train_s < 0 or ended_at < started_at:
        raise ValueError(f"command_goodput needs useful_train_s >= 0 and ended_at >= "
                         f"started_at, got {useful_train_s}, {started_at}, {ended_at}")
    wall_s = ended_at - started_at
    return round(min(1.0, useful_train_s / wall_s), 4) if wall_s > 0 else 0.0


def command_useful_train_s(events: list[dict], job_train_s: float,
                           started_at: float) -> float | None:
    """Seconds in training steps committed by the attempts a command started.

    Args:
        events: the job's progress events (:func:`stoker.runtime.progress.read_events`).
        job_train_s: the job's ``useful_train_s`` at its end (every attempt's, all commands).
        started_at: Unix time (s) the command started.

    Returns:
        ``job_train_s`` less the step time the job had committed when this command's first
        attempt started (its ``start`` event's ``train_time_s``; 0 for a fresh job), at least
        0; None when no attempt started during the command (it found the job done) or that
        attempt's runtime did not say (an older image that resumed).
    """
    starts = [e for e in events if e.get("event") == "start"
              and isinstance(e.get("time"), int | float) and e["time"] >= started_at]
    if not starts:
        return None
    before = starts[0].get("train_time_s")
    if not isinstance(before, int | float):
        if starts[0].get("resumed"):
            return None
        before = 0.0
    return round(max(0.0, job_train_s - float(before)), 3)


def record_command_goodput(summary: dict[str, Any], tracking_uri: str) -> dict[str, Any]:
    """Add ``command_goodput``, ``command_wall_s`` and ``command_useful_train_s`` to the
    summary's ``cost`` and log them to its MLflow run, beside the job's ``goodput``.

    Args:
        summary: the pipeline's summary (``run_id``, ``job_dir`` and ``cost.useful_train_s``).
        tracking_uri: the MLflow store of the run.

    Returns:
        The summary, its ``cost`` with the three figures; unchanged without a run, a job
        folder or a cost, and when this command trained nothing (it found the job done) or
        its attempt's runtime did not report the step time it resumed from (logged).
    """
    cost = summary.get("cost")
    if not summary.get("run_id") or not summary.get("job_dir") or not isinstance(cost, dict) \
            or "useful_train_s" not in cost:
        return summary
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from stoker.runtime.progress import read_events

    started_at, now = command_started_at(), time.time()
    events = read_events(Path(summary["job_dir"]))
    useful_s = command_useful_train_s(events, float(cost["useful_train_s"]), started_at)
    if useful_s is None:
        log.info("command_goodput not logged: no attempt of this command reported the step "
                 "time it resumed from")
        return summary
    figures = {"command_goodput": command_goodput(useful_s, started_at, now),
               "command_wall_s": round(now - started_at, 3),
               "command_useful_train_s": useful_s}
    # At the job's last step, beside its goodput and the other cost metrics.
    step = max((e["step"] for e in events if isinstance(e.get("step"), int)), default=0)
    stamp = int(now * 1000)
    MlflowClient(tracking_uri).log_batch(summary["run_id"], metrics=[
        Metric(name, value, stamp, step) for name, value in figures.items()])
    return summary | {"cost": cost | figures}
