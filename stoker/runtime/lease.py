"""The job lease as the runtime sees it: who owns the job folder, and until when.

The orchestrator (``stoker.jobs.lease.JobLease``) writes ``<job_dir>/lease.json``::

    {"token": "9f0c...", "host": "node-a", "pid": 4242, "flow_run_id": "...",
     "acquired": 1764550000.0, "expires": 1764550060.0, "ttl_s": 60.0}

and renews ``expires`` while it lives. The runtime carries the token it was launched under (in
the run spec) and stops (commits a checkpoint, exits 75) once the lease is no longer its own:
released, taken over by another run, or expired because its orchestrator died. So a container
or a process tree never trains on unnoticed after the process that owns the job is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from stoker.runtime.records import read_json, real_number

log = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
# Clocks of the orchestrator and the runtime may differ a little (another host, a container).
EXPIRY_GRACE_S = 2.0


class LeaseLost(RuntimeError):
    """The job's lease is no longer this run's: nothing more may be written for the job."""


def read_lease(job_dir: str | Path) -> dict[str, Any] | None:
    """The job's lease record, or None when there is none (or it is unreadable: warned)."""
    lease = read_json(Path(job_dir) / LEASE_FILE)
    if lease is not None and not (isinstance(lease, dict) and isinstance(lease.get("token"), str)
                                  and real_number(lease.get("expires")) is not None):
        log.warning("%s: not a lease record; ignored", Path(job_dir) / LEASE_FILE)
        return None
    return lease


def describe(lease: dict[str, Any]) -> str:
    """``host node-a pid 4242 (flow run 3f2c...), lease until 12:01:05 UTC``."""
    until = time.strftime("%H:%M:%S UTC", time.gmtime(lease.get("expires", 0)))
    run = f" (flow run {lease['flow_run_id']})" if lease.get("flow_run_id") else ""
    return f"host {lease.get('host')} pid {lease.get('pid')}{run}, lease until {until}"


def lease_lost(lease: dict[str, Any] | None, token: str, now: float | None = None) -> str | None:
    """Why the lease ``token`` no longer owns the job, or None while it does."""
    now = time.time() if now is None else now
    if lease is None:
        return "the job lease was released"
    if lease["token"] != token:
        return f"the job was taken over by {describe(lease)}"
    if now > lease["expires"] + EXPIRY_GRACE_S:
        return f"the job lease expired {now - lease['expires']:.0f} s ago (orchestrator gone)"
    return None


def watch_lease(job_dir: str | Path, token: str, on_lost, interval_s: float = 2.0
                ) -> threading.Thread | None:
    """Call ``on_lost(reason)`` once the lease ``token`` stops owning the job (daemon thread).

    Nothing is watched when the job folder has no lease file yet (a job run without an
    orchestrator, or a launcher that does not share the folder).
    """
    if read_lease(job_dir) is None:
        return None

    def poll() -> None:
        while True:
            time.sleep(interval_s)
            reason = lease_lost(read_lease(job_dir), token)
            if reason:
                log.warning("stopping: %s", reason)
                on_lost(f"lease lost: {reason}")
                return

    thread = threading.Thread(target=poll, name="lease-watch", daemon=True)
    thread.start()
    return thread
