"""What a job is doing now, from its progress events: state, step, throughput and ETA.

Read by the ``train`` task's progress watcher (the Prefect progress artifact and log line) and
by the ``stoker`` CLI. Plain functions over the event dicts of ``progress.jsonl``; times are Unix
seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_STEPS_FOR_ETA = 5     # an ETA from fewer steps of an attempt is mostly start-up noise
WINDOW_STEPS = 20         # the moving average of step time covers this many recent steps


@dataclass(frozen=True)
class JobProgress:
    """One view of a job. ``state``: ``starting``, ``training``, ``restarting``, ``completed``
    or ``ended`` (the last attempt ended otherwise); ``eta_s`` is None until
    ``MIN_STEPS_FOR_ETA`` steps of the current attempt were seen."""

    state: str
    attempt: int
    step: int
    total_steps: int
    samples_per_s: float | None = None
    eta_s: float | None = None
    resume_step: int | None = None
    outcome: str | None = None

    @property
    def percent(self) -> float:
        """Share of steps done, 0-100, one decimal."""
        return round(100 * self.step / max(self.total_steps, 1), 1)

    def describe(self) -> str:
        """One line for a person, e.g. ``step 60/132 (attempt 1), 1207 samples/s, ETA 37 s``."""
        where = f"step {self.step}/{self.total_steps} (attempt {self.attempt})"
        if self.state == "starting":
            return f"attempt {self.attempt} starting at step {self.step}/{self.total_steps}"
        if self.state == "restarting":
            return (f"restarting (attempt {self.attempt + 1}, resuming at step "
                    f"{self.resume_step or 0}/{self.total_steps})")
        if self.state in ("completed", "ended"):
            return f"{where}: {self.outcome}"
        line = where
        if self.samples_per_s:
            line += f", {self.samples_per_s:.0f} samples/s"
        if self.eta_s is not None:
            line += f", ETA {_duration(self.eta_s)}"
        return line


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def job_progress(events: list[dict]) -> JobProgress | None:
    """The job's current view from its events (oldest first); None before the first start."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    if not starts:
        return None
    start = events[starts[-1]]
    attempt, total = len(starts), int(start.get("total_steps") or 1)
    current = events[starts[-1] + 1:]
    steps = [e for e in current if e.get("event") == "step"]
    step = int(steps[-1]["step"]) if steps else int(start.get("step") or 0)
    ends = [e for e in current if e.get("event") == "end"]
    if ends:
        outcome = str(ends[-1].get("outcome") or "ended")
        if outcome == "completed":
            return JobProgress("completed", attempt, total, total, outcome=outcome)
        checkpoints = [int(e["step"]) for e in events if e.get("event") == "checkpoint"]
        resume = max(checkpoints) if checkpoints else 0
        state = "restarting" if outcome == "preempted" else "ended"
        return JobProgress(state, attempt, int(ends[-1].get("step") or step), total,
                           resume_step=resume, outcome=outcome)
    if len(steps) < MIN_STEPS_FOR_ETA:
        return JobProgress("starting", attempt, step, total)
    window = steps[-WINDOW_STEPS:]
    done = int(window[-1]["step"]) - int(window[0]["step"])
    elapsed = float(window[-1]["time"]) - float(window[0]["time"])
    eta = (total - step) * elapsed / done if done > 0 and elapsed >= 0 else None
    rate = steps[-1].get("samples_per_s")
    return JobProgress("training", attempt, step, total,
                       samples_per_s=float(rate) if rate is not None else None,
                       eta_s=eta if eta is None or math.isfinite(eta) else None)
