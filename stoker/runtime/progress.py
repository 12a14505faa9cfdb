"""Machine-readable progress for the orchestrator, the UI and the cost guard (rank 0 only).

``<job_dir>/progress.jsonl``: one JSON object per line, appended. Every line has ``event``
(``start``, ``step``, ``eval``, ``checkpoint``, ``end``), ``time`` (Unix seconds) and ``step``
(global optimizer step). ``step`` lines add ``epoch``, ``loss``, ``lr``, ``samples_per_s``;
``eval`` lines add ``val_accuracy``, ``val_loss`` and ``process_cpu_s`` (rank 0's CPU seconds
so far, all threads; with tracking, ``tracking_open``: whether the MLflow run is open yet,
``tracking_sent_step``: the last step of the last batch MLflow confirmed, and ``tracking_cpu_s``:
the CPU seconds the MLflow threads had used once it was confirmed);
``start`` lines add ``total_steps``, ``resumed``, ``intra_op_threads`` (rank 0's
``torch.get_num_threads()``) and ``train_time_s`` (seconds in committed training steps before
this attempt, from the checkpoint it resumed: 0 for a fresh job); ``end`` lines add
``outcome`` (``completed``, ``preempted``, ``failed``, or ``infrastructure``: a data worker or a
peer rank lost). Every line also has
``attempt`` (1 for the job's first runtime start, counted from the ``start`` lines already in the
file), and a ``step`` line for a step an earlier attempt already reported (re-run after resuming
from an older checkpoint) has ``rerun: true``: readers that want one line per step drop those,
nothing else to de-duplicate. Lines are appended whole; a torn last line (a crash mid-write) is
skipped by readers with a warning and ended by the next writer.

``<job_dir>/heartbeat.json``: rewritten atomically at most once per second with
``{"time", "step", "epoch", "pid", "pid_started", "world_size", "outcome"}`` (``pid_started``:
rank 0's process start time, Unix seconds, as ``psutil`` reads it: with the pid it names the
process, whatever its command line); its ``time`` going stale while the GPU holds memory is what
the cost guard calls a stalled job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from stoker.runtime import private
from stoker.runtime.records import JsonlAppender, read_jsonl


class ProgressWriter:
    """Appends progress events and keeps the heartbeat fresh. Use on rank 0 only."""

    def __init__(self, job_dir: str | Path, world_size: int, heartbeat_every_s: float = 1.0):
        self.dir = private.make_dir(job_dir)
        self.world_size = world_size
        self.heartbeat_every_s = heartbeat_every_s
        earlier = read_events(self.dir)
        self.attempt = 1 + sum(e.get("event") == "start" for e in earlier)
        # Steps an earlier attempt reported: reported again only as re-runs.
        self.reported_up_to = max((e["step"] for e in earlier if e.get("event") == "step"
                                   and isinstance(e.get("step"), int)), default=0)
        self._events = JsonlAppender(self.dir / "progress.jsonl")  # closed in close()
        self._last_beat = 0.0
        self._started = _process_started()

    def event(self, event: str, step: int, at_time: float | None = None, **fields: Any) -> None:
        """Append one event; ``at_time`` (Unix seconds) when it happened before now (a step
        reported once its agreement is read)."""
        record = {"event": event, "time": round(time.time() if at_time is None else at_time, 3),
                  "step": step,
                  "attempt": self.attempt, **fields}
        if event == "step" and step <= self.reported_up_to:
            record["rerun"] = True
        self._events.append(record)
        self.heartbeat(step, fields.get("epoch"), force=event != "step")

    def heartbeat(self, step: int, epoch: int | None = None, outcome: str | None = None,
                  force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_beat < self.heartbeat_every_s:
            return
        self._last_beat = now
        beat = {"time": round(now, 3), "step": step, "epoch": epoch, "pid": os.getpid(),
                "pid_started": self._started, "world_size": self.world_size, "outcome": outcome}
        tmp = self.dir / "heartbeat.json.tmp"
        private.write_text(tmp, json.dumps(beat))
        tmp.replace(self.dir / "heartbeat.json")

    def close(self) -> None:
        self._events.close()


def _process_started() -> float | None:
    """This process's start time (Unix s, ``psutil.Process.create_time``), None if unreadable."""
    import psutil

    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return None


def read_events(job_dir: str | Path) -> list[dict[str, Any]]:
    """All progress events of a job, oldest first ([] when there are none; a torn or foreign
    line is skipped with a warning)."""
    path = Path(job_dir) / "progress.jsonl"
    if not path.is_file():
        return []
    return read_jsonl(path)
