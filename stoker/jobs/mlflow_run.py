"""The job's MLflow run at resume: reopened, or continued in a new run when the store lost it.

A job records its MLflow run id (``<job_dir>/mlflow_run_id``, also in the bucket with a
``checkpoint_dir``), and every attempt reopens that run. With the default tracking store (a
sqlite file in the node's ``work_dir``) a job resumed on another node from the bucket names a
run that went with the first node's disk. Training must not be lost because a database was:
before anything is launched, :func:`continue_lost_run` checks the recorded run and, when the
store no longer holds it, opens a new run that links the lost one (tag ``stoker.lost_run_id``)
and carries what the job's own record knows (attempts, preemptions, billed time, steps lost);
the metrics logged to the lost run are not recoverable. A store that cannot be read at all is
one line naming it and the run (:class:`TrackingStoreError`, exit 2), never a traceback.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path

from stoker.jobs.attempts import committed_step
from stoker.jobs.store import write_through
from stoker.runtime import private
from stoker.runtime.records import read_json, read_text, write_json
from stoker.runtime.spec import RunSpec
from stoker.runtime.tracking import LOST_RUN_TAG, RunTracker
from stoker.tracking.cost import steps_lost
from stoker.tracking.store import TrackingStoreError, open_store, safe_uri, store_error

RUN_FILE = "mlflow_run_id"
RESULT_FILE = "result.json"  # the runtime's result of a finished training: names its run
LINK_TAG = LOST_RUN_TAG  # on the new run: the id of the run the store lost
LINK_STEP_TAG = "stoker.lost_run_step"  # the lost run's metrics went up to this step
# An MLflow run id is a hex uuid; anything else in the record is damage, not an id to ask for.
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ContinuedRun:
    """A new MLflow run that continues a job whose recorded run the store no longer holds.

    Attributes: ``job`` the job's name; ``lost_run_id`` / ``run_id`` the old and the new run;
    ``why`` how the old one is gone (``is not in``); ``store`` the tracking URI (password
    masked); ``step`` the committed step the job resumes at; ``attempts`` closed attempts so far;
    ``billed_s`` their billed seconds; ``lost_steps`` steps trained again so far."""

    job: str
    lost_run_id: str
    run_id: str
    why: str
    store: str
    step: int
    attempts: int
    billed_s: float
    lost_steps: int

    def line(self) -> str:
        """The WARNING line the train task logs."""
        return (f"job {self.job}: MLflow run {self.lost_run_id} {self.why} the tracking store "
                f"{self.store}: the store it was in is gone, and with it the metrics logged up "
                f"to step {self.step}; continuing in new MLflow run {self.run_id} (tag "
                f"{LINK_TAG}={self.lost_run_id}), with the job's {self.attempts} attempt(s), "
                f"{self.billed_s:.0f} s billed and {self.lost_steps} step(s) lost carried from "
                "its record. Use a tracking server for jobs that must survive losing their node")


def _gone(uri: str, run_id: str, job: str) -> str | None:
    """How the recorded run is gone from the store (``is not in``, ``was deleted from``), or
    None when the store holds it.

    Raises:
        TrackingStoreError: the store cannot be read (named with the run, password masked).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if not RUN_ID.match(run_id):
        return "is not in"  # a damaged record: no store holds such an id
    open_store(uri, job, run_id)
    try:
        run = MlflowClient(uri).get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return "is not in"
        raise store_error(uri, e, job, run_id) from None
    except Exception as e:  # noqa: BLE001 - a driver, a socket, a file: the store is unusable
        raise store_error(uri, e, job, run_id) from None
    return "was deleted from" if run.info.lifecycle_stage == "deleted" else None


def open_job_store(uri: str, job_dir: Path) -> None:
    """Create or reach the tracking store ``uri`` before the job ``job_dir`` trains.

    Raises:
        TrackingStoreError: it cannot be created or read (a sqlite file that is not a
            database, a folder that cannot be written), in one line naming it and the job's
            recorded run, if any.
    """
    open_store(uri, Path(job_dir).name, read_text(Path(job_dir) / RUN_FILE))


def continue_lost_run(spec: RunSpec, history: list[dict], events: list[dict],
                      devices: int) -> ContinuedRun | None:
    """Make sure the job of ``spec`` resumes in an MLflow run the tracking store holds.

    Args:
        spec: the job's run spec (tracking URI, experiment, run name, lineage tags).
        history: the job's closed attempt records, oldest first (``AttemptLog.history``).
        events: the job's progress events (for steps lost of older records).
        devices: processes (GPUs) per attempt, for the billed device-hours.

    Returns:
        None when nothing needs doing (no run recorded yet, no tracking, or the store holds
        the run); else the new run, already recorded in ``<job_dir>/mlflow_run_id`` (and the
        job's bucket).

    Raises:
        TrackingStoreError: the store cannot be read, or the new run cannot be created.
    """
    job_dir = Path(spec.job_dir)
    lost = read_text(job_dir / RUN_FILE)
    if lost is None or not spec.tracking_uri:
        return None
    lost = " ".join(lost.split())[:100]  # an outside record: one line, bounded, in tags and logs
    why = _gone(spec.tracking_uri, lost, job_dir.name)
    if why is None:
        return None
    step = committed_step(spec.checkpoint_location)
    billed_s = sum(float(a.get("duration_s") or 0.0) for a in history)
    carried = {"stoker.attempts": str(len(history)),
               "stoker.preemptions": str(sum(a.get("outcome") == "preempted" for a in history)),
               LINK_TAG: lost, LINK_STEP_TAG: str(step),
               "mlflow.note.content": f"Continues MLflow run {lost}, which {why} this tracking "
               f"store (its metrics up to step {step} are gone with the store it was in).\n\n"
               + spec.tags.get("mlflow.note.content", "")}
    continued = ContinuedRun(job_dir.name, lost, "", why, safe_uri(spec.tracking_uri), step,
                             len(history), billed_s, steps_lost(history, events))
    try:
        tracker = RunTracker(spec.tracking_uri, spec.experiment, run_name=spec.run_name,
                             tags={**spec.tags, **carried},
                             artifact_location=spec.artifact_location,
                             on_created=lambda run_id: _record(job_dir, run_id, lost))
        now_ms = int(time.time() * 1000)
        tracker.log_records([(k, float(v), now_ms, step) for k, v in {
            "steps_lost": continued.lost_steps, "billed_s": billed_s,
            "gpu_hours": devices * billed_s / 3600}.items()])
        tracker.log_dataset(spec.tags)  # the runtime logs it only when it creates the run
    except Exception as e:  # noqa: BLE001 - any store failure: one line, no traceback
        raise TrackingStoreError(
            f"tracking store {safe_uri(spec.tracking_uri)}: cannot create the MLflow run that "
            f"continues lost run {lost} of job {job_dir.name} ({type(e).__name__}: "
            f"{safe_uri(' '.join(str(e).split()))[:300]})") from None
    return dataclasses.replace(continued, run_id=tracker.run_id)


def _record(job_dir: Path, run_id: str, lost: str) -> None:
    """Record ``run_id`` as the job's MLflow run (atomically), in its bucket too; a finished
    training's ``result.json`` that names the ``lost`` run names the new one (registration
    logs the model to it)."""
    tmp = job_dir / f".{RUN_FILE}.tmp"
    private.write_text(tmp, run_id)
    tmp.replace(job_dir / RUN_FILE)
    write_through(job_dir, RUN_FILE)
    result = read_json(job_dir / RESULT_FILE)
    if isinstance(result, dict) and result.get("run_id") == lost:
        write_json(job_dir / RESULT_FILE, {**result, "run_id": run_id})
        write_through(job_dir, RESULT_FILE)
