"""What the Trainer reports: its MLflow run (opened in the background), progress events,
metrics, the checkpoint-share warning, the result of a completed job and the run's end. Rank 0
alone writes; the other ranks have no tracker and no progress writer."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch

from stoker.runtime import private
from stoker.runtime.background_tracking import BackgroundTracker
from stoker.runtime.checkpoint import CheckpointError
from stoker.runtime.records import read_text
from stoker.runtime.tracking import URL_PASSWORD, RunTracker, flatten

log = logging.getLogger("stoker.runtime")

# Entry points called by rank 0 once a job completes: (spec, result.json fields, MLflow run id).
COMPLETED_JOB_HOOKS = "stoker.runtime.completed"
RUN_OPEN_TIMEOUT_S = 300.0  # the result names the run: wait this long for MLflow at the end
# A stopping attempt waits this long for MLflow, no longer: what it has not confirmed is in the
# stop checkpoint (tracking_backlog) and is sent by the attempt that resumes from it.
STOP_TRACKING_WAIT_S = 2.0

# Periodic checkpoints that hold the loop longer than this share of an attempt's time get one
# warning (after a few saves), naming the settings that space them out.
CHECKPOINT_SHARE_WARN = 0.05
CHECKPOINT_SHARE_MIN_SAVES = 3


class ReportingMixin:
    """The Trainer's reporting methods (``self`` is a :class:`stoker.runtime.trainer.Trainer`:
    ``spec``, ``cfg``, ``env``, ``tracker``, ``progress``, ``timings``, ...)."""

    def _open_tracker(self) -> BackgroundTracker:
        """Open (or reopen) the job's MLflow run in a worker thread: the first step does not
        wait for MLflow's import and the store (about 2 CPU-s); metrics queue meanwhile."""
        run_file = Path(self.spec.job_dir) / "mlflow_run_id"
        # The job's record first: the orchestrator replaces a run the store lost (the
        # checkpoint still names that one), and the bucket's record must not go back to it.
        run_id = self.run_id = read_text(run_file) or self.run_id
        spec, params = self.spec, flatten(self.cfg.model_dump(mode="json"), "train.")
        tags = {"stoker.gpu_model": self.gpu_model(),
                "stoker.world_size": str(self.env.world_size)}

        def open_run() -> RunTracker:
            # The tags go with the run's creation (or its one set_tags when reopened): a
            # log_batch less in every attempt's tracking one-off.
            tracker = RunTracker(
                spec.tracking_uri, spec.experiment, run_id=run_id, run_name=spec.run_name,
                tags={**(spec.tags or {}), **tags}, params=params,
                artifact_location=spec.artifact_location,
                system_metrics_interval_s=spec.system_metrics_interval_s,
                on_created=self._run_created)
            if run_id is None:
                tracker.log_dataset(spec.tags or {})  # once per run: the Datasets panel
            return tracker

        return BackgroundTracker(open_run)

    def _run_created(self, run_id: str) -> None:
        """Record a new MLflow run's id in ``<job_dir>/mlflow_run_id`` and hand it to
        ``run_id_sink`` (set by :func:`stoker.runtime.bucket.attach`: the job's bucket gets it
        at once, so a node lost seconds later leaves the link for the next one)."""
        private.write_text(Path(self.spec.job_dir) / "mlflow_run_id", run_id)
        sink = getattr(self, "run_id_sink", None)
        if sink is not None:
            sink(run_id)

    def _run_id(self) -> str | None:
        """The MLflow run id: the open run's, else the one this job already had (or None)."""
        return (self.tracker.run_id if self.tracker is not None else None) or self.run_id

    def gpu_model(self) -> str:
        """NVML/CUDA name of this rank's GPU (``NVIDIA H200``), or ``cpu``."""
        if self.env.device.type == "cuda":
            return torch.cuda.get_device_name(self.env.device)
        return "cpu"

    def _check_checkpoint_share(self) -> None:
        """After a periodic save: once per attempt, on rank 0, warn when checkpoints have held
        the loop more than ``CHECKPOINT_SHARE_WARN`` of the attempt's time so far (after
        ``CHECKPOINT_SHARE_MIN_SAVES`` saves): the cadence suits slower steps, and the
        settings that space saves out are named. Figures: the loop's own timer (seconds held
        per save, ``timings["checkpoint"]``) over the wall time since the loop started."""
        self._periodic_saves += 1
        if not self.env.is_main or self._share_warned \
                or self._periodic_saves < CHECKPOINT_SHARE_MIN_SAVES:
            return
        wall = time.perf_counter() - self._loop_started
        share = self.timings["checkpoint"] / wall if wall > 0 else 0.0
        if share <= CHECKPOINT_SHARE_WARN:
            return
        self._share_warned = True
        cfg = self.cfg
        log.warning(
            "checkpoints held the loop %.0f %% of this attempt's %.1f s so far (%d saves, %.0f ms "
            "each): space them out with train.checkpoint_every_steps (now %s) or "
            "train.checkpoint_every_s (now %s)%s", 100 * share, wall, self._periodic_saves,
            1000 * self.timings["checkpoint"] / self._periodic_saves,
            cfg.checkpoint_every_steps or "unset", cfg.checkpoint_every_s or "unset",
            "" if cfg.async_checkpoint else
            ", or write them in the background with train.async_checkpoint=true")

    def _log_step(self, step: int, epoch: int, loss: float, lr: float, step_s: float,
                  ended: float | None = None) -> None:
        """Report one agreed step: its progress event every ``log_every_steps`` steps; to MLflow
        every ``metrics_every_steps`` steps (and at the last), the mean loss and the throughput
        of the steps since its last value, and the learning rate."""
        window = self._metrics_window
        window[0] += loss
        window[1] += 1
        window[2] += step_s
        last = step == self.total_steps
        if step % self.cfg.log_every_steps == 0 or last:
            samples_per_s = self.cfg.global_batch_size / max(step_s, 1e-9)
            self._event("step", epoch=epoch, loss=loss, lr=lr, samples_per_s=samples_per_s,
                        at_step=step, at_time=ended)
        # Each MLflow value costs rank 0 ~0.08 ms of CPU (the sqlite store's insert): at 10 ms
        # steps, a loss per step alone took ~0.8 % of rank 0's CPU.
        if step % self.cfg.metrics_every_steps == 0 or last:
            loss_sum, steps, seconds = window
            self._log({"train_loss": loss_sum / steps, "lr": lr,
                       "samples_per_s": steps * self.cfg.global_batch_size / max(seconds, 1e-9)},
                      step)
            self._metrics_window = [0.0, 0, 0.0]

    def _event(self, event: str, at_step: int | None = None, at_time: float | None = None,
               **fields: Any) -> None:
        if self.progress is not None:
            self.progress.event(event, self.step if at_step is None else at_step,
                                at_time=at_time, **fields)

    def _log(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(self.step if step is None else step, metrics)

    def _write_result(self, wall_s: float, steps_run: int) -> None:
        if not self.env.is_main:
            return
        job = Path(self.spec.job_dir)
        private.make_dir(job / "final")
        tmp = job / "final" / "model.pt.tmp"
        with private.open_file(tmp, "wb") as f:
            torch.save(self.module.state_dict(), f)
        tmp.replace(job / "final" / "model.pt")
        profile = self.profile(wall_s, steps_run)
        if self.tracker is not None:
            self.tracker.wait_open(RUN_OPEN_TIMEOUT_S)
        result = {"run_id": self._run_id(), "step": self.step, "total_steps": self.total_steps,
                  "metrics": self.metrics, "model": self.cfg.model,
                  "num_classes": self.splits.num_classes,
                  "input_shape": list(self.splits.input_shape),
                  "image_mean": list(self.cfg.image_mean) if self.cfg.image_mean else None,
                  "image_std": list(self.cfg.image_std) if self.cfg.image_std else None,
                  "classes": list(self.splits.classes), "model_path": str(job / "final/model.pt"),
                  "world_size": self.env.world_size, "gpu_model": self.gpu_model(),
                  "train_time_s": self.train_time_s, "profile": profile}
        self.result = result
        private.write_text(job / "result.json.tmp", json.dumps(result, indent=2))
        (job / "result.json.tmp").replace(job / "result.json")
        if self.tracker is not None:
            self.tracker.log_metrics(self.step, {f"profile_{k}": v for k, v in profile.items()
                                                 if isinstance(v, int | float)})

    def close(self, outcome: str) -> None:
        """Flush tracking and progress; mark the run FINISHED, KILLED (preempted) or FAILED.

        Seconds per part of the end go to ``self.end_s`` (checkpoint, data, mlflow), which
        :func:`stoker.runtime.__main__.main` logs in one line with the process-group teardown.
        """
        marks = [time.monotonic()]
        with contextlib.suppress(CheckpointError):
            self.ckpt.wait()
        marks.append(time.monotonic())
        self.close_data()
        marks.append(time.monotonic())
        status = {"completed": "FINISHED", "preempted": "KILLED"}.get(outcome, "FAILED")
        if self.progress is not None:  # on record first: closing MLflow can take seconds
            self.progress.event("end", self.step, outcome=outcome)
            self.progress.heartbeat(self.step, outcome=outcome, force=True)
        try:
            self._close_tracking(outcome, status)
            marks.append(time.monotonic())
            if outcome == "completed":
                self._log_model()
        finally:
            marks.append(time.monotonic())
            self.end_s = dict(zip(("checkpoint", "data", "mlflow", "model"),
                                  (b - a for a, b in zip(marks, marks[1:], strict=False)),
                                  strict=False))

    def _log_model(self) -> None:
        """Hand the completed job to the hooks installed for it (the entry points of group
        ``COMPLETED_JOB_HOOKS``): with Stoker installed, ``stoker.tracking.registry.
        log_completed_model`` logs the model to the job's MLflow run and records its URI, where
        torch, MLflow, the store and the weights are already loaded, so the orchestrator
        registers it without importing torch. Only with ``spec.log_model`` and tracking on.
        A training image has no entry points (plain sources) and the spec says off there:
        the orchestrator logs the model. A failing hook is one warning, never the job's
        outcome."""
        result, run_id = getattr(self, "result", None), self._run_id()
        if not (self.spec.log_model and self.spec.tracking_uri and result and run_id):
            return
        # One call per hook, also where an environment holds two records of one install.
        hooks = {hook.value: hook for hook in entry_points(group=COMPLETED_JOB_HOOKS)}
        for hook in hooks.values():
            try:
                hook.load()(self.spec, result, run_id)
            except Exception as e:  # noqa: BLE001 - the job is done: the orchestrator logs it
                log.warning("the completed-job hook %s failed for MLflow run %s (%s: %s); the "
                            "orchestrator logs the model", hook.value, run_id, type(e).__name__,
                            URL_PASSWORD.sub(r"\1***@", " ".join(str(e).split()))[:300])

    def _close_tracking(self, outcome: str, status: str) -> None:
        """End the MLflow run with ``status``, close the progress log, raise a tracking error."""
        if self.tracker is not None:
            try:
                self.tracker.set_tags({"stoker.last_outcome": outcome})
                stopping = outcome == "preempted"
                self.tracker.end(status, abandon_unopened=stopping,
                                 timeout_s=STOP_TRACKING_WAIT_S if stopping else RUN_OPEN_TIMEOUT_S)
            except Exception as e:  # tracking must not mask the training outcome
                log.warning("could not finish MLflow run %s: %s", self._run_id(), e)
        if self.progress is not None:
            self.progress.close()
