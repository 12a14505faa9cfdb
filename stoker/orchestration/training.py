"""Train one job: its attempts under the retry policy, their records, the job's MLflow run and
its cost. Plain Python; the ``train`` task (``tasks/train.py``) gives it what only Prefect has
(:class:`FlowRunHooks`): the flow run's logger, events, progress artifact, the attempt task runs
and a watcher of the run's cancel.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mlflow import MlflowClient

from stoker.config import ConfigError, PipelineConfig
from stoker.data.pull import DatasetRef
from stoker.images.build import ImageResult
from stoker.jobs.attempts import AttemptLog, describe_interrupted, lost_steps
from stoker.jobs.billed import record_billed
from stoker.jobs.budget import BudgetWatcher, check_at_start, run_gpu_model, usd_per_hour
from stoker.jobs.job import check_resumable, completed_training, job_store
from stoker.jobs.lease import JobBusy, held_lease
from stoker.jobs.mlflow_run import continue_lost_run, open_job_store
from stoker.jobs.status import JOB_LOG, resuming_line
from stoker.jobs.stop import stop_job
from stoker.jobs.stop_request import (
    TrainingStopped,
    clear_stop_request,
    read_stop_request,
    refuse_stalled,
)
from stoker.jobs.store import RecordSync
from stoker.launch.factory import make_launcher
from stoker.launch.local import discard_standby
from stoker.launch.retry import (
    Attempt,
    Outcome,
    budget_spent,
    describe_exit,
    describe_recorded_exit,
    outcome_of,
    run_with_retries,
    will_retry,
)
from stoker.launch.supervisor import (
    LineLog,
    ProgressWatcher,
    TrainingFailed,
    TrainResult,
    capacity_for,
    close_left_open,
    finish_run,
    lineage_tags,
    nodes,
    nproc,
    stopped,
    tag_outcome,
    write_spec,
)
from stoker.orchestration.hooks import (  # noqa: F401 - re-exported: the task's names
    AttemptEnd,
    FlowRunHooks,
    lease_lost_line,
)
from stoker.runtime import CheckpointWriteError
from stoker.runtime.preemption import SENDER_PREFIX, mark_stopped_at_once, record_stop_sender
from stoker.runtime.progress import read_events
from stoker.runtime.records import read_json, read_text
from stoker.runtime.spec import RunSpec
from stoker.stopping import (
    note_outcome,
    on_interrupt,
    on_stop,
    on_stop_at_once,
    outcome_probe,
    ranks_training,
    stop_reason,
)
from stoker.tracking.cost import steps_lost
from stoker.tracking.events import straggler_notice, training_event
from stoker.tracking.spend import log_completed_cost, log_stopped_cost


def _said_of(job_dir: Path, what: str | None) -> str | None:
    """``what`` the stop left, as ``stoker run``'s last line names it: ``job NAME: what``."""
    return f"job {job_dir.name}: {what}" if what else None


class TrainingRun:
    """One run of the train task over a leased job folder: launch attempts until one completes
    or the retry budget is spent, record each, and price the job.

    Args:
        config: the pipeline config.
        dataset: the pulled dataset.
        image: the training image, for container launchers (None: local).
        job_dir: the job folder, leased by this process (:class:`stoker.jobs.job.JobClaim`).
        hooks: the orchestrator's side (:class:`FlowRunHooks`).
    """

    def __init__(self, config: PipelineConfig, dataset: DatasetRef, image: ImageResult | None,
                 job_dir: Path, hooks: FlowRunHooks):
        self.config, self.dataset, self.image = config, dataset, image
        self.job_dir, self.hooks, self.log = Path(job_dir), hooks, hooks.logger
        self.codes: dict[int, int] = {}
        self.rank_errors: dict[int, str | None] = {}  # attempt -> the first ERROR line of a rank
        self.ended_by: dict[int, int | None] = {}  # attempt -> the rank whose exit 137 ended it
        self.killed: dict[int, str | None] = {}  # attempt -> which rank a signal ended, in words
        self.hangs: dict[int, str | None] = {}  # attempt -> the hang watchdog's summary
        self.capacities: dict[int, str] = {}
        self.this_run: list[Attempt] = []  # this run's attempts so far, for the retry decision

    @property
    def run_id(self) -> str | None:
        return read_text(self.run_file)

    def prepare(self) -> None:
        """Everything before the first attempt: the stall guard, the dead owner's flow run, the
        spec, the launcher, the MLflow client, and the attempts a dead run left open."""
        config, job_dir, log = self.config, self.job_dir, self.log
        stall = refuse_stalled(job_dir, config.retry.resume_stalled)  # raises unless overridden
        if stall is not None:
            log.warning("resuming job %s although it %s (retry.resume_stalled=true)",
                        job_dir.name, stall.describe())
        self.lease = held_lease(job_dir)
        if self.lease.previous:  # the owner died: its flow run would stay Running forever
            self.hooks.crash_orphan(self.lease.previous.get("flow_run_id"))
        self.world_size = nproc(config)  # processes per node
        # Devices billed: every node's (trial: a 2-node Slurm job was priced as one node's).
        self.devices = self.world_size * nodes(config)
        tags = lineage_tags(config, self.dataset, self.world_size, self.image,
                            self.hooks.flow_run_id, self.hooks.flow_run_url)
        check_resumable(job_dir, config, self.dataset.md5)  # its own data and trajectory
        self.spec_path = write_spec(config, self.dataset, job_dir, self.world_size, tags,
                                    self.lease.token)
        log.info("job %s: %d process(es) per node, spec %s", job_dir.name, self.world_size,
                 self.spec_path)
        # The docker launcher runs the CUDA preflight before each GPU container, whatever the
        # image.
        self.launcher = make_launcher(config, self.world_size,
                                      self.image.pinned_ref if self.image else None)
        open_job_store(config.tracking_uri(), job_dir)  # unusable: one line naming it, exit 2
        self.client = MlflowClient(config.tracking_uri())
        self.run_file = job_dir / "mlflow_run_id"
        self.attempts_log = AttemptLog(job_dir)
        self.checkpoints = RunSpec.load(self.spec_path).checkpoint_location
        left = close_left_open(self.attempts_log, self.checkpoints, log.warning)
        if left:  # billed now: stoker jobs' COST
            record_billed(job_dir, self.devices, config.cost.prices)
        # The recorded run gone with its store (a lost node's work_dir): a new run, linked.
        continued = continue_lost_run(RunSpec.load(self.spec_path), self.attempts_log.history(),
                                      read_events(job_dir), self.devices)
        if continued is not None:
            log.warning(continued.line())
        if left and left[-1].get("steps_lost"):
            self.log_steps_lost(left[-1].get("reached_step", 0))
        self.finished = completed_training(job_dir)  # the orchestrator died after the ranks
        if self.finished is None:  # a spent budget launches nothing (one line, exit 5)
            check_at_start(job_dir, config.train.max_cost_usd, config.train.max_duration,
                           config.cost.prices)
            if (resuming := resuming_line(job_dir, self.checkpoints)) is not None:
                log.info(resuming)  # in words: a stopped job goes on (trial: "attempt 2" only)
        if self.finished is not None:
            log.info("job %s: training already completed (step %d/%d); going on to "
                     "registration without launching", job_dir.name, self.finished["step"],
                     self.finished["total_steps"])
        self.first_number = self.attempts_log.next_number()
        self.preempted = sum(a["outcome"] == Outcome.PREEMPTED
                             for a in self.attempts_log.history())
        # Our own deadline, not Prefect's timeout_seconds: a sync task's timeout cannot
        # interrupt a blocking wait, while the launcher's wait(timeout) ends the attempt and
        # its process tree.
        self.deadline = (time.monotonic() + config.train_timeout_s) \
            if config.train_timeout_s else None

    def log_steps_lost(self, reached: int) -> None:
        """The job's steps lost so far (:func:`steps_lost`) on its MLflow run, at the step the
        attempt that lost them reached (a flow run that died mid-attempt: kill -9, a second
        Ctrl-C, as a live run's would have)."""
        try:
            if self.run_id:
                self.client.log_metric(self.run_id, "steps_lost", steps_lost(
                    self.attempts_log.history(), read_events(self.job_dir)), step=reached)
        except Exception as e:  # tracking must not mask the attempt's outcome
            self.log.warning("could not log steps_lost to MLflow: %s", e)

    def attempt(self, number: int, capacity_type: str,
                logger: logging.Logger | logging.LoggerAdapter) -> AttemptEnd:
        """Launch attempt ``number`` and wait for it; its lines go to ``train.log`` and, at the
        ranks' levels, to ``logger`` (the attempt's task run).

        Raises:
            TimeoutError: ``train_timeout_s`` was reached (the process tree is terminated).
        """
        from stoker.launch.supervisor import at_rank_level

        lines = LineLog(self.job_dir / JOB_LOG, at_rank_level(logger))
        lines(f"attempt {number} on {capacity_type} capacity")
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            try:
                self.codes[number] = self.launcher.run(self.spec_path, on_line=lines,
                                                       timeout_s=left)
            finally:
                lines.close()
                self.rank_errors[number] = lines.first_error
                self.ended_by[number] = lines.ended_by_rank
                self.killed[number] = lines.killed
                self.hangs[number] = lines.hang
        except (subprocess.TimeoutExpired, TimeoutError):
            raise TimeoutError(f"train_timeout_s={self.config.train_timeout_s:g} s reached: job "
                               f"{self.job_dir.name} stopped (process tree terminated)") from None
        code = self.codes[number]
        request = read_stop_request(self.job_dir)
        ended = Attempt(number, code, outcome_of(code, request is not None),
                        0.0, 0.0)  # for the retry decision only (record() keeps the real one)
        return AttemptEnd(code, request, self.ended_by.get(number),
                          retried=will_retry(self.config.retry, [*self.this_run, ended]))

    def launch(self, number: int) -> int:
        """Attempt ``number`` of this run (numbered over every run of the job when recorded):
        refused when the lease was lost or the flow run was cancelled before it; else recorded
        as started, announced, and run as its own task run. Returns its exit code."""
        job_dir, cancels = self.job_dir, self.hooks.cancels
        if self.lease.lost:  # another run took the job over: never launch a second trainer
            raise JobBusy(f"job {job_dir.name}: lease lost ({self.lease.lost}); not launching")
        if cancels is not None and (by := cancels.cancelled_by()) is not None:
            raise TrainingStopped(f"job {job_dir.name} stopped by {by} before attempt "
                                  f"{number + self.first_number - 1} started; run the same "
                                  "command to resume it")
        if number == 1:
            clear_stop_request(job_dir)  # an earlier run's stop request is not this run's
        number += self.first_number - 1  # numbering continues over every run of the job
        capacity = self.capacities[number] = capacity_for(self.config, self.preempted)
        self.attempts_log.start(number, capacity, self.hooks.flow_run_id,
                                self.config.launcher.kind)
        self.hooks.emit(**training_event("started" if number == 1 else "resumed", job_dir.name,
                                         self.run_id, attempt=number, capacity_type=capacity))
        return self.hooks.run_attempt(number, capacity,
                                      lambda logger: self.attempt(number, capacity, logger))

    def record(self, attempt: Attempt) -> None:
        """Close ``attempt`` in the job's records and on its MLflow run, and say how it ended.

        Raises:
            JobBusy: this run was stalled past its lease and another run took the job over
                (nothing is written then: the job is that run's).
        """
        job_dir, log = self.job_dir, self.log
        number = attempt.number + self.first_number - 1
        if not self.lease.check():  # stalled past its lease (kill -STOP): another run's job
            raise JobBusy(lease_lost_line(job_dir, self.lease.lost, number))
        self.preempted += attempt.outcome == Outcome.PREEMPTED
        lost, reached, committed = (0, 0, 0) if attempt.outcome == Outcome.COMPLETED \
            else lost_steps(job_dir, attempt.started, self.checkpoints)
        request = read_stop_request(job_dir) if attempt.outcome == Outcome.STOPPED else None
        ended = {**attempt.to_dict(), "capacity_type": self.capacities[number],
                 "steps_lost": lost,
                 # what steps_lost was measured from (stoker.tracking.cost.attempt_steps_lost)
                 **({"reached_step": reached, "committed_step": committed}
                    if attempt.outcome != Outcome.COMPLETED else {}),
                 **({"ended_by_rank": self.ended_by[number]}
                    if self.ended_by.get(number) is not None else {}),
                 **({"hang": self.hangs[number]} if self.hangs.get(number) else {}),
                 **({"killed": self.killed[number]} if self.killed.get(number) else {}),
                 # `stoker status`: who stopped it, as for a Ctrl-C (trial)
                 **({"stopped_by": f"{request.by}: {request.reason}"}
                    if request is not None else {})}
        self.attempts_log.end(number, ended)
        record_billed(job_dir, self.devices, self.config.cost.prices)
        tag_outcome(self.client, self.run_id, ended)  # as attempts.jsonl says, on MLflow
        if lost:
            log.warning("attempt %d lost %d step(s): it reached step %d, the last committed "
                        "checkpoint is step %d", number, lost, reached, committed)
            self.log_steps_lost(reached)
        if attempt.outcome == Outcome.PREEMPTED:
            self.hooks.emit(**training_event("preempted", job_dir.name, self.run_id,
                                             attempt=number, exit_code=attempt.exit_code))
        # A stop someone asked for is no warning (a Ctrl-C's attempt line is INFO too).
        level = log.info if attempt.outcome in (Outcome.COMPLETED, Outcome.STOPPED) \
            else log.warning
        level("attempt %d ended: %s (exit %s) after %.1f s", number, attempt.outcome,
              describe_exit(attempt.exit_code, self.ended_by.get(number),
                            self.hangs.get(number), self.killed.get(number)),
              attempt.duration_s)
        # Its last progress line ("restarting ...", or "no retry left"), after the line above
        # and before the next attempt starts (the watcher alone could say it up to 5 s later,
        # after "attempt N+1 on").
        self.this_run.append(attempt)
        self.watcher.report_now(number, will_retry(self.config.retry, self.this_run),
                                resume_step=None if attempt.outcome == Outcome.COMPLETED
                                else committed)
        if attempt.outcome == Outcome.INFRASTRUCTURE and self.run_id:
            finish_run(self.client, self.run_id, "KILLED")

    def stopped_by(self, error: BaseException) -> str | None:
        """Who stopped the training by interrupting its flow: a signal to ``stoker run`` or a
        Prefect cancel; None for anything else (a timeout, a bug)."""
        return stop_reason() if stop_reason() is not None else self.hooks.stopped_by(error)

    def _rank_event(self, record: dict) -> None:
        """A ranks' straggler event: a WARNING in the flow run's log and a
        ``stoker.training.straggler`` Prefect event."""
        notice = straggler_notice(self.job_dir.name, self.run_id, record)
        if notice is None:
            return
        line, event = notice
        self.log.warning(line)
        if self.hooks.flow_run_id:  # emitted from the watcher's thread: no run context there
            event["related"].append({"prefect.resource.id":
                                     f"prefect.flow-run.{self.hooks.flow_run_id}",
                                     "prefect.resource.role": "flow-run"})
        self.hooks.emit(**event)

    def _record_sender(self, error: BaseException) -> None:
        """The orchestrator's word on who stops it (a Prefect cancel), for the ranks' stop
        line (``stop requested (SIGTERM: a Prefect cancel of flow run 'brave-fox')``)."""
        sender = self.hooks.stopped_by(error)
        if sender is not None:
            record_stop_sender(self.job_dir, sender)

    def run(self, progress: Callable[[], Callable[[float, str], None]]) -> TrainResult:
        """Prepare, train with retries, and finish: the job's :class:`TrainResult`.
        ``progress()`` makes the progress sink (a Prefect progress artifact) once the job is
        ready to train.

        Raises:
            JobBusy: another run took the job over.
            TrainingStopped: a stop request (the cost guard, ``stoker stop``) ended it.
            TrainingFailed, ConfigError, CheckpointWriteError: the last attempt did not
                complete (the message lists every attempt, or names the ranks' error).
        """
        self.prepare()
        job_dir, cancels = self.job_dir, self.hooks.cancels
        self.watcher = ProgressWatcher(job_dir, progress(), on_event=self._rank_event)
        self.watcher.start()
        train = self.config.train
        budget = BudgetWatcher(job_dir, train.max_cost_usd, train.max_duration,
                               self.config.cost.prices, self.devices,
                               lambda: run_gpu_model(self.client, self.run_file), self.log.info,
                               stop=stop_job, warn=self.log.warning)
        if train.max_cost_usd or train.max_duration:  # spend against budget
            budget.start()
        if cancels is not None:  # a cancel that no worker carries out still stops the job
            cancels.start()
        store = job_store(self.config)
        sync = RecordSync(store, job_dir) if store is not None else None
        if sync is not None:  # attempts, heartbeat, MLflow run id reach the bucket
            sync.start()
        try:
            attempts = self._attempts()
        except BaseException as e:  # cancelled or timed out: the tree is gone, close the run
            if isinstance(e, JobBusy) or not self.lease.check():
                raise  # the job is another run's now: its attempts, records and MLflow run too
            self._close_interrupted(e)
            raise
        finally:
            discard_standby()  # a launcher parked for a retry that did not come
            self.watcher.stop()
            if budget.is_alive():
                budget.stop()
            if cancels is not None:
                cancels.stop()
            if sync is not None:
                sync.stop()
        return self.finish(attempts, budget)

    def _attempts(self) -> list[Attempt]:
        """This run's attempts, under the retry policy (none when training had completed)."""
        job_dir = self.job_dir
        # Ctrl-C, SIGTERM or SIGHUP to stoker run: the ranks' stop line says so (they see a
        # SIGTERM from the launcher). On a worker a Prefect cancel is a SIGTERM to this
        # process, raised as Prefect's TerminationSignal into the launcher's wait: the ranks'
        # stop line names it too.
        with on_stop(lambda reason: record_stop_sender(job_dir, f"{SENDER_PREFIX}{reason}")), \
                on_stop_at_once(lambda: mark_stopped_at_once(job_dir)), \
                ranks_training(self.attempts_log.ranks_training), \
                on_interrupt(self._record_sender), \
                outcome_probe(lambda: _said_of(job_dir, self.attempts_log.open_attempt_end(
                    self.checkpoints))):
            return [] if self.finished is not None else run_with_retries(
                self.launch, self.config.retry, on_attempt=self.record,
                stop_requested=lambda: read_stop_request(job_dir) is not None)

    def _close_interrupted(self, error: BaseException) -> None:
        """Record the attempt a stop interrupted now (billed time, what the ranks did), not
        by the next run, with who stopped it (``stoker jobs`` then says stopped, not
        unfinished); end the MLflow run KILLED."""
        with contextlib.suppress(Exception):
            closed = self.attempts_log.close_interrupted(stopped_by=self.stopped_by(error))
            record_billed(self.job_dir, self.devices, self.config.cost.prices)
            if closed and (what := describe_interrupted(closed[-1])):
                note_outcome(f"job {self.job_dir.name}: {what}")  # stoker run's last line
            if closed and closed[-1].get("steps_lost"):  # its stop checkpoint did not commit
                self.log_steps_lost(closed[-1].get("reached_step", 0))
            if closed:
                tag_outcome(self.client, self.run_id, closed[-1])
        if self.run_id:
            finish_run(self.client, self.run_id, "KILLED")

    def finish(self, attempts: list[Attempt], budget: BudgetWatcher) -> TrainResult:
        """After the last attempt: raise how a job that did not complete ended (a stopped
        one's cost so far on its MLflow run), or price a completed one on its MLflow run and
        return its result."""
        job_dir, prices = self.job_dir, self.config.cost.prices
        history = self.attempts_log.history()  # every attempt of the job, any flow run's
        if attempts and attempts[-1].outcome == Outcome.STOPPED:
            model = budget.gpu_model_known() or run_gpu_model(self.client, self.run_file)
            log_stopped_cost(self.client, self.run_id, history, self.devices, model, prices,
                             usd_per_hour(self.config, self.devices, model, self.capacities),
                             read_events(job_dir))
            stopped(self.client, self.run_file, read_stop_request(job_dir), job_dir.name)
        if attempts and attempts[-1].outcome != Outcome.COMPLETED:
            self._failed(attempts, history)
        result = read_json(job_dir / "result.json")
        if not isinstance(result, dict) or "run_id" not in result:
            raise TrainingFailed(f"job {job_dir.name}: {job_dir / 'result.json'} missing or "
                                 "unreadable after a completed attempt")
        report = log_completed_cost(self.client, result, history, read_events(job_dir),
                                    self.devices, prices)
        self.log.info("cost: %.4f device-hours on %s, $%.4f, goodput %.2f, %d preemption(s), "
                      "%d step(s) lost", report.gpu_hours, report.gpu_model, report.cost_usd,
                      report.goodput, report.preemptions, report.steps_lost)
        self.hooks.emit(**training_event("completed", job_dir.name, result["run_id"],
                                         step=result.get("step"), attempts=report.attempts,
                                         preemptions=report.preemptions))
        return TrainResult(str(job_dir), result["run_id"], result["metrics"], result, history,
                           report.summary())

    def _failed(self, attempts: list[Attempt], history: list[dict]) -> None:
        """Raise how the job's last attempt failed (its MLflow run ends FAILED)."""
        job_dir = self.job_dir
        if self.run_id:
            finish_run(self.client, self.run_id, "FAILED")
        summary = ", ".join(
            f"#{a['number']} {a['outcome']} "
            f"(exit {describe_recorded_exit(a)})"
            for a in history[-len(attempts):])
        self.hooks.emit(**training_event("failed", job_dir.name, self.run_id,
                                         attempts=len(history), outcome=str(attempts[-1].outcome),
                                         exit_code=attempts[-1].exit_code))
        error = self.rank_errors.get(attempts[-1].number + self.first_number - 1)
        if attempts[-1].exit_code == 2 and error:  # the ranks named bad input: say it
            raise ConfigError(f"{error} (job {job_dir.name}; its output: stoker logs "
                              f"{job_dir.name})")
        if attempts[-1].outcome == Outcome.STORAGE and error:  # a full disk: the ranks' line
            raise CheckpointWriteError(f"{error} (job {job_dir.name}; its output: stoker logs "
                                       f"{job_dir.name})")
        spent = budget_spent(self.config.retry, attempts)
        raise TrainingFailed(
            f"job {job_dir.name} did not complete: {summary}" + (
                f"; no retry left ({spent}); once its cause is fixed, the same command "
                "resumes from the last checkpoint"
                if spent else ""))
