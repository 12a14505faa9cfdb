"""One trainer per job: a lease in the job folder, held by the orchestrator until the job is done.

``JobLease.acquire`` is the first thing that writes to a job folder. Under a file lock
(``.lease.lock``, the atomic part) it reads ``lease.json``: a lease that is still valid and not
ours refuses at once with ``JobBusy`` naming its holder; a missing, released or expired one (its
owner died: the expiry passed, or the owner's pid is gone on this host) is taken over. A
daemon thread renews the expiry every ``ttl_s / 3`` while the lease is held; ``release`` (the
flow ending, however it ends) removes it. The runtime watches the same file and stops when the
lease it was launched under is lost (see ``stoker.runtime.lease``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
from filelock import FileLock

from stoker.runtime import private
from stoker.runtime.lease import LEASE_FILE, describe, read_lease
from stoker.runtime.preemption import stop_signal_reason
from stoker.runtime.records import integer, real_number, write_json

log = logging.getLogger(__name__)

LOCK_FILE = ".lease.lock"
_held: dict[Path, JobLease] = {}


class JobBusy(RuntimeError):
    """Another process holds the job's lease: it is training this job right now."""


def holder_alive(lease: dict[str, Any], now: float | None = None) -> bool:
    """Whether ``lease`` still binds: not expired, and (on this host) its owner process lives."""
    now = time.time() if now is None else now
    expires = real_number(lease.get("expires"))
    if expires is None or now > expires:  # expired, or a garbled record
        return False
    pid = integer(lease.get("pid"))
    if lease.get("host") == socket.gethostname() and pid is not None:
        # psutil.pid_exists raises OverflowError from 2**31 on: a garbled pid is not alive
        return 0 < pid < 2**31 and psutil.pid_exists(pid)
    return True


def why_free(lease: dict[str, Any], now: float | None = None) -> str:
    """Why a lease that :func:`holder_alive` rejected no longer binds, in words: ``its lease
    expired at 07:27:33 UTC``, ``its process is gone (the lease ran until 07:27:33 UTC)`` or
    ``it is unreadable``."""
    now = time.time() if now is None else now
    expires = real_number(lease.get("expires"))
    if expires is None:
        return "it is unreadable"
    until = time.strftime("%H:%M:%S UTC", time.gmtime(expires))
    if now > expires:
        return f"its lease expired at {until}"
    return f"its process is gone (the lease ran until {until})"


def stopped_at_once(job_dir: Path, lease: dict[str, Any]) -> str | None:
    """The stop signal the dead owner of ``lease`` recorded before it ended (``SIGINT
    (Ctrl-C)``: a second Ctrl-C ends ``stoker run`` without releasing its lease); None when it
    recorded none while it held the lease (it died: ``kill -9``, a lost node)."""
    acquired = real_number(lease.get("acquired"))
    if acquired is None:
        return None
    return stop_signal_reason(job_dir, acquired)


def owner(lease: dict[str, Any]) -> str:
    """``host node-a pid 4242 (flow run 3f2c...)``: who held ``lease``, without its expiry."""
    run = f" (flow run {lease['flow_run_id']})" if lease.get("flow_run_id") else ""
    return f"host {lease.get('host')} pid {lease.get('pid')}{run}"


class JobLease:
    """Exclusive, renewed ownership of one job folder.

    Args:
        job_dir: the job folder (created on acquire).
        ttl_s: seconds the lease stays valid without a renewal (the orphan detection delay).
        flow_run_id: the orchestrator run that owns the job (named to whoever is refused).
    """

    def __init__(self, job_dir: Path, ttl_s: float = 60.0, flow_run_id: str | None = None):
        self.job_dir, self.ttl_s, self.flow_run_id = Path(job_dir), ttl_s, flow_run_id
        self.token = uuid.uuid4().hex
        self.previous: dict[str, Any] | None = None  # the dead owner's lease this one took over
        self.lost: str | None = None  # why the lease was lost while held (taken over)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.job_dir / LEASE_FILE

    def _lock(self) -> FileLock:
        return FileLock(self.job_dir / LOCK_FILE, timeout=30, mode=private.FILE_MODE)

    def _record(self, acquired: float) -> dict[str, Any]:
        now = time.time()
        return {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "flow_run_id": self.flow_run_id, "acquired": acquired, "renewed": now,
                "expires": now + self.ttl_s, "ttl_s": self.ttl_s}

    def acquire(self) -> JobLease:
        """Take the lease now or refuse.

        Raises:
            JobBusy: a live owner holds it (the message names host, pid, flow run and expiry).
        """
        private.make_dir(self.job_dir)
        with self._lock():
            current = read_lease(self.job_dir)
            if current is not None and current["token"] != self.token and holder_alive(current):
                raise JobBusy(f"job {self.job_dir.name} is being trained by {describe(current)}; "
                              "wait for it, stop it, or set job_id to start another job")
            if current is not None and current["token"] != self.token:
                stopped_by = stopped_at_once(self.job_dir, current)
                if stopped_by:  # its owner was stopped at once (a second Ctrl-C): no surprise
                    log.info("job %s: taking over the lease of %s: it was stopped at once (a "
                             "second signal after %s)", self.job_dir.name, owner(current),
                             stopped_by)
                else:
                    log.warning("job %s: taking over the lease of %s: %s", self.job_dir.name,
                                owner(current), why_free(current))
                self.previous = current
            write_json(self.path, self._record(time.time()))
        self._acquired = time.time()
        _held[self.job_dir.resolve()] = self
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"lease-{self.job_dir.name}")
        self._renewer.start()
        return self

    def renew(self) -> bool:
        """Extend the expiry; False (and ``lost`` set) when another run took the lease over."""
        with self._lock():
            if self._taken(read_lease(self.job_dir)):
                return False
            write_json(self.path, self._record(self._acquired))
        return True

    def _taken(self, current: dict[str, Any] | None) -> bool:
        """Whether ``current`` (``lease.json`` as read) is no longer this run's lease; sets
        ``lost`` (who took it over, or that it was removed) when so."""
        if current is None or current["token"] != self.token:
            self.lost = f"taken over by {describe(current)}" if current else "lease removed"
            return True
        return False

    def check(self) -> bool:
        """Whether this run still holds the lease, read from ``lease.json`` now (not from the
        last renewal, which a stopped process such as one under ``kill -STOP`` missed); False
        (and ``lost`` set) when another run took it over or it was removed. Writes nothing.
        An unreadable file (a full disk, a permission) counts as still held: expiry decides."""
        if self.lost is not None:
            return False
        try:
            return not self._taken(read_lease(self.job_dir))
        except OSError:
            return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    log.error("job %s: lease lost (%s)", self.job_dir.name, self.lost)
                    return
            except OSError as e:  # a full disk must not kill the orchestrator; expiry decides
                log.warning("job %s: lease renewal failed: %s", self.job_dir.name, e)

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours (safe to call twice)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        _held.pop(self.job_dir.resolve(), None)
        with self._lock():
            current = read_lease(self.job_dir)
            if current is not None and current["token"] == self.token:
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> JobLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def held_lease(job_dir: Path) -> JobLease | None:
    """The lease this process holds on ``job_dir``, if any."""
    return _held.get(Path(job_dir).resolve())


def check_free(job_dir: Path) -> None:
    """Refuse at once, without writing anything, when a live owner holds ``job_dir``.

    Raises:
        JobBusy: as ``JobLease.acquire`` would.
    """
    current = read_lease(job_dir)
    if current is not None and holder_alive(current) and held_lease(job_dir) is None:
        raise JobBusy(f"job {Path(job_dir).name} is being trained by {describe(current)}; "
                      "wait for it, stop it, or set job_id to start another job")
