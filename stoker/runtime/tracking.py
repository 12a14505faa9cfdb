"""Rank-0 MLflow logging for one training job: one run, continued across attempts.

The run id is created on the first attempt and stored with the job (and in every checkpoint);
later attempts reopen the same run. Metrics are buffered and sent with ``log_batch``; a step that
an earlier attempt already logged is not logged again, so every metric stays one value per step.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^/@\s]+@")  # scheme://user:password@host
SECRET_KEY = re.compile(r"(token|password|passwd|secret|api_?key|access_?key|credential)", re.I)


# On a run that continues a job whose recorded run the store does not hold: that run's id.
DESCRIPTION_TAG = "mlflow.note.content"  # the run's description in the MLflow UI
LOST_RUN_TAG = "stoker.lost_run_id"

# Experiment tag the MLflow UI reads to choose its layout (model training, not GenAI).
EXPERIMENT_KIND = "mlflow.experimentKind"

def _cpu_monitor(since):
    """MLflow's CPU monitor, with ``cpu_utilization_percentage`` (percent of all cores busy,
    0-100) measured between its own samples, the first since ``since`` (``psutil.cpu_times()``).

    MLflow's reads ``psutil.cpu_percent()``, which keeps its previous reading per thread: the
    first sample of the monitor's thread, and the end-of-attempt sample taken on another thread,
    read 0.0, so every attempt's first point (and a short attempt's only one) was 0.
    """
    import psutil
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor

    def busy_and_total(times) -> tuple[float, float]:
        # As psutil counts: guest time is already in user/nice; idle and iowait are not busy.
        total = sum(times) - getattr(times, "guest", 0) - getattr(times, "guest_nice", 0)
        return total - times.idle - getattr(times, "iowait", 0), total

    class SinceLastSampleCPUMonitor(CPUMonitor):
        def __init__(self):
            super().__init__()
            self._last = busy_and_total(since)

        def collect_metrics(self):
            super().collect_metrics()  # memory, and psutil's per-thread CPU figure, replaced:
            busy, total = busy_and_total(psutil.cpu_times())
            if total > self._last[1]:
                share = (busy - self._last[0]) / (total - self._last[1])
                self._metrics["cpu_utilization_percentage"][-1] = round(
                    100 * min(max(share, 0.0), 1.0), 1)
                self._last = busy, total

    return SinceLastSampleCPUMonitor()


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested dicts to dotted keys with string values; secret-looking keys are masked."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif SECRET_KEY.search(key) and value:
            flat[name] = "***"
        else:
            flat[name] = URL_PASSWORD.sub(r"\1***@", str(value))
    return flat


class RunTracker:
    """Logs to one MLflow run. Create on rank 0 only.

    Args:
        tracking_uri: MLflow tracking URI (``sqlite:///...`` or ``http://127.0.0.1:5000``).
        experiment: experiment name, created if missing (with ``artifact_location`` if given).
        run_id: reopen this run (a resumed job); None creates a new run.
        run_name, tags, params: used when creating; params missing from a reopened run are added.
        flush_every_s: buffered metrics are sent at least this often (seconds).
        on_created: called with the new run's id as soon as it exists (before params and the
            system metrics monitor), so a process stopped while opening leaves no orphan run.
    """

    def __init__(self, tracking_uri: str, experiment: str, run_id: str | None = None,
                 run_name: str | None = None, tags: dict[str, str] | None = None,
                 params: dict[str, str] | None = None, artifact_location: str | None = None,
                 flush_every_s: float = 2.0, system_metrics_interval_s: float | None = None,
                 on_created: Callable[[str], None] | None = None):
        import psutil
        from mlflow import MlflowClient

        # The first system/cpu sample measures from here (the opening of the run).
        self._cpu_times_at_open = psutil.cpu_times()
        # No probe: the client's first call below reads the store (and says what is wrong).
        ensure_store(tracking_uri, probe=False)
        self.client = MlflowClient(tracking_uri)
        self.flush_every_s = flush_every_s
        self._buffer: list = []
        self._last_flush = time.monotonic()
        existing = self._params_of(run_id) if run_id is not None else {}
        if existing is None:
            # The orchestrator replaces a lost run before launching; this is the rank's own
            # guard (a checkpoint naming a run the job's record never got): train on, linked.
            logging.getLogger(__name__).warning(
                "MLflow run %s is not in the tracking store %s (gone with the store it was "
                "in): logging to a new run tagged %s", run_id,
                URL_PASSWORD.sub(r"\1***@", tracking_uri), LOST_RUN_TAG)
            run_id, tags = None, {**(tags or {}), LOST_RUN_TAG: run_id}
        if run_id is None:
            experiment_id = self._experiment_id(experiment, artifact_location)
            run = self.client.create_run(experiment_id, run_name=run_name, tags=tags or {})
            self.run_id = run.info.run_id
            if on_created is not None:
                on_created(self.run_id)
            existing = {}
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            # The description stays as it is: set when the run was created, then perhaps
            # edited in the MLflow UI or written by the run that continues a lost one.
            tags = {k: v for k, v in (tags or {}).items() if k != DESCRIPTION_TAG}
            if tags:
                self.set_tags(tags)
        self._last_step: dict[str, int] = {}
        self._resumed = run_id is not None
        new_params = {k: v for k, v in (params or {}).items() if k not in existing}
        self._log_params(new_params)
        self._system = None
        if system_metrics_interval_s:
            self._system = self._start_system_metrics(tracking_uri, system_metrics_interval_s)

    def _params_of(self, run_id: str) -> dict[str, str] | None:
        """The params of run ``run_id``; None when the store does not hold it (other store
        errors are raised)."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).data.params
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def _start_system_metrics(self, tracking_uri: str, interval_s: float):
        """MLflow's system metrics (``system/*``): CPU, memory, disk, network, and GPU through
        NVML when present; each NVML query is guarded, so an unsupported one skips only itself."""
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # WARNING, not ERROR: a failed sample or publish is said; "no NVML here" (INFO) is not.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s,
                                       resume_logging=self._resumed, tracking_uri=tracking_uri)
        monitor.monitors = [_cpu_monitor(self._cpu_times_at_open) if isinstance(m, CPUMonitor)
                            else m for m in monitor.monitors]
        self._system_first_step = monitor._logging_step
        monitor.start()
        return monitor

    def _finish_system_metrics(self) -> None:
        """Stop the monitor; an attempt shorter than one interval still logs one sample.

        MLflow's monitor publishes only after a full interval and drops the sample in progress
        when stopped, so a short attempt (or the tail of every attempt) would log nothing.
        """
        monitor, self._system = self._system, None
        monitor.finish()
        if monitor._logging_step == self._system_first_step:
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            # The MLflow UI shows an experiment without this tag in its GenAI layout.
            return self.client.create_experiment(name, artifact_location=artifact_location,
                                                 tags={EXPERIMENT_KIND: "custom_model_development"})
        except MlflowException:  # created concurrently by another job
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def _already_logged(self, key: str, step: int) -> bool:
        if not self._resumed:
            return False
        if key not in self._last_step:
            history = self.client.get_metric_history(self.run_id, key)
            self._last_step[key] = max((m.step for m in history), default=-1)
        return step <= self._last_step[key]

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Buffer metrics for ``step``; sent by the next :meth:`flush` (or after
        ``flush_every_s``)."""
        now_ms = int(time.time() * 1000)
        self._buffer.extend((k, float(v), now_ms, step) for k, v in metrics.items())
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_records(self, records: list) -> None:
        """Send ``(key, value, time_ms, step)`` records now (synchronously), skipping per key a
        step that an earlier attempt already logged; log_batch takes at most 1000 per call."""
        from mlflow.entities import Metric

        metrics = [Metric(k, v, t, s) for k, v, t, s in records if not self._already_logged(k, s)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def flush(self) -> None:
        """Send buffered metrics and wait for the store (synchronous ``log_batch``: MLflow's
        asynchronous queue polls once a second, which an attempt's end would wait for)."""
        records, self._buffer = self._buffer, []
        self.log_records(records)
        self._last_flush = time.monotonic()

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dataset(self, tags: dict[str, str], context: str = "training") -> bool:
        """Log the pulled dataset named by the lineage tags (``dvc.repo``, ``dvc.path``,
        ``dvc.commit``, ``dvc.md5``) as an MLflow dataset input of this run: name
        ``<repo>/<path>``, digest the DVC md5, source ``<repo>@<commit>:<path>``, so the run page's
        Datasets panel shows it. Returns False (nothing logged) when the tags are absent."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        try:
            repo, path, commit, md5 = (tags[k] for k in ("dvc.repo", "dvc.path", "dvc.commit",
                                                         "dvc.md5"))
        except KeyError:
            return False
        repo_name = repo.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")
        dataset = Dataset(
            name=f"{repo_name}/{path}", digest=md5.removesuffix(".dir"), source_type="dvc",
            source=json.dumps({"uri": f"{repo}@{commit}:{path}", "rev": tags.get("dvc.rev")}),
        )
        self.client.log_inputs(self.run_id, datasets=[
            DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])])
        return True

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path)

    def end(self, status: str) -> None:
        """Flush and mark the run FINISHED, FAILED or KILLED (preempted attempts: KILLED)."""
        if self._system is not None:
            try:
                self._finish_system_metrics()
            except Exception as e:  # system metrics must not fail the run's end
                logging.getLogger(__name__).warning("system metrics not logged: %s", e)
        self.flush()
        quiet_run_links()
        self.client.set_terminated(self.run_id, status=status)


def quiet_run_links() -> None:
    """Keep MLflow from printing a run's links to stdout when the run ends on a server.

    MLflow prints ``🏃 View run ... at:`` and ``🧪 View experiment at:`` on stdout at every
    ``set_terminated``: in each attempt's rank log, where the job closes a run a killed attempt
    left open, and where the model is registered, so ``stoker run``'s stdout, its JSON summary,
    no longer parsed. The report task logs the run's link once instead (stderr). Sets
    ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true`` unless the environment sets it; the
    processes started after this inherit it.
    """
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


@contextlib.contextmanager
def quiet_mlflow(logger: logging.Logger | None = None):
    """While MLflow registers a model or creates a store: its INFO lines ("Validating input
    example ...", "Creating initial MLflow database tables...") and what it prints to stderr
    ("Successfully registered model ...") go to ``logger`` at DEBUG instead of the terminal,
    where they repeated, in another format, what Stoker says in one line. Warnings and errors
    stay on MLflow's logger. A closed stderr never fails the call (what it prints is kept)."""
    mlflow_logger = logging.getLogger("mlflow")
    level = mlflow_logger.level
    mlflow_logger.setLevel(max(level, logging.WARNING))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        mlflow_logger.setLevel(level)
        if printed.getvalue().strip():
            (logger or logging.getLogger(__name__)).debug("MLflow: %s", printed.getvalue().strip())


def ensure_store(tracking_uri: str, probe: bool = True) -> None:
    """Create (migrate) an embedded ``sqlite:///`` MLflow store under a file lock next to it.

    MLflow creates the schema on first use; two processes doing it at once on a fresh file race
    (``table _alembic_tmp_experiments already exists``). Serialised, the second one finds the
    schema in place. A new store is built in ``<db>.creating`` and renamed into place when
    complete: a process killed while migrating (a SIGKILL in the first seconds of a job) leaves
    no half-migrated store behind, only a temporary file the next call discards. Other URIs (an
    MLflow server) are left alone.

    With ``probe`` (the default), the store is then read once, so a store that cannot be used
    (not a database, an older schema) raises here. Without it, a store that exists is left for
    the caller's own first call to read: rank 0 opening its run skips a query and the file lock
    (about 0.03 CPU-s of each attempt's tracking one-off); the store is complete by then, since
    it only ever appears by an atomic rename.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return
    import os
    from pathlib import Path

    from filelock import FileLock
    from mlflow import MlflowClient

    from stoker.runtime import private

    db = Path(tracking_uri.removeprefix("sqlite:///"))
    if not probe and db.is_file() and db.stat().st_size > 0:
        return
    private.make_dir(db.parent, narrow_existing=False)
    with FileLock(f"{db}.lock", timeout=300, mode=private.FILE_MODE):
        if not db.exists():
            creating = db.with_name(f"{db.name}.creating")
            creating.unlink(missing_ok=True)  # a creator killed midway
            # Empty and 0600: sqlite builds the store in it, its journal gets the same mode.
            os.close(private.open_fd(creating, os.O_WRONLY))
            with quiet_mlflow():
                MlflowClient(f"sqlite:///{creating}").search_experiments(max_results=1)
            os.replace(creating, db)
        if probe:
            MlflowClient(tracking_uri).search_experiments(max_results=1)
