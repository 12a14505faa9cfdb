"""A training job's state, in one folder: its key and folder, lease, attempt log, record store,
stop requests and the status a user reads.

A job is one folder, ``<work_dir>/jobs/<key>-<time>/`` (the key hashes what decides its
trajectory; :func:`stoker.jobs.job.job_key`), or its copy in a bucket
(``checkpoint_dir=s3://...``). :class:`Job` is the small public face; the modules behind it:

- :mod:`stoker.jobs.job`: the key, the folder, :class:`~stoker.jobs.job.JobClaim` (a flow run's
  ownership of its job), resume checks, the done marker.
- :mod:`stoker.jobs.lease` / :mod:`stoker.jobs.bucket_lease`: one trainer per job (a renewed
  lease in the folder, and in the bucket for a job that lives in one).
- :mod:`stoker.jobs.attempts`: ``attempts.jsonl``, one record per attempt.
- :mod:`stoker.jobs.store`: the records' copy in a bucket.
- :mod:`stoker.jobs.stop_request` / :mod:`stoker.jobs.stop`: ``stop-requested.json`` and
  ``stoker stop``.
- :mod:`stoker.jobs.status` / :mod:`stoker.jobs.processes`: what ``stoker jobs`` and ``stoker
  status`` show.

The records the ranks write themselves (``progress.jsonl``, ``heartbeat.json``, ``lease.json``
as the ranks read it) are read and written through :mod:`stoker.runtime.records`, which runs in
the training image too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.config import PipelineConfig
from stoker.jobs.attempts import AttemptLog
from stoker.jobs.job import JobClaim, done_summary
from stoker.jobs.lease import JobBusy
from stoker.jobs.processes import JobProcesses, job_processes
from stoker.jobs.status import JobSummary, job_summary
from stoker.jobs.stop_request import StopRequest, read_stop_request, request_stop
from stoker.runtime.lease import read_lease


@dataclass(frozen=True)
class Job:
    """One job folder, and what can be done with it.

    Attributes:
        path: the job folder (``<work_dir>/jobs/<key>-<time>``).
    """

    path: Path

    @property
    def name(self) -> str:
        """The folder's name: what ``stoker status NAME``, Slurm comments, container labels and
        process titles call the job."""
        return self.path.name

    @classmethod
    def named(cls, work_dir: Path, name: str) -> Job:
        """The job folder ``name`` of ``work_dir`` (``<work_dir>/jobs/<name>``), as ``stoker
        status NAME -w WORK_DIR`` reads it; it need not exist yet."""
        return cls(Path(work_dir) / "jobs" / name)

    @staticmethod
    def claim(config: PipelineConfig, flow_run_id: str | None = None) -> JobClaim:
        """Own the job of ``config`` (a context manager: leased on entry with ``job_id``, or by
        ``bind(dataset_md5)`` after the pull; released on exit, however the flow ends).

        Raises:
            JobBusy: another live run holds the job (one line naming it).
        """
        return JobClaim(config, flow_run_id)

    def begin_attempt(self, number: int, capacity_type: str, flow_run_id: str | None = None,
                      launcher: str | None = None) -> None:
        """Record attempt ``number`` as started, before it is launched (``launcher``: its
        kind, ``local``/``docker``/``kubernetes``/``slurm``). For an orchestrator that holds
        the job's lease (:meth:`claim`); anyone else would corrupt the job's records."""
        AttemptLog(self.path).start(number, capacity_type, flow_run_id, launcher)

    def end_attempt(self, number: int, outcome: dict[str, Any]) -> None:
        """Close attempt ``number`` with its outcome record (``exit_code``, ``outcome``,
        ``started`` and ``duration_s`` in seconds, ``capacity_type``: the fields of
        :meth:`stoker.launch.retry.Attempt.to_dict`). For the lease holder only, as
        :meth:`begin_attempt`."""
        AttemptLog(self.path).end(number, outcome)

    def attempts(self) -> list[dict[str, Any]]:
        """Every attempt so far, oldest first (open ones too: ``state`` ``started``)."""
        return AttemptLog(self.path).records()

    def request_stop(self, by: str, reason: str, verdict: str | None = None) -> StopRequest:
        """Ask the job to stop: writes ``stop-requested.json`` only. ``by`` names who asks
        (``user``, ``cost-guard``, ``budget``), ``verdict`` is the guard's (``idle``,
        ``stalled``). The ranks stop at their next check of it only once signalled; the retry
        policy then ends the job as stopped, not preempted. ``stoker stop`` writes this and
        signals the launcher (:func:`stoker.jobs.stop.stop_job`)."""
        return request_stop(self.path, by, reason, verdict)

    def stop_request(self) -> StopRequest | None:
        """The stop someone asked for, or None."""
        return read_stop_request(self.path)

    def lease(self) -> dict[str, Any] | None:
        """The lease record (who trains it, until when), or None."""
        return read_lease(self.path)

    def done(self) -> dict | None:
        """The done job's summary (``pipeline_done.json``), or None while it is not done."""
        return done_summary(self.path)

    def status(self, bucket_lease: dict | None = None) -> JobSummary:
        """What ``stoker status`` shows: state, progress, attempts, cost (never raises on a
        torn record); ``bucket_lease``: its lease in the bucket, for a job that lives in one."""
        return job_summary(self.path, bucket_lease=bucket_lease)

    def processes(self) -> JobProcesses:
        """PIDs of its processes on this host (lease holder, launcher, ranks)."""
        return job_processes(self.path)


__all__ = ["Job", "JobBusy", "JobClaim", "JobProcesses", "JobSummary", "StopRequest"]
