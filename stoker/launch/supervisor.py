"""A training job as a series of attempts: run spec, lineage tags, progress, closing the MLflow run.

No Prefect here: the ``train`` task (``tasks/train.py``) calls these functions and adds the Prefect
parts (task runs per attempt, the progress artifact, the flow run's id and URL).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stoker.config import PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.images.build import ImageResult
from stoker.jobs.attempts import AttemptLog, left_open_note
from stoker.jobs.lease import JobBusy
from stoker.jobs.status import JOB_LOG, WINDOW_STEPS, job_progress
from stoker.jobs.stop_request import StopRequest, TrainingStopped
from stoker.jobs.store import write_through
from stoker.launch.rank_lines import (  # noqa: F401 - re-exported: the attempt's output lines
    RANK_LEVEL,
    RANK_STAMPED,
    TORCH_LEVEL,
    LineLog,
    at_rank_level,
    log_time,
)
from stoker.runtime import private
from stoker.runtime.preemption import stop_sender
from stoker.runtime.records import JsonlTail, integer, real_number
from stoker.runtime.spec import RunSpec
from stoker.stopping import stop_reason
from stoker.tracking.lineage import code_version

if TYPE_CHECKING:  # imported by the caller that has a client: MLflow costs seconds to import
    from mlflow import MlflowClient

__all__ = ["JobBusy", "ProgressWatcher", "TrainResult", "TrainingFailed", "close_left_open",
           "finish_run", "lineage_tags", "nproc", "write_spec"]


log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """The job ended without completing (budget spent, or an error not worth retrying)."""


@dataclass(frozen=True)
class TrainResult:
    """What training produced: the MLflow run, metrics, final weights, attempts and cost."""

    job_dir: str
    run_id: str
    metrics: dict
    result: dict
    attempts: list[dict]
    cost: dict


def nproc(config: PipelineConfig, dev: Path = Path("/dev")) -> int:
    """Processes per node: the configured number, or one per GPU, or 2 on a CPU machine.

    The GPUs are counted by ``torch.cuda.device_count()`` (which honours
    ``CUDA_VISIBLE_DEVICES``); on a machine without a GPU device file under ``dev`` there is
    none to count and torch is not imported (about 2.5 CPU-s of every ``stoker run`` before
    its flow starts)."""
    if config.train.nproc_per_node != "auto":
        return int(config.train.nproc_per_node)
    from stoker.runtime.launch import gpu_device_present

    if not gpu_device_present(dev):
        return 2
    import torch

    return torch.cuda.device_count() or 2


def nodes(config: PipelineConfig) -> int:
    """Nodes an attempt runs on: the docker launcher's containers, the slurm launcher's nodes,
    the kubernetes launcher's ``num_nodes`` (validated with the launcher), else 1."""
    kind = config.launcher.kind
    if kind == "kubernetes":
        value = config.launcher.kubernetes.get("num_nodes", 1)
        return value if type(value) is int and value >= 1 else 1
    return {"docker": config.launcher.docker.nnodes,
            "slurm": config.launcher.slurm.nodes}.get(kind, 1)


def lineage_tags(config: PipelineConfig, dataset: DatasetRef, world_size: int,
                 image: ImageResult | None = None, flow_run_id: str | None = None,
                 flow_run_url: str | None = None) -> dict[str, str]:
    """Tags every run carries: code version, dataset, orchestrator run, launcher, world size.

    ``flow_run_url`` is dropped unless it is an http(s) URL (an older Prefect built
    ``None/flow-runs/…`` when no UI URL was configured)."""
    code = code_version()
    tags = {
        "mlflow.source.git.commit": code["git_commit"], "stoker.git_commit": code["git_commit"],
        "stoker.git_dirty": code["git_dirty"], "dvc.repo": dataset.repo_url,
        "dvc.rev": dataset.rev, "dvc.commit": dataset.commit, "dvc.path": dataset.path,
        "dvc.md5": dataset.md5, "stoker.launcher": config.launcher.kind,
        "stoker.world_size": str(world_size * nodes(config)),
        "stoker.capacity_type": config.cost.capacity_type,
        "mlflow.user": run_owner(),  # the run's owner on a shared server (was "unknown")
    }
    if image is not None:
        tags.update(image.lineage_tags())
    elif config.launcher.kind == "docker" and config.launcher.docker.image:
        tags["stoker.image"] = config.launcher.docker.image
    if flow_run_id:
        tags["prefect.flow_run_id"] = str(flow_run_id)
    if flow_run_url and flow_run_url.startswith(("http://", "https://")):
        tags["prefect.flow_run_url"] = flow_run_url
    return tags


def run_owner() -> str:
    """Who runs the job, as MLflow's runs table shows it: the tracking server's user
    (``MLFLOW_TRACKING_USERNAME``) when set, else this process's login name; ``unknown`` when
    neither can be read."""
    import getpass

    if name := os.environ.get("MLFLOW_TRACKING_USERNAME", "").strip():
        return name
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name, no passwd entry (a bare container)
        return "unknown"


_KEYED_JOB = re.compile(r"^([0-9a-f]{8})[0-9a-f]*-(\d{8}T\d{6})\d*Z$")


def run_name(config: PipelineConfig, dataset: DatasetRef, job_dir: Path) -> str:
    """A name a person can read in the MLflow runs table and tell from the others:
    ``<dataset>-<model>-<job key>-<job start>``, e.g.
    ``digits-small_cnn-aaf8700f-20261203T132227`` (jobs of the same settings share the key;
    the full job folder name is the ``stoker.job`` tag); a ``job_id`` folder's name stands
    whole (``digits-small_cnn-mine``)."""
    data = Path(dataset.path.rstrip("/")).name or "data"
    model = config.train.model.rpartition(":")[2] or config.train.model
    keyed = _KEYED_JOB.match(job_dir.name)
    job = f"{keyed[1]}-{keyed[2]}" if keyed else job_dir.name
    return f"{data}-{model}-{job}"


def run_description(config: PipelineConfig, dataset: DatasetRef, world_size: int) -> str:
    """The run's description (MLflow's ``mlflow.note.content``): dataset and the config summary."""
    train = config.train
    return (f"Dataset `{dataset.path}` of `{dataset.repo_url}` at `{dataset.rev}` (commit "
            f"`{dataset.commit[:12]}`, DVC `{dataset.md5}`, {dataset.nfiles} files).\n\n"
            f"Model `{train.model}`, {train.epochs} epochs, global batch "
            f"{train.global_batch_size}, lr {train.lr:g}, {train.precision}, {world_size} "
            f"process(es) per node, launcher `{config.launcher.kind}`.")


HOST_ENVIRONMENT_LAUNCHERS = ("local", "slurm")  # their ranks run this Python environment


def rank_0_logs_model(config: PipelineConfig) -> bool:
    """Whether rank 0 logs the completed job's model (``RunSpec.log_model``): where its ranks
    run this Python environment (the local and Slurm launchers), which installs Stoker's hook
    for a completed job (``stoker.tracking.registry.log_completed_model``). A training image
    holds the runtime's packages only (MLflow's skinny client, no pandas for the pyfunc):
    there the orchestrator logs the model."""
    return config.launcher.kind in HOST_ENVIRONMENT_LAUNCHERS


def write_spec(config: PipelineConfig, dataset: DatasetRef, job_dir: Path,
               world_size: int, tags: dict[str, str], lease_token: str | None = None) -> Path:
    """Write ``<job_dir>/spec.yaml`` for the runtime (rewritten each run with current lineage).

    Call it only while holding the job's lease (``lease_token``): the runtime stops once the
    lease is no longer that one. The MLflow run gets a readable name (:func:`run_name`), the job
    folder as tag ``stoker.job`` and a description with the dataset and config summary."""
    tags = {**tags, "stoker.job": job_dir.name,
            "mlflow.note.content": run_description(config, dataset, world_size)}
    store = config.job_store_url()
    spec = RunSpec(
        train=config.train, data_dir=dataset.local_path, job_dir=str(job_dir),
        checkpoint_dir=f"{store}/{job_dir.name}/checkpoints" if store else None,
        tracking_uri=config.tracking_uri(), experiment=config.experiment(),
        artifact_location=None if config.tracking.tracking_uri
        else (config.work_dir.resolve() / "mlartifacts").as_uri(),
        run_name=run_name(config, dataset, job_dir), tags=tags,
        system_metrics_interval_s=config.tracking.system_metrics_interval_s,
        lease_token=lease_token,
        log_model=rank_0_logs_model(config),
    )
    private.make_dir(job_dir)
    if spec.artifact_location:  # the local store's artifacts: the owner's only, as the job's
        private.make_dir(config.work_dir.resolve() / "mlartifacts", narrow_existing=False)
    spec.dump(job_dir / "spec.yaml")
    write_through(job_dir, "spec.yaml")
    return job_dir / "spec.yaml"


def capacity_for(config: PipelineConfig, preemptions_so_far: int) -> str:
    """Capacity type of the next attempt: spot falls back to on-demand after N preemptions."""
    after = config.retry.on_demand_after_preemptions
    if config.cost.capacity_type == "spot" and after is not None and preemptions_so_far >= after:
        return "on_demand"
    return config.cost.capacity_type


FORWARDED = ("straggler",)  # the ranks' events ProgressWatcher hands to on_event


class ProgressWatcher(threading.Thread):
    """Reports the runtime's progress events every ``every_s`` seconds.

    ``on_progress(percent, message)`` gets the share of steps done (0-100) and a line with step,
    throughput and ETA (:func:`stoker.jobs.status.job_progress`), only when the line changed;
    the ``train`` task turns it into a Prefect progress artifact and a log line.
    ``on_event(record)`` gets each new event of a kind in :data:`FORWARDED` (a straggler).
    """

    def __init__(self, job_dir: Path, on_progress: Callable[[float, str], None],
                 every_s: float = 5.0, on_event: Callable[[dict], None] | None = None):
        super().__init__(daemon=True, name="progress-watcher")
        self.job_dir, self.on_progress, self.every_s = job_dir, on_progress, every_s
        self.on_event = on_event
        self.stopped = threading.Event()
        self._lock = threading.Lock()  # a poll of the thread and report_now never interleave
        self._last: str | None = None
        self._retrying: dict[int, bool] = {}  # attempt number -> retried (report_now)
        self._resume: dict[int, int] = {}  # attempt number -> committed step (report_now)
        self._since = time.time()  # a stop sender recorded before this run is not this run's
        # Only the new bytes are read at each poll (the file grows by a line per step), and
        # only what job_progress looks at is kept: every start, end and checkpoint event, and
        # the current attempt's last WINDOW_STEPS step events.
        self.tail = JsonlTail(Path(job_dir) / "progress.jsonl")
        self._marks: list[dict] = []
        self._steps: collections.deque = collections.deque(maxlen=WINDOW_STEPS)
        # What an earlier run of the job left is read now and never reported: the first line
        # is this run's own attempt (a resumed job's last line was a stale "step N (attempt 1)").
        for event in self.tail.read():
            self._add(event)
        self._starts_before = self._starts()

    def _starts(self) -> int:
        return sum(e.get("event") == "start" for e in self._marks)

    def _add(self, event: dict) -> None:
        if real_number(event.get("time")) is None or integer(event.get("step")) is None:
            return
        kind = event.get("event")
        if kind == "step":
            self._steps.append(event)
        elif kind in ("start", "end", "checkpoint"):
            if kind == "start":
                self._steps.clear()  # job_progress counts the current attempt's steps only
            self._marks.append(event)

    def poll(self) -> None:
        """Report the job's state when it changed since the last report (no repeated lines)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        restarts = self.tail.restarts
        records = self.tail.read()
        if self.tail.restarts != restarts:  # the file was replaced: start over
            self._marks, self._steps = [], collections.deque(maxlen=WINDOW_STEPS)
            self._starts_before = 0
        for event in records:
            self._add(event)
            if self.on_event is not None and event.get("event") in FORWARDED:
                self.on_event(event)
        if self._starts() == self._starts_before:
            return  # this run's first attempt has not started yet
        # The attempt records number the attempts (one that died before its ranks' start event
        # has no event: counting events said "attempt 1" of attempt 2, trial).
        progress = job_progress([*self._marks, *self._steps], AttemptLog(self.job_dir).records())
        if progress is None:
            return
        if progress.state == "training" and stop_reason() is not None:
            return  # stoker run said "stopping" already: a step line after it reads as going on
        ended = progress.attempt in self._retrying  # the caller said this attempt ended
        if ended and progress.state in ("starting", "training"):
            # Its ranks wrote no end event (rank 0 was killed): it ended all the same (trial:
            # no "restarting" line when rank 0 was the one killed).
            progress = dataclasses.replace(progress, state="restarting", eta_s=None,
                                           samples_per_s=None, outcome="infrastructure")
        if progress.state == "completed" and self._retrying.get(progress.attempt):
            # Rank 0 completed, and a peer died before the attempt ended (kill -9 at the last
            # step): the attempt failed and is retried (trial: "…: completed" after "attempt 1
            # ended: infrastructure_failure", and no "restarting" line).
            progress = dataclasses.replace(progress, state="restarting", eta_s=None,
                                           samples_per_s=None, outcome="infrastructure")
        if progress.state == "restarting" and progress.attempt in self._resume:
            # The committed step, not the last checkpoint event: that event comes before its
            # commit (a rank killed in the save: "resuming at step 165", it resumed at 160).
            progress = dataclasses.replace(progress, resume_step=self._resume[progress.attempt])
        message = progress.describe()
        if progress.state == "restarting":  # a stop someone asked for is not a restart
            # ... Ctrl-C to stoker run, or this run's stop request or recorded sender (a Prefect
            # cancel on a worker: it said "restarting (attempt 2 ...)", trial).
            reason = stop_reason() or stop_sender(self.job_dir, self._since)
            if reason:
                message = (f"stopping ({reason}): checkpoint committed at step "
                           f"{progress.resume_step or progress.step}/{progress.total_steps}")
            elif (retrying := self._retrying.get(progress.attempt)) is None:
                return  # the train task says it once it has decided (report_now)
            elif not retrying:  # its retry budget is spent (trial: "restarting" said anyway)
                message = (f"step {progress.step}/{progress.total_steps} (attempt "
                           f"{progress.attempt}): {progress.outcome_name}, no retry left")
        if message != self._last:
            self._last = message
            self.on_progress(progress.percent, message)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self._poll_safely()

    def stop(self) -> None:
        self.stopped.set()
        self._poll_safely()

    def report_now(self, attempt: int | None = None, retrying: bool | None = None,
                   resume_step: int | None = None) -> None:
        """Report what the events say now, from the caller's thread: called as an attempt ends,
        so that its last line comes before the next attempt's (not up to ``every_s`` later,
        after "attempt 2 on ...").

        ``attempt``, ``retrying``: the job's attempt number that just ended and whether it is
        retried. Ranks that ended it to be resumed (preempted, an infrastructure failure they
        found) read as ``restarting (attempt N+1, …)`` only once the caller says a retry
        follows; until then the thread's polls leave that line out, and without a retry it
        reads ``…: infrastructure, no retry left``. ``resume_step``: the job's last committed
        checkpoint step as the attempt ended, where the retry resumes (the ranks' last
        ``checkpoint`` event may name a step whose commit never came)."""
        if attempt is not None and retrying is not None:
            self._retrying[attempt] = retrying
        if attempt is not None and resume_step is not None:
            self._resume[attempt] = resume_step
        self._poll_safely()

    def _poll_safely(self) -> None:
        """A report that fails (the Prefect server restarting) is skipped, not the watcher's end:
        the next poll reports the state then. ``SystemExit`` too: rich, which prints Prefect's
        console lines, raises it on a broken pipe, and in a thread it ends the thread silently."""
        try:
            self.poll()
        except (Exception, SystemExit) as e:  # noqa: BLE001 - progress lines never stop training
            self._last = None  # say it again once it can be said
            log.warning("progress not reported (%s): %s", type(e).__name__, e)


def close_left_open(attempts: AttemptLog, checkpoint_location: str,
                    forward: Callable[[str], None]) -> list[dict]:
    """Close the attempts a dead run left open (``kill -9`` of ``stoker run``, a lost worker)
    and say so, one line each, in the job's ``train.log`` and to ``forward`` (the Prefect log):
    no one captured their output after their run died, and ``progress.jsonl`` says what their
    ranks did (:func:`stoker.jobs.attempts.left_open_note`). Returns the records written."""
    closed = attempts.close_interrupted(left_open=True, checkpoint_location=checkpoint_location)
    if closed:
        lines = LineLog(attempts.job_dir / JOB_LOG, forward)
        try:
            for record in closed:
                lines(left_open_note(record))
        finally:
            lines.close()
    return closed


def tag_outcome(client: MlflowClient, run_id: str | None, record: dict) -> None:
    """Put an ended attempt's ``outcome`` (an attempts.jsonl ``record``: ``stopped``,
    ``interrupted``, ``infrastructure_failure``, ...) on the job's MLflow run as
    ``stoker.last_outcome``, and who stopped it as ``stoker.stopped_by``: the ranks' own tag
    says ``preempted`` for any stop checkpoint, a user's stop included (trial: it differed from
    ``stoker status``). Never raises: tracking must not mask the attempt's outcome."""
    if not run_id or not isinstance(record.get("outcome"), str):
        return
    from mlflow.entities import RunTag

    tags = [RunTag("stoker.last_outcome", record["outcome"])]
    stopped_by = record.get("stopped_by")
    if isinstance(stopped_by, str):
        tags.append(RunTag("stoker.stopped_by", stopped_by))
    try:
        client.log_batch(run_id, tags=tags)  # one request
        if not isinstance(stopped_by, str):
            # An earlier attempt's stop is not the last attempt's (trial: a job the cost guard
            # stopped, resumed and completed still read as guard-stopped in the cost report).
            with contextlib.suppress(Exception):  # no such tag: nothing to clear
                if "stoker.stopped_by" in client.get_run(run_id).data.tags:
                    client.delete_tag(run_id, "stoker.stopped_by")
    except Exception as e:  # noqa: BLE001
        log.warning("could not tag MLflow run %s with the attempt's outcome: %s", run_id, e)


def finish_run(client: MlflowClient, run_id: str | None, status: str) -> None:
    """Close a run an attempt left RUNNING (a SIGKILL gives the runtime no chance to).

    Never raises: a run the store no longer holds (lost with its node) or a store that does
    not answer is a warning naming both, so closing the run never masks how the job ended."""
    if not run_id:
        return
    try:
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=status)
    except Exception as e:  # noqa: BLE001 - tracking must not mask the job's outcome
        from stoker.runtime.tracking import URL_PASSWORD

        store = URL_PASSWORD.sub(r"\1***@", str(client.tracking_uri))
        log.warning("could not end MLflow run %s as %s in the tracking store %s (%s: %s)",
                    run_id, status, store, type(e).__name__,
                    URL_PASSWORD.sub(r"\1***@", " ".join(str(e).split()))[:300])


def stopped(client, run_file: Path, request: StopRequest | None, job: str) -> None:
    """End the MLflow run KILLED and raise :class:`TrainingStopped` with who stopped the job."""
    if run_file.exists():
        finish_run(client, run_file.read_text().strip(), "KILLED")
    reason = request.describe() if request else "stopped on request"
    if request is not None and request.by == "budget":  # stoker.jobs.budget: exit 5
        error = TrainingStopped(f"job {job} {reason}; raise train.max_cost_usd / "
                                "train.max_duration and run the same command to resume it")
        error.by = request.by
        raise error
    raise TrainingStopped(f"job {job} {reason}; run the same command to resume it")
