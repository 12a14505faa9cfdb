"""One trainer per job across machines: a lease object in the job store, with an expiry.

``<checkpoint_dir>/<job name>/lease.json`` holds the same record as the local ``lease.json``
(token, host, pid, flow run, expiry). On S3 (and S3-compatible stores that implement
conditional writes) every change is a conditional put: creating it uses ``If-None-Match: *``,
renewing or taking over an expired one uses ``If-Match: <ETag of what we read>``, so of two
nodes racing for one job exactly one wins and the other gets ``JobBusy``. On other fsspec
stores (a shared folder, ``memory://``) the write is read-check-write: two nodes starting the
same job within the same second could both win; the local file lock still protects one host.

A daemon thread renews the expiry every ``ttl_s / 3``; a node that dies stops renewing, and the
job can be taken over ``ttl_s`` seconds later (at once from the same host when its pid is gone).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoker.jobs.lease import JobBusy, holder_alive, owner, stopped_at_once, why_free
from stoker.jobs.store import JobStore
from stoker.runtime.lease import LeaseLost, describe
from stoker.runtime.records import real_number

log = logging.getLogger(__name__)

LEASE_OBJECT = "lease.json"


class _Conflict(Exception):
    """A conditional write lost a race."""


class _S3Objects:
    """Conditional get/put/delete of one S3 object (boto3; endpoint and keys from the env)."""

    def __init__(self, path: str):
        import boto3

        self.bucket, _, self.key = path.partition("/")
        # A session of its own: the default one keeps the credentials it first found.
        self.client = boto3.session.Session().client("s3")

    def get(self) -> tuple[dict | None, str | None]:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None
        return _parse(reply["Body"].read()), reply["ETag"]

    def put(self, record: dict, etag: str | None) -> None:
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key,
                                   Body=json.dumps(record).encode(), **condition)
        except self.client.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise _Conflict(code) from None
            raise

    def delete(self) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key)


class _FsObjects:
    """The same on any fsspec store, without atomic conditions (see the module docstring)."""

    def __init__(self, store: JobStore, path: str):
        self.store, self.fs, self.path = store, store.fs, path

    def get(self) -> tuple[dict | None, str | None]:
        try:
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None
        return _parse(data), "fs"

    def put(self, record: dict, etag: str | None) -> None:
        self.store.put(self.path, json.dumps(record).encode())

    def delete(self) -> None:
        self.fs.rm_file(self.path)


def _parse(data: bytes) -> dict | None:
    try:
        record = json.loads(data)
    except ValueError:
        return None  # a garbled lease binds nobody
    ok = isinstance(record, dict) and isinstance(record.get("token"), str) \
        and real_number(record.get("expires")) is not None
    return record if ok else None


class BucketLease:
    """Exclusive, renewed ownership of job ``name`` in ``store``.

    Args:
        store: the job store.
        name: the job name (``<key>-<time>``).
        ttl_s: seconds the lease binds without a renewal.
        flow_run_id: the orchestrator run, named to whoever is refused.
        on_lost: called (with the reason) from the renewal thread once another node holds the
            lease; the job claim releases the local lease then, so the runtime checkpoints and
            stops (exit 75).
        token: the lease token (default: a new one); the job claim passes its local lease's,
            so that the runtime, launched under that token, can check the bucket lease too.
        job_dir: the job's local folder, where a run stopped at once (a second Ctrl-C) recorded
            its stop signal: taking over its lease is then logged at INFO, not as a WARNING.
    """

    def __init__(self, store: JobStore, name: str, ttl_s: float,
                 flow_run_id: str | None = None,
                 on_lost: Callable[[str], None] | None = None, token: str | None = None,
                 job_dir: Path | None = None):
        self.on_lost, self.job_dir = on_lost, job_dir
        self._lost_told = threading.Lock()
        self.name, self.ttl_s, self.flow_run_id = name, ttl_s, flow_run_id
        path = f"{store.root}/{name}/{LEASE_OBJECT}"
        self.objects = _S3Objects(path) if store.fs.protocol[0] in ("s3", "s3a") \
            else _FsObjects(store, path)
        self.token = token or uuid.uuid4().hex
        self.lost: str | None = None
        self._acquired = time.time()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "flow_run_id": self.flow_run_id, "acquired": self._acquired, "renewed": now,
                "expires": now + self.ttl_s, "ttl_s": self.ttl_s}

    def acquire(self) -> BucketLease:
        """Take the lease now or refuse.

        Raises:
            JobBusy: a live owner holds it, or another node won the race for it.
        """
        current, etag = self.objects.get()
        if current is not None and current["token"] != self.token and holder_alive(current):
            raise JobBusy(f"job {self.name} is being trained by {describe(current)} "
                          "(lease in the bucket); wait for it or stop it")
        if current is not None:
            stopped_by = stopped_at_once(self.job_dir, current) if self.job_dir else None
            if stopped_by:
                log.info("job %s: taking over the bucket lease of %s: it was stopped at once (a "
                         "second signal after %s)", self.name, owner(current), stopped_by)
            else:
                log.warning("job %s: taking over the bucket lease of %s: %s", self.name,
                            owner(current), why_free(current))
        try:
            self.objects.put(self._record(), etag)
        except _Conflict:
            raise JobBusy(f"job {self.name}: another node took the lease in the bucket "
                          "at the same moment") from None
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"bucket-lease-{self.name}")
        self._renewer.start()
        return self

    def renew(self) -> bool:
        """Extend the expiry; False (and ``lost`` set) once another node holds the lease."""
        current, etag = self.objects.get()
        if current is None or current["token"] != self.token:
            self.lost = f"taken over by {describe(current)}" if current else "lease removed"
            return False
        try:
            self.objects.put(self._record(), etag)
        except _Conflict:
            self.lost = "taken over during renewal"
            return False
        return True

    def check(self) -> None:
        """Fencing: read the lease object right before a write to the job in the bucket.

        Raises:
            LeaseLost: another node holds the lease (or it was removed); ``on_lost`` is told.
        """
        if self.lost is None:
            current, _ = self.objects.get()
            if current is None or current["token"] != self.token:
                self.lost = f"taken over by {describe(current)}" if current else "lease removed"
        if self.lost is not None:
            self._tell_lost()
            raise LeaseLost(f"job {self.name}: bucket lease {self.lost}; not written")

    def _tell_lost(self) -> None:
        if self._lost_told.acquire(blocking=False):  # once, from whichever thread sees it
            log.error("job %s: bucket lease lost (%s)", self.name, self.lost)
            if self.on_lost is not None:
                self.on_lost(self.lost)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    self._tell_lost()
                    return
            except Exception as e:  # the bucket down for a while: expiry decides
                log.warning("job %s: bucket lease renewal failed (%s)", self.name,
                            type(e).__name__)

    def release(self) -> None:
        """Stop renewing and delete the lease object if it is still ours (safe to call twice)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        try:
            current, _ = self.objects.get()
            if current is not None and current["token"] == self.token:
                self.objects.delete()
        except Exception as e:  # unreachable now: the lease expires on its own
            log.warning("job %s: bucket lease not released (%s); it expires in %.0f s",
                        self.name, type(e).__name__, self.ttl_s)
