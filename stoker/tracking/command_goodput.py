"""Goodput as the user waits for it: useful step time over the wall time of the whole command.

The job's ``goodput`` (stoker.tracking.cost) bills the training attempts only; the user of
``stoker run`` also waits for the imports, the local Prefect server, the data pull, the image,
evaluation and registration. ``command_goodput`` divides the same useful step time by the wall
time from the command's process start (its imports included) to the moment it reports.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil

COMMAND_METRICS = ("command_goodput", "command_wall_s")


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
        useful_train_s: seconds in committed training steps (the job's ``useful_train_s``).
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


def record_command_goodput(summary: dict[str, Any], tracking_uri: str) -> dict[str, Any]:
    """Add ``command_goodput`` and ``command_wall_s`` to the summary's ``cost`` and log them to
    its MLflow run, beside the job's ``goodput``.

    Args:
        summary: the pipeline's summary (``run_id`` and ``cost.useful_train_s``).
        tracking_uri: the MLflow store of the run.

    Returns:
        The summary, its ``cost`` with the two figures (unchanged without a run or a cost).
    """
    cost = summary.get("cost")
    if not summary.get("run_id") or not isinstance(cost, dict) or "useful_train_s" not in cost:
        return summary
    from mlflow import MlflowClient

    started_at, now = command_started_at(), time.time()
    figures = {"command_goodput": command_goodput(float(cost["useful_train_s"]), started_at,
                                                  now),
               "command_wall_s": round(now - started_at, 3)}
    client = MlflowClient(tracking_uri)
    for name, value in figures.items():
        client.log_metric(summary["run_id"], name, value)
    return summary | {"cost": cost | figures}
