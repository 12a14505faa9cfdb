"""Fixed costs of an attempt kept off the training steps (issue 17): MLflow opens in the
background, metrics keep their steps, the progress watcher reads only what was appended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import metric_steps
from filelock import FileLock
from mlflow import MlflowClient

from stoker.launch.local import LocalLauncher
from stoker.launch.supervisor import ProgressWatcher
from stoker.runtime.records import append_jsonl, line_of

ROOT = Path(__file__).resolve().parents[1]


def _first_step(job_dir: Path) -> dict | None:
    path = job_dir / "progress.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return next((e for e in map(json.loads, lines[:-1]) if e["event"] == "step"), None)


def test_first_step_does_not_wait_for_a_slow_tracking_store(make_spec):
    """The store is busy (its migration lock held, as by another job creating it) until the job
    has made a step: the steps do not wait for it, and every step's metrics arrive later, on
    their steps. Before, the first step waited for the run to open (~2 CPU-s at best)."""
    spec = make_spec("slow-store", epochs=1)
    job, db = spec.parent, spec.parent.parent / "mlflow.db"
    lines: list[str] = []
    codes: list[int] = []
    runner = LocalLauncher(1, python=sys.executable)
    thread = threading.Thread(target=lambda: codes.append(runner.run(
        spec, on_line=lines.append, timeout_s=300)))
    with FileLock(f"{db}.lock"):
        thread.start()
        deadline = time.monotonic() + 120  # a cold start under load takes up to ~30 s
        while _first_step(job) is None and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.1)
        first_step = _first_step(job)
        released = time.time()
    thread.join(300)
    assert codes == [0], "\n".join(lines[-30:])
    assert first_step is not None, "no step while the tracking store was busy"
    client = MlflowClient(f"sqlite:///{db}")
    run_id = (job / "mlflow_run_id").read_text()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.start_time / 1000 >= released - 0.5
    events = [json.loads(x) for x in (job / "progress.jsonl").read_text().splitlines()]
    total = max(e["step"] for e in events if e["event"] == "step")
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert sorted(steps) == metric_steps(total)
    assert json.loads((job / "result.json").read_text())["run_id"] == run_id
    # What tracking cost rank 0 in CPU is on record: per confirmed batch and for the attempt.
    (last_eval,) = [e for e in events if e["event"] == "eval"]
    assert 0 <= last_eval["tracking_sent_step"] <= last_eval["step"]
    assert 0 <= last_eval["tracking_cpu_s"] < last_eval["process_cpu_s"]
    metrics = run.data.metrics
    assert 0 < metrics["profile_tracking_cpu_s"] < metrics["profile_process_cpu_s"]


def _job_events(first: int, last: int, total: int = 100) -> list[dict]:
    return [{"event": "start", "step": first - 1, "time": 0.0, "total_steps": total},
            *({"event": "step", "step": s, "time": s * 0.1, "samples_per_s": 640.0}
              for s in range(first, last + 1))]


def test_progress_watcher_reads_only_new_bytes_and_waits_for_a_torn_line(tmp_path):
    path = tmp_path / "progress.jsonl"
    seen: list[str] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append(m))
    for event in _job_events(1, 30):
        append_jsonl(path, event)
    watcher.poll()
    assert seen[-1].startswith("step 30/100 (attempt 1)")
    size = path.stat().st_size
    # A step line being written: half of it is on disk.
    line = line_of({"event": "step", "step": 31, "time": 3.1, "samples_per_s": 640.0})
    with open(path, "ab") as f:
        f.write(line[:20])
    watcher.poll()
    assert seen[-1].startswith("step 30/100") and len(seen) == 1
    with open(path, "ab") as f:
        f.write(line[20:])
    watcher.poll()
    assert seen[-1].startswith("step 31/100 (attempt 1)")
    # Polls cost the bytes appended since (the torn part is read twice), not the file again.
    assert watcher.tail.bytes_read == size + 20 + len(line)


def test_progress_watcher_skips_a_line_torn_by_a_crash_and_follows_the_next_attempt(tmp_path):
    path = tmp_path / "progress.jsonl"
    seen: list[str] = []
    warnings: list[str] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append(m))
    watcher.tail.warn = warnings.append
    for event in _job_events(1, 12):
        append_jsonl(path, event)
    with open(path, "ab") as f:
        f.write(b'{"event": "step", "st')  # the rank died mid-write
    watcher.poll()
    for event in [{"event": "checkpoint", "step": 10, "time": 1.1},
                  *_job_events(11, 17)]:  # the next attempt ends the torn line first
        append_jsonl(path, event)
    watcher.poll()
    assert seen[-1].startswith("step 17/100 (attempt 2)"), seen
    assert len(warnings) == 1 and "not a whole JSON record" in warnings[0]


def test_progress_watcher_never_reports_what_an_earlier_run_left(tmp_path):
    """A resumed job's first line was the killed run's last one ("step 12/100 (attempt 1)")."""
    path = tmp_path / "progress.jsonl"
    for event in _job_events(1, 12):  # attempt 1, killed: no end event
        append_jsonl(path, event)
    seen: list[str] = []
    watcher = ProgressWatcher(tmp_path, lambda p, m: seen.append(m))
    watcher.poll()
    assert seen == []
    for event in _job_events(13, 19):  # this run's attempt
        append_jsonl(path, event)
    watcher.poll()
    assert len(seen) == 1 and seen[0].startswith("step 19/100 (attempt 2)"), seen


def test_flops_are_counted_without_importing_torch_dynamo():
    """FlopCounterMode imports torch._dynamo on first use (~1 CPU-s per rank before step 1)."""
    code = """
import sys, torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from stoker.runtime.profiling import forward_flops
m = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2, stride=2), nn.ConvTranspose2d(8, 4, 3),
                  nn.Flatten(2), nn.Linear(49, 5)).eval()
x = torch.zeros(3, 4, 12, 12)
with torch.no_grad():
    ours = forward_flops(m, x)
dynamo = "torch._dynamo.convert_frame" in sys.modules
with torch.no_grad(), FlopCounterMode(display=False) as counter:
    m(x)
print(ours, counter.get_total_flops(), dynamo)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    ours, reference, dynamo = out.stdout.split()
    assert float(ours) == float(reference) > 0 and dynamo == "False"


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def test_metrics_a_stop_could_not_send_reach_mlflow_from_the_checkpoint_backlog(tmp_path):
    """A stopping attempt waits for MLflow only briefly; what it could not send is in the stop
    checkpoint (``backlog``) and the resumed attempt sends it, on its steps, without doubles."""
    from stoker.runtime.background_tracking import BackgroundTracker, TrackingError
    from stoker.runtime.tracking import RunTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_file = tmp_path / "mlflow_run_id"
    exited = threading.Event()

    def never_opens() -> RunTracker:  # the store stays busy until the process is gone
        exited.wait(60)
        raise ConnectionError("process gone")

    first = BackgroundTracker(never_opens)
    for step in range(1, 11):
        first.log_metrics(step, {"train_loss": 1.0 / step})
    saved = first.backlog()  # what the stop checkpoint holds
    assert [r[3] for r in saved] == list(range(1, 11))
    with pytest.raises(TrackingError):
        first.end("KILLED", timeout_s=0.2)  # bounded: the attempt exits without the store
    exited.set()
    assert not run_file.exists()
    # The resumed attempt opens the run, replays the backlog, then logs its own steps.
    second = BackgroundTracker(lambda: RunTracker(uri, "backlog", run_name="r",
                                                  on_created=run_file.write_text))
    second.replay(saved)
    second.log_metrics(11, {"train_loss": 1.0 / 11})
    second.end("FINISHED")
    # A third attempt resuming from the same checkpoint (a crash after it) adds no doubles.
    run_id = run_file.read_text()
    third = BackgroundTracker(lambda: RunTracker(uri, "backlog", run_id=run_id))
    third.replay(saved)
    third.end("FINISHED")
    history = MlflowClient(uri).get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(1, 12))


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_tracking_cpu_counts_the_tracking_threads_and_not_the_training_thread():
    """``cpu_s`` is what rank 0's MLflow threads used (the worker opening the run and sending
    batches), read per thread from the kernel: CPU the training thread spends is not in it."""
    from stoker.runtime.background_tracking import BackgroundTracker

    class Opened:
        run_id = "r"

        def log_records(self, records: list) -> None:
            _burn(0.3)  # a slow store insert, in the worker

        def end(self, status: str) -> None:
            pass

    tracker = BackgroundTracker(Opened, flush_every_s=0.05)
    tracker.wait_open(120)
    before = tracker.cpu_s()
    _burn(0.5)  # the training thread's own work
    assert tracker.cpu_s() - before < 0.1
    tracker.log_metrics(1, {"train_loss": 1.0})
    tracker.log_metrics(2, {"train_loss": 0.5})
    tracker.flush(60)
    assert tracker.cpu_s() - before >= 0.25
    # The confirmed batch is on record: its last step and the CPU once it was confirmed.
    assert tracker.sent_step == 2 and tracker.sent_cpu_s - before >= 0.25
    tracker.end("FINISHED")


def test_what_queued_while_the_run_opened_is_sent_once_it_is_open():
    """The steps' metrics queued while the store was slow go out as soon as the run is open,
    not a whole send interval later (was: the worker waited the interval first)."""
    from stoker.runtime.background_tracking import BackgroundTracker

    sent: list[list] = []
    store_ready = threading.Event()

    class Opened:
        run_id = "r"

        def log_records(self, records: list) -> None:
            sent.append(list(records))

        def end(self, status: str) -> None:
            pass

    def open_run() -> Opened:
        store_ready.wait(60)
        return Opened()

    tracker = BackgroundTracker(open_run, flush_every_s=60)
    for step in range(1, 6):
        tracker.log_metrics(step, {"train_loss": 1.0 / step})
    store_ready.set()
    deadline = time.monotonic() + 30
    while tracker.sent_step < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tracker.sent_step == 5, "the queued steps waited for the next send interval"
    assert [r[3] for batch in sent for r in batch] == [1, 2, 3, 4, 5]
    tracker.end("FINISHED")
