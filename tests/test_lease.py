"""The job lease's takeover says why the old lease no longer binds (QA: a takeover after `kill -9`
of `stoker run` said "expired or owner gone" beside an expiry still in the future)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

from stoker.launch.lease import JobLease, holder_alive, why_free


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_owner_with_a_future_expiry_is_named_as_gone_not_expired(tmp_path, caplog):
    expires = time.time() + 300
    (tmp_path / "lease.json").write_text(json.dumps({
        "token": "old", "host": socket.gethostname(), "pid": dead_pid(),
        "flow_run_id": None, "acquired": 0, "renewed": 0, "expires": expires, "ttl_s": 60}))
    with caplog.at_level(logging.WARNING, logger="stoker.launch.lease"):
        lease = JobLease(tmp_path).acquire()
    lease.release()
    until = time.strftime("%H:%M:%S UTC", time.gmtime(expires))
    assert f"its process is gone (the lease ran until {until})" in caplog.text
    assert "expired" not in caplog.text


def test_why_free_names_an_expiry_in_the_past_and_a_garbled_record():
    now = 1_800_000_000.0
    assert why_free({"expires": now - 5}, now) == "its lease expired at " + time.strftime(
        "%H:%M:%S UTC", time.gmtime(now - 5))
    assert why_free({"expires": "soon"}, now) == "it is unreadable"
    assert not holder_alive({"expires": "soon"}, now)
