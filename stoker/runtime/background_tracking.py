"""Rank-0 tracking off the training thread: the MLflow run opens and metrics are sent in a worker.

Opening the run (importing MLflow, migrating or reaching the store, reopening a resumed run) costs
about 2 CPU-s, and every ``log_batch`` round trip costs milliseconds: neither may hold back a
training step. :class:`BackgroundTracker` keeps the trainer's side to appending a tuple per metric;
one worker thread opens the :class:`~stoker.runtime.tracking.RunTracker`, sends what queued
meanwhile at once, then what was queued every ``flush_every_s`` seconds (each value with its own
step and time), in call order. Each ``log_batch`` has a fixed cost (the sqlite store loads the
run, its params and tags) of about 10 ms of rank-0 CPU besides ~0.05 ms per value, so batches go
every 10 s by default (every 2 s, with a loss at every 10 ms step, tracking took 1.6 % of rank
0's CPU).

Metrics a checkpoint covers must outlive a crash (those steps are never run again), without a
blocking flush at every checkpoint: :meth:`BackgroundTracker.backlog` is what is not yet confirmed
by the store; the trainer saves it in the checkpoint and a resumed attempt sends it again
(:meth:`BackgroundTracker.replay`); values the store already holds are skipped per key and step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# One queued metric value: (key, value, Unix time in ms, step).
MetricRecord = tuple[str, float, int, int]
FLUSH_EVERY_S = 10.0  # queued metrics are sent this often (and at every end)

# The threads that do rank 0's tracking work: this module's worker and MLflow's system metrics
# monitor (``mlflow.system_metrics.system_metrics_monitor`` names its thread so).
TRACKING_THREADS = ("mlflow-tracking", "SystemMetricsMonitor")


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` (of this process) has used, from its CPU-time clock; 0.0 where the
    platform has no per-thread clock or the thread has ended."""
    if thread.ident is None or not thread.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):  # no such clock here, or the thread ended meanwhile
        return 0.0


class TrackingError(RuntimeError):
    """The MLflow run could not be opened, or a batch could not be sent."""


class BackgroundTracker:
    """Queue for one MLflow run that a worker thread opens and writes to. Rank 0 only.

    Args:
        open_run: called once in the worker; returns the opened ``RunTracker`` (it may also tag
            the run, log its dataset and record its id: anything that needs the store).
        flush_every_s: queued metrics are sent at least this often (seconds).

    Errors in the worker (store unreachable, run missing) are raised as :class:`TrackingError`
    by the next call from the training thread, so a broken store still fails the attempt.
    """

    def __init__(self, open_run: Callable[[], Any], flush_every_s: float = FLUSH_EVERY_S):
        self._open_run, self.flush_every_s = open_run, flush_every_s
        self._ops: collections.deque = collections.deque()  # ("metric", rec) | (op, args)
        self._in_flight: list[MetricRecord] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._contacting = False  # the worker has begun to talk to the store
        self._abandoned = False   # the attempt left before that: the worker must not begin
        self.opened = threading.Event()
        self.tracker: Any = None
        # The last confirmed batch: its highest step (the store holds every value queued up to
        # it) and the tracking threads' CPU seconds once it was confirmed (cpu_s()).
        self.sent_step = 0
        self.sent_cpu_s = 0.0
        self._thread = threading.Thread(target=self._work, name="mlflow-tracking", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once the run is open, else None."""
        return self.tracker.run_id if self.tracker is not None else None

    # -- training thread ----------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Queue ``metrics`` for ``step`` (microseconds: no MLflow call here)."""
        self._raise_error()
        now_ms = int(time.time() * 1000)
        self._ops.extend(("metric", (k, float(v), now_ms, step)) for k, v in metrics.items())

    def set_tags(self, tags: dict[str, str]) -> None:
        self._raise_error()
        self._ops.append(("tags", dict(tags)))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._raise_error()
        self._ops.append(("artifact", (path, artifact_path)))

    def backlog(self) -> list[MetricRecord]:
        """Metric values not yet confirmed by the store, oldest first (for a checkpoint)."""
        with self._lock:
            queued = [rec for op, rec in list(self._ops) if op == "metric"]
            return [*self._in_flight, *queued]

    def replay(self, records: list) -> None:
        """Send a checkpoint's backlog again, before anything queued since (resumed attempt)."""
        with self._lock:
            self._ops.extendleft(("metric", tuple(r)) for r in reversed(records))

    def wait_open(self, timeout_s: float = 300.0) -> str:
        """Wait until the run is open; returns its id.

        Raises:
            TrackingError: opening failed, or took longer than ``timeout_s`` seconds.
        """
        if not self.opened.wait(timeout_s):
            raise TrackingError(f"MLflow run not open after {timeout_s} s")
        self._raise_error()
        return self.tracker.run_id

    def flush(self, timeout_s: float = 300.0) -> None:
        """Send everything queued so far and wait until the store confirmed it.

        Raises:
            TrackingError: the worker failed, or did not finish within ``timeout_s`` seconds.
        """
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while (self._ops or self._in_flight) and self._error is None \
                    and self._thread.is_alive():
                if not self._idle.wait(max(0.0, deadline - time.monotonic())):
                    raise TrackingError(f"MLflow did not confirm queued metrics in {timeout_s} s")
        self._raise_error()

    def end(self, status: str, timeout_s: float = 300.0, abandon_unopened: bool = False) -> None:
        """Send everything, mark the run ``status`` (FINISHED, FAILED, KILLED), stop the worker.

        With ``abandon_unopened``, a worker still importing MLflow (no store contacted yet) is
        told not to begin and this returns at once: a stopping attempt whose metrics are all in
        its stop checkpoint need not wait ~2 s to open a run only to close it.

        Raises:
            TrackingError: the run never opened or a batch failed (metrics may be missing).
        """
        if abandon_unopened:
            with self._lock:
                self._abandoned = not self._contacting
            if self._abandoned:
                log.info("MLflow run not opened before the stop: its metrics are in the stop "
                         "checkpoint and are sent when the job resumes")
                return
        self._ops.append(("end", status))
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TrackingError(f"MLflow run not closed within {timeout_s} s")
        self._raise_error()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the tracking threads of this process have used so far:
        the worker (importing MLflow, opening the run, every ``log_batch``) and MLflow's system
        metrics monitor, each read from its own thread CPU clock (``pthread_getcpuclockid``,
        nanoseconds; the per-thread times in ``/proc`` come in 10 ms ticks). A thread that has
        already ended no longer counts. The training thread's part (appending to the queue,
        about a microsecond per call) is not included."""
        return sum(thread_cpu_s(t) for t in threading.enumerate() if t.name in TRACKING_THREADS)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise TrackingError(f"MLflow tracking failed: {self._error}") from self._error

    # -- worker thread ------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            import mlflow  # noqa: F401 - the slow part (~1.2 CPU-s), before any store contact

            with self._lock:
                if self._abandoned:
                    return
                self._contacting = True
            self.tracker = self._open_run()
            self.opened.set()
            while not self._drain():  # first what queued while the run was opening
                self._wake.wait(self.flush_every_s)
                self._wake.clear()
        except BaseException as e:  # raised in the training thread by its next call
            log.warning("MLflow tracking failed: %s", e)
            self._error = e
        finally:
            self.opened.set()
            with self._idle:
                self._idle.notify_all()

    def _drain(self) -> bool:
        """Send the operations queued when called, in order (not those queued meanwhile: one
        batch per interval, not one per step); True once the run was ended."""
        left = len(self._ops)
        while True:
            with self._lock:
                if not self._ops or left <= 0:
                    if not self._ops:
                        self._idle.notify_all()
                    return False
                op, args = self._ops.popleft()
                left -= 1
                if op == "metric":
                    batch = [args]
                    while left > 0 and self._ops[0][0] == "metric":
                        batch.append(self._ops.popleft()[1])
                        left -= 1
                    self._in_flight = batch
            if op == "metric":
                self.tracker.log_records(batch)
                with self._lock:
                    self._in_flight = []
                self.sent_step = max(self.sent_step, *(rec[3] for rec in batch))
                self.sent_cpu_s = self.cpu_s()
            elif op == "tags":
                self.tracker.set_tags(args)
            elif op == "artifact":
                self.tracker.log_artifact(*args)
            elif op == "end":
                self.tracker.end(args)
                return True
