"""The runtime's side of a job kept in a bucket: fencing and write-through records.

With a remote ``checkpoint_dir`` (``<store>/<job>/checkpoints``) the job's lease object lives
at ``<store>/<job>/lease.json`` (written by ``stoker.jobs.bucket_lease``, with the same token
the runtime was launched under). A node whose lease was taken over (it lost the bucket for longer
than ``job_lease_s``, say) may not have noticed yet; ``BucketFence`` reads the lease object right
before every checkpoint commit and record write, so such a node never commits a step in the
bucket or overwrites the new owner's records: it gets ``LeaseLost`` and stops (exit 75).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import fsspec

from stoker.runtime.lease import LeaseLost, lease_lost
from stoker.runtime.records import read_text, real_number

log = logging.getLogger(__name__)

LEASE_OBJECT = "lease.json"
__all__ = ["BucketFence", "LeaseLost", "attach", "bucket_fence", "caused_by_lost_lease"]


def caused_by_lost_lease(error: BaseException | None) -> bool:
    """Whether ``error`` or any error in its ``__cause__`` chain is ``LeaseLost``."""
    while error is not None:
        if isinstance(error, LeaseLost):
            return True
        error = error.__cause__
    return False


def _parse(data: bytes) -> dict | None:
    import json

    try:
        record = json.loads(data)
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("token"), str) \
        and real_number(record.get("expires")) is not None
    return record if ok else None


class BucketFence:
    """Checks, right before a write, that lease ``token`` still owns the job in the bucket.

    Args:
        checkpoint_location: ``<store>/<job>/checkpoints`` (an fsspec URL).
        token: the lease token the run was launched under.
        on_lost: called once with the reason when the check first fails (the runtime's stop
            flag, so the other ranks stop at the next step boundary too).
    """

    def __init__(self, checkpoint_location: str, token: str,
                 on_lost: Callable[[str], None] | None = None):
        self.job_url = checkpoint_location.rstrip("/").rsplit("/", 1)[0]
        self.fs, self.job_path = fsspec.core.url_to_fs(self.job_url, skip_instance_cache=True)
        self.token, self.on_lost = token, on_lost
        self.lost: str | None = None

    def reason(self) -> str | None:
        """Why this run no longer owns the job (None while it does). An unreadable store
        raises (the write that follows would fail the same way and be retried)."""
        if self.lost is None:
            try:
                lease = _parse(self.fs.cat_file(f"{self.job_path}/{LEASE_OBJECT}"))
            except FileNotFoundError:
                lease = None
            # Expiry alone does not fence: a slow renewal is not a takeover.
            if lease is None or lease["token"] != self.token:
                self.lost = lease_lost(lease, self.token)
                log.error("job %s: %s; nothing more is committed there", self.job_url,
                          self.lost)
                if self.on_lost is not None:
                    self.on_lost(f"lease lost: {self.lost}")
        return self.lost

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this run still owns the job."""
        reason = self.reason()
        if reason:
            raise LeaseLost(f"{self.job_url}: {reason}; not committed (another node owns "
                            "the job now)")

    def write(self, record: str, data: bytes) -> None:
        """Write ``<job>/<record>`` in the bucket now (write-through), if still the owner."""
        self.check()
        self.fs.pipe_file(f"{self.job_path}/{record}", data)


def bucket_fence(checkpoint_dir: str | None, token: str | None,
                 on_lost: Callable[[str], None] | None = None) -> BucketFence | None:
    """A fence for a run whose checkpoints go to a remote store under a lease (else None)."""
    if not checkpoint_dir or "://" not in checkpoint_dir or checkpoint_dir.startswith("file:"):
        return None
    if not token:
        return None
    return BucketFence(checkpoint_dir, token, on_lost)


def attach(trainer, spec, stop_request: Callable[[str], None]) -> BucketFence | None:
    """Fence rank 0's checkpoint commits, write the MLflow run id through to the bucket, and
    surface a given-up save (progress event ``checkpoint_failed``, MLflow tag and metric).

    Args:
        trainer: the ``Trainer`` of this rank (rank 0 only: it commits and writes records).
        spec: its ``RunSpec``.
        stop_request: the stop flag's ``request``: a lost lease stops every rank.

    Raises:
        LeaseLost: the job is already another node's.
    """
    trainer.ckpt.on_give_up = lambda step, reason: _given_up(trainer, step, reason)
    fence = bucket_fence(spec.checkpoint_dir, spec.lease_token, stop_request)
    if fence is None:
        return None
    trainer.ckpt.fence = fence.check
    if trainer.run_id:
        try:
            fence.write("mlflow_run_id", trainer.run_id.encode())
        except LeaseLost:
            raise
        except Exception as e:  # the store down: the orchestrator's sync catches up
            log.warning("mlflow_run_id not written to %s (%s)", fence.job_url, type(e).__name__)
        return fence
    # A new job: its run is created in the background; its id goes to the bucket when it is.
    trainer.run_id_sink = lambda run_id: _write_run_id(fence, run_id)
    created = read_text(Path(spec.job_dir) / "mlflow_run_id")  # created before the sink was set
    if created:
        _write_run_id(fence, created)
    return fence


def _write_run_id(fence: BucketFence, run_id: str) -> None:
    """Write ``run_id`` through to the job's bucket (never raises: a lost lease stops the
    ranks through the fence's ``on_lost``; a store that is down is caught up by the
    orchestrator's sync)."""
    try:
        fence.write("mlflow_run_id", run_id.encode())
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("mlflow_run_id not written to %s (%s)", fence.job_url, type(e).__name__)


def _given_up(trainer, step: int, reason: str) -> None:
    """Record a save given up after its upload tries where people look (never raises)."""
    trainer.ckpt_failures = getattr(trainer, "ckpt_failures", 0) + 1
    try:
        if trainer.progress is not None:
            trainer.progress.event("checkpoint_failed", step, reason=reason)
        if trainer.tracker is not None:  # straight to the server: the loop owns the buffer
            from mlflow.entities import Metric, RunTag

            trainer.tracker.client.log_batch(
                trainer.tracker.run_id,
                metrics=[Metric("checkpoint_failed_saves", float(trainer.ckpt_failures),
                                int(time.time() * 1000), step)],
                tags=[RunTag("stoker.checkpoint_failed", f"step {step}: {reason}")])
    except Exception as e:  # reporting must not turn a skipped save into a crash
        log.warning("given-up checkpoint %d not reported (%s)", step, type(e).__name__)
