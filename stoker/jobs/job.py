"""Job identity: the same command resumes an unfinished job and starts a new one otherwise.

A job lives in ``<work_dir>/jobs/<key>-<UTC time>/``; ``key`` hashes what defines the training
trajectory (train config fields that change results, and the dataset content hash). A job whose
folder has no ``pipeline_done.json`` is unfinished: running the pipeline again with the same key
continues it from its last committed checkpoint. Processes per node are not part of the key, so
a job can resume at another world size. With a top-level ``checkpoint_dir`` (a bucket) the job
also lives there (``stoker.jobs.store``): unfinished jobs are found there by key, the local
folder is filled from it, and the job is leased there too (``BucketLease``), so the same command
resumes the job on another machine.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import re
from pathlib import Path

from stoker.config import PipelineConfig
from stoker.jobs.bucket_lease import BucketLease
from stoker.jobs.lease import JobLease, check_free, holder_alive
from stoker.jobs.store import JobStore, disown, own, write_through
from stoker.runtime.lease import read_lease
from stoker.runtime.records import read_json, write_json
from stoker.runtime.spec import TRAJECTORY_FIELDS

log = logging.getLogger(__name__)

DONE_MARKER = "pipeline_done.json"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def job_key(config: PipelineConfig, dataset_md5: str) -> str:
    """12 hex digits of sha256 over the trajectory-defining config and the dataset hash."""
    train = config.train.model_dump(mode="json")
    payload = {f: train[f] for f in TRAJECTORY_FIELDS}
    payload |= {"dataset": dataset_md5, "experiment": config.experiment()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def job_store(config: PipelineConfig) -> JobStore | None:
    """The job store of ``config`` (None without a ``checkpoint_dir``)."""
    url = config.job_store_url()
    return JobStore(url) if url else None


def resolve_job_dir(config: PipelineConfig, dataset_md5: str | None) -> Path:
    """The folder of the job to run: ``config.job_id`` if given, else the newest unfinished job
    with the same key, else a new one.

    Raises:
        ValueError: ``job_id`` is not a plain folder name, or neither it nor the dataset hash
            is given.
    """
    jobs = config.work_dir.resolve() / "jobs"
    if config.job_id:
        if not _JOB_ID.match(config.job_id):
            raise ValueError(f"job_id {config.job_id!r}: use letters, digits, '.', '_' or '-'")
        return jobs / config.job_id
    if dataset_md5 is None:
        raise ValueError("resolve_job_dir: without job_id the dataset hash picks the job")
    key = job_key(config, dataset_md5)
    unfinished = [p.name for p in jobs.glob(f"{key}-*") if not (p / DONE_MARKER).exists()]
    store = job_store(config)
    if store is not None:  # the bucket knows every node's jobs; a local folder may be stale
        unfinished = [n for n in unfinished if not store.is_done(n)] + store.unfinished(key)
    if unfinished:
        return jobs / sorted(set(unfinished))[-1]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return jobs / f"{key}-{stamp}"


def check_resumable(job_dir: Path, config: PipelineConfig, dataset_md5: str) -> None:
    """Refuse to go on with a job (named by ``job_id``) on another dataset or trajectory than
    its own ``spec.yaml`` records: resuming would train on other data (and register a model whose
    lineage tags name only the first) or fail in the ranks. No spec yet: a new job, accepted.

    Raises:
        ConfigError: naming the job, each difference (dataset hash, ``train.<field>``), and what
            to do.
    """
    from stoker.config import ConfigError
    from stoker.runtime.spec import RunSpec

    path = job_dir / "spec.yaml"
    if not path.is_file():
        return
    try:
        old = RunSpec.load(path)
    except ConfigError:
        return  # unreadable: the ranks' own trajectory check still stands
    changes = []
    old_md5 = old.tags.get("dvc.md5", "")
    if old_md5 and old_md5.removesuffix(".dir") != dataset_md5.removesuffix(".dir"):
        was = f"{old.tags.get('dvc.path', 'data')}@{old.tags.get('dvc.rev', '?')}"
        changes.append(f"dataset: {was} ({old_md5.removesuffix('.dir')}) -> "
                       f"{config.data.path}@{config.data.rev} "
                       f"({dataset_md5.removesuffix('.dir')})")
    old_train, now = old.train.model_dump(mode="json"), config.train.model_dump(mode="json")
    changes += [f"train.{f}: {old_train[f]!r} -> {now[f]!r}" for f in TRAJECTORY_FIELDS
                if old_train.get(f) != now.get(f)]
    if changes:
        raise ConfigError(
            f"job {job_dir.name} cannot go on with other data or settings ({'; '.join(changes)}):"
            f" run it with its own settings (in {path}) or leave job_id out to start a new job")


def completed_training(job_dir: Path) -> dict | None:
    """The job's ``result.json`` when its training already ran to the end, else None.

    That is the case when the orchestrator died after the ranks finished and before the
    pipeline was done (registration, report): the next run goes on from there instead of
    launching torchrun again for a 0-step attempt (seconds of start-up, billed). It holds when
    ``result.json`` is whole, names an MLflow run, was written at its last step, its final
    weights exist, and the job's last ``end`` progress event says ``completed`` at that step.
    """
    from stoker.runtime.progress import read_events

    result = read_json(job_dir / "result.json")
    if not isinstance(result, dict) or not result.get("run_id"):
        return None
    step, total = result.get("step"), result.get("total_steps")
    if not isinstance(step, int) or step != total:
        return None
    if not Path(str(result.get("model_path", ""))).is_file():
        return None
    ends = [e for e in read_events(job_dir) if e.get("event") == "end"]
    if not ends or ends[-1].get("outcome") != "completed" or ends[-1].get("step") != step:
        return None
    return result


def mark_done(job_dir: Path, summary: dict) -> None:
    """Record that the pipeline finished this job (training, registration, report)."""
    write_json(job_dir / DONE_MARKER, summary)
    write_through(job_dir, DONE_MARKER)


def done_summary(job_dir: Path) -> dict | None:
    """The summary of a done job (its ``pipeline_done.json``), or None while it is not done.

    A done marker that a crash truncated still means done: its summary is then ``{}``."""
    if not (job_dir / DONE_MARKER).exists():
        return None
    summary = read_json(job_dir / DONE_MARKER, default={})
    return summary if isinstance(summary, dict) else {}


class JobClaim:
    """A flow run's ownership of its job, from before anything in the job folder is written
    until the flow ends (after the job is marked done).

    With ``config.job_id`` the job is known before the dataset is pulled: entering the claim
    leases it at once, or refuses at once (``JobBusy``), or finds it done (``done`` holds its
    summary and nothing is leased). Without it, ``bind(dataset_md5)`` picks and leases the job
    after the pull. Leaving the claim releases the lease, however the flow ends.

    Args:
        config: the pipeline config (``work_dir``, ``job_id``, ``job_lease_s``).
        flow_run_id: the orchestrator run, recorded in the lease for whoever is refused.
    """

    def __init__(self, config: PipelineConfig, flow_run_id: str | None = None):
        self.config, self.flow_run_id = config, flow_run_id
        self.lease: JobLease | None = None
        self.bucket_lease: BucketLease | None = None
        self.store = job_store(config)
        self.done: dict | None = None

    @property
    def job_dir(self) -> Path | None:
        return self.lease.job_dir if self.lease else None

    def take(self, job_dir: Path) -> Path:
        """Lease ``job_dir`` itself (a job chosen elsewhere); see ``bind``."""
        return self._take(Path(job_dir))

    def _take(self, job_dir: Path) -> Path:
        if self.store is not None and self.store.is_done(job_dir.name):
            self.store.pull(job_dir.name, job_dir)  # done on another node: its summary
        summary = done_summary(job_dir)  # a done job needs no lease: it is never trained again
        if summary is None:
            check_free(job_dir)  # refuse before creating anything
            self.lease = JobLease(job_dir, self.config.job_lease_s, self.flow_run_id).acquire()
            if self.store is not None:
                self._take_in_store(job_dir)
            summary = done_summary(job_dir)  # finished by the owner we just followed?
            if summary is not None:
                self._release()
        if summary is not None:
            self.done = {**summary, "already_done": True, "job_dir": str(job_dir)}
            log.warning("job %s is already done (%s); nothing to do", job_dir.name,
                        job_dir / DONE_MARKER)
        return job_dir

    def _take_in_store(self, job_dir: Path) -> None:
        """Lease the job in the bucket too, then fill the local cache from it."""
        try:
            self.bucket_lease = BucketLease(self.store, job_dir.name, self.config.job_lease_s,
                                            self.flow_run_id, self._bucket_lease_lost,
                                            token=self.lease.token, job_dir=job_dir).acquire()
        except BaseException:
            self._release()
            raise
        own(job_dir, self.store, self.bucket_lease.check)
        copied = self.store.pull(job_dir.name, job_dir)
        if copied:
            log.info("job %s: records from %s: %s", job_dir.name, self.store.url,
                     ", ".join(copied))

    def _bucket_lease_lost(self, reason: str) -> None:
        """Another node owns the job now: give up the local lease too, so that no attempt is
        launched and the running one checkpoints and stops (it watches the local lease)."""
        lease = self.lease
        if lease is not None:
            lease.lost = f"bucket lease {reason}"
            lease.release()

    def _release(self) -> None:
        if self.bucket_lease is not None:
            if self.lease is not None:
                disown(self.lease.job_dir)
            self.bucket_lease.release()
            self.bucket_lease = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def __enter__(self) -> JobClaim:
        if self.store is not None:
            self.store.check()  # wrong credentials or no bucket: one named error, at once
        if self.config.job_id:
            self._take(resolve_job_dir(self.config, None))
        return self

    def bind(self, dataset_md5: str) -> Path:
        """The job folder, leased: the one named by ``job_id`` or picked by the dataset hash.

        Raises:
            JobBusy: another live run holds the unfinished job of this config.
        """
        if self.lease is not None:
            return self.lease.job_dir
        job_dir = resolve_job_dir(self.config, dataset_md5)
        return self._take(job_dir)

    def __exit__(self, *exc) -> None:
        if self.store is not None and self.bucket_lease is not None:
            try:  # the done marker and final records, while the job is still ours
                self.store.push(self.lease.job_dir)
            except Exception as e:  # the bucket down now: the records catch up next run
                log.warning("job %s: final records not pushed to %s (%s)",
                            self.lease.job_dir.name, self.store.url, type(e).__name__)
        self._release()


def job_owner(job_dir: Path) -> dict | None:
    """The live lease on ``job_dir`` (who trains it now), or None."""
    lease = read_lease(job_dir)
    return lease if lease is not None and holder_alive(lease) else None


def check_job_early(config: PipelineConfig) -> dict | None:
    """Before a flow starts: with ``job_id``, refuse a busy job or return a done job's summary
    (None otherwise). Reads only; the flow's ``JobClaim`` makes the binding decision.

    Raises:
        JobBusy: a live run owns the job (one line naming it).
        TrainingStopped: the cost guard stopped the job for a stall and the config does not
            say ``retry.resume_stalled`` (one line naming the step).
    """
    if not config.job_id:
        _check_unnamed_job_free(config)
        return None
    job_dir = resolve_job_dir(config, None)
    summary = done_summary(job_dir)
    if summary is not None:
        return {**summary, "already_done": True, "job_dir": str(job_dir)}
    check_free(job_dir)
    from stoker.jobs.stop_request import refuse_stalled

    refuse_stalled(job_dir, config.retry.resume_stalled)
    from stoker.jobs.budget import check_at_start

    check_at_start(job_dir, config.train.max_cost_usd, config.train.max_duration,
                   config.cost.prices)  # a spent budget: before the pull
    return None


def _check_unnamed_job_free(config: PipelineConfig) -> None:
    """Without ``job_id``, the dataset hash picks the job; for a data repository on this
    machine (the demo one too, once made) it is read from the repository without a pull, so a
    job that another live run trains is refused here, before any flow run, as with ``job_id``.
    Anything else (a remote repository, a job store in a bucket, a revision that is not there)
    is left to the flow, which names it.

    Raises:
        JobBusy: the unfinished job of this config and dataset is owned by another live run.
    """
    from stoker.data.pull import DatasetError, check_local_rev

    if job_store(config) is not None:
        return
    repo = config.data.repo_url or str(Path(config.work_dir) / "demo-data" / "repo")
    try:
        md5 = check_local_rev(repo, config.data.rev, config.data.path)
    except (DatasetError, OSError):
        return
    if md5 is not None and (job_dir := resolve_job_dir(config, md5)).is_dir():
        check_free(job_dir)


def new_job_notice(config: PipelineConfig) -> str | None:
    """For a ``job_id`` that names no job folder: one line saying a new job of that name starts
    (None when the job exists, or without ``job_id``; with a ``checkpoint_dir`` the job may live
    in the bucket, so nothing is said).

    Raises:
        ConfigError: ``job_id`` is the beginning of existing jobs' names (what ``stoker status``
            accepts), naming them: a typo'd or shortened id must not start a new job.
    """
    from stoker.config import ConfigError

    if not config.job_id or config.checkpoint_dir:
        return None
    jobs = resolve_job_dir(config, None).parent
    if (jobs / config.job_id).exists():
        return None
    similar = sorted(p.name for p in jobs.glob(f"{config.job_id}*")) if jobs.is_dir() else []
    if similar:
        raise ConfigError(f"job_id {config.job_id}: no such job under {jobs}; did you mean "
                          f"{' or '.join(similar[:3])}? (job_id takes the whole name)")
    return f"job_id {config.job_id}: no job of that name under {jobs}: starting a new job"
