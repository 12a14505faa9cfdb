"""Steps lost when a leftover trainer (an owner that lost its lease) commits its stop checkpoint
after the takeover (issue 48's trials): only steps no later attempt could load count."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stoker.cli import app
from stoker.jobs.attempts import AttemptLog
from stoker.jobs.status import job_summary
from stoker.launch.supervisor import close_left_open
from stoker.runtime.progress import ProgressWriter


def commit(job: Path, progress: ProgressWriter, step: int) -> None:
    """A committed checkpoint of ``step``, as the checkpointer leaves it, and its event."""
    folder = job / "checkpoints" / f"step-{step:09d}"
    folder.mkdir(parents=True)
    (folder / "COMMITTED").touch()
    progress.event("checkpoint", step, path=str(job / "checkpoints"))


def train(progress: ProgressWriter, first: int, last: int) -> None:
    for step in range(first, last + 1):
        progress.event("step", step, epoch=0, loss=0.1, lr=0.01, samples_per_s=900.0)


def taken_over(job: Path, late_commit: int, resumed_at: int) -> None:
    """Attempt 1 trains to step 30 (committed at 20); its run dies and the next run takes the
    job over: it closes attempt 1 (30 reached, 20 committed: 10 lost, it says) and starts
    attempt 2. The leftover ranks of attempt 1 go on to ``late_commit`` and commit a stop
    checkpoint there; attempt 2's ranks start at ``resumed_at`` (the leftover's checkpoint when
    it came in time, else step 20), and complete at step 40."""
    log = AttemptLog(job)
    job.mkdir(parents=True)
    log.start(1, "on_demand", "flow-run-1", "local")
    time.sleep(0.01)  # events are timed to the millisecond
    leftover = ProgressWriter(job, world_size=2)
    leftover.event("start", 0, total_steps=40, resumed=False)
    train(leftover, 1, 30)
    commit(job, leftover, 20)
    time.sleep(0.01)
    [closed] = close_left_open(log, str(job / "checkpoints"), lambda _: None)
    assert closed["steps_lost"] == 10  # as the takeover saw it
    log.start(2, "on_demand", "flow-run-2", "local")
    time.sleep(0.01)
    train(leftover, 31, late_commit)  # it sees the new lease within 2 s
    commit(job, leftover, late_commit)
    leftover.event("end", late_commit, outcome="preempted")
    leftover.close()
    resumed = ProgressWriter(job, world_size=2)
    resumed.event("start", resumed_at, total_steps=40, resumed=True)
    train(resumed, resumed_at + 1, 40)
    resumed.event("end", 40, outcome="completed")
    resumed.close()
    log.end(2, {"exit_code": 0, "outcome": "completed",
                "duration_s": 1.0, "capacity_type": "on_demand", "steps_lost": 0})


@pytest.mark.parametrize(("late_commit", "resumed_at", "lost"), [
    (32, 32, 0),   # its stop checkpoint came before the next ranks loaded: nothing lost
    (32, 20, 12),  # it came after: all it trained past step 20 was run again
])
def test_a_leftovers_stop_checkpoint_after_the_takeover_counts_only_steps_really_lost(
        tmp_path, late_commit, resumed_at, lost):
    job = tmp_path / "jobs" / f"kkkk{resumed_at}-leftover"
    taken_over(job, late_commit, resumed_at)
    assert job_summary(job).steps_lost == lost  # read back from the job's files
    shown = CliRunner().invoke(app, ["status", job.name, "--work-dir", str(tmp_path)]).output
    assert f"steps lost {lost}" in shown.splitlines(), shown
    [first] = [line for line in shown.splitlines() if line.startswith("attempt 1:")]
    assert bool(re.search(rf", {lost} step\(s\) lost$", first)) == (lost > 0), first
