"""Machine-readable progress for the orchestrator, the UI and the cost guard (rank 0 only).

``<job_dir>/progress.jsonl``: one JSON object per line, appended. Every line has ``event``
(``start``, ``step``, ``eval``, ``checkpoint``, ``end``), ``time`` (Unix seconds) and ``step``
(global optimizer step). ``step`` lines add ``epoch``, ``loss``, ``lr``, ``samples_per_s``;
``eval`` lines add ``val_accuracy``, ``val_loss``; ``end`` lines add ``outcome``.

``<job_dir>/heartbeat.json``: rewritten atomically at most once per second with
``{"time", "step", "epoch", "pid", "world_size", "outcome"}``; its ``time`` going stale while the
GPU holds memory is what the cost guard calls a stalled job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class ProgressWriter:
    """Appends progress events and keeps the heartbeat fresh. Use on rank 0 only."""

    def __init__(self, job_dir: str | Path, world_size: int, heartbeat_every_s: float = 1.0):
        self.dir = Path(job_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        self.heartbeat_every_s = heartbeat_every_s
        # Line-buffered: a reader sees whole events; closed in close().
        self._events = open(self.dir / "progress.jsonl", "a", buffering=1)  # noqa: SIM115
        self._last_beat = 0.0

    def event(self, event: str, step: int, **fields: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), "step": step, **fields}
        self._events.write(json.dumps(record) + "\n")
        self.heartbeat(step, fields.get("epoch"), force=event != "step")

    def heartbeat(self, step: int, epoch: int | None = None, outcome: str | None = None,
                  force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_beat < self.heartbeat_every_s:
            return
        self._last_beat = now
        beat = {"time": round(now, 3), "step": step, "epoch": epoch, "pid": os.getpid(),
                "world_size": self.world_size, "outcome": outcome}
        tmp = self.dir / "heartbeat.json.tmp"
        tmp.write_text(json.dumps(beat))
        tmp.replace(self.dir / "heartbeat.json")

    def close(self) -> None:
        self._events.close()


def read_events(job_dir: str | Path) -> list[dict[str, Any]]:
    """All progress events of a job, oldest first ([] when there are none)."""
    path = Path(job_dir) / "progress.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
