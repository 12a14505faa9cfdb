"""The job lease's takeover says why the old lease no longer binds (QA: a takeover after `kill -9`
of `stoker run` said "expired or owner gone" beside an expiry still in the future)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from stoker.jobs.lease import JobLease, holder_alive, why_free
from stoker.runtime.preemption import SENDER_PREFIX, STOP_SENDER_FILE


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_owner_with_a_future_expiry_is_named_as_gone_not_expired(tmp_path, caplog):
    expires = time.time() + 300
    (tmp_path / "lease.json").write_text(json.dumps({
        "token": "old", "host": socket.gethostname(), "pid": dead_pid(),
        "flow_run_id": None, "acquired": 0, "renewed": 0, "expires": expires, "ttl_s": 60}))
    with caplog.at_level(logging.WARNING, logger="stoker.jobs.lease"):
        lease = JobLease(tmp_path).acquire()
    lease.release()
    until = time.strftime("%H:%M:%S UTC", time.gmtime(expires))
    assert f"its process is gone (the lease ran until {until})" in caplog.text
    assert "expired" not in caplog.text


def dead_owner_lease(job_dir, acquired: float) -> None:
    (job_dir / "lease.json").write_text(json.dumps({
        "token": "old", "host": socket.gethostname(), "pid": dead_pid(), "flow_run_id": None,
        "acquired": acquired, "renewed": acquired, "expires": time.time() + 300, "ttl_s": 60}))


def record_stop(job_dir, age_s: float, at_once: bool = True) -> None:
    """``stoker run``'s record of its Ctrl-C (stop-sender.json), ``age_s`` seconds ago, marked
    as ended at once by a second signal unless ``at_once`` is False (then killed after it)."""
    (job_dir / STOP_SENDER_FILE).write_text(json.dumps(
        {"sender": f"{SENDER_PREFIX}SIGINT (Ctrl-C)", "time": time.time() - age_s,
         **({"at_once": True} if at_once else {})}))


def takeover_line(job_dir, caplog, stop_age_s: float, at_once: bool = True
                  ) -> logging.LogRecord:
    """The log record of taking over a dead owner's lease (taken 30 s ago) whose job folder
    holds a stop recorded ``stop_age_s`` seconds ago."""
    dead_owner_lease(job_dir, time.time() - 30)
    record_stop(job_dir, stop_age_s, at_once)
    with caplog.at_level(logging.INFO, logger="stoker.jobs.lease"):
        JobLease(job_dir).acquire().release()
    [record] = [r for r in caplog.records if "taking over" in r.getMessage()]
    return record


def test_taking_over_from_a_run_stopped_at_once_is_info_not_a_warning(tmp_path, caplog):
    """Trial: after a double Ctrl-C, the resume's "taking over the lease ... its process is
    gone" WARNING looked like a crash; that run recorded its stop signal (stop-sender.json)
    and was stopped at once, which the line now says, at INFO."""
    record = takeover_line(tmp_path, caplog, stop_age_s=5)
    assert record.levelno == logging.INFO
    assert record.getMessage().endswith(
        "it was stopped at once (a second signal after SIGINT (Ctrl-C))")


def test_a_run_killed_after_its_ctrl_c_died_it_was_not_stopped_at_once(tmp_path, caplog):
    """Break-it trial: Ctrl-C, then `kill -9` 0.05 s later: no second signal, yet the takeover
    (and the attempt's close, and `stoker status`) said "stopped at once (a second signal after
    SIGINT (Ctrl-C))". Only a second signal marks the record (``at_once``)."""
    record = takeover_line(tmp_path, caplog, stop_age_s=5, at_once=False)
    assert record.levelno == logging.WARNING
    assert "its process is gone" in record.getMessage()
    assert "second signal" not in record.getMessage()


def test_a_stop_recorded_before_the_dead_owner_took_the_lease_is_not_its_own(tmp_path, caplog):
    """An earlier run's stop signal does not explain this owner's death (kill -9)."""
    record = takeover_line(tmp_path, caplog, stop_age_s=60)
    assert record.levelno == logging.WARNING
    assert "its process is gone" in record.getMessage()


def test_why_free_names_an_expiry_in_the_past_and_a_garbled_record():
    now = 1_800_000_000.0
    assert why_free({"expires": now - 5}, now) == "its lease expired at " + time.strftime(
        "%H:%M:%S UTC", time.gmtime(now - 5))
    assert why_free({"expires": "soon"}, now) == "it is unreadable"
    assert not holder_alive({"expires": "soon"}, now)


def test_the_bucket_lease_of_a_run_stopped_at_once_is_taken_over_at_info(tmp_path, caplog):
    """The job store's lease (here a folder store, as a bucket's) says the same as the local
    one: its dead owner's stop signal is in the local job folder."""
    from stoker.jobs.bucket_lease import BucketLease
    from stoker.jobs.store import JobStore

    store, job_dir = JobStore(str(tmp_path / "store")), tmp_path / "jobs" / "k-1"
    job_dir.mkdir(parents=True)
    dead = {"token": "old", "host": socket.gethostname(), "pid": dead_pid(),
            "flow_run_id": None, "acquired": time.time() - 30, "renewed": time.time() - 30,
            "expires": time.time() - 1, "ttl_s": 60}
    store.put(f"{store.root}/k-1/lease.json", json.dumps(dead).encode())
    with caplog.at_level(logging.INFO, logger="stoker.jobs.bucket_lease"):
        BucketLease(store, "k-1", ttl_s=30, job_dir=job_dir).acquire().release()
    record_stop(job_dir, 5)
    store.put(f"{store.root}/k-1/lease.json", json.dumps(dead).encode())
    with caplog.at_level(logging.INFO, logger="stoker.jobs.bucket_lease"):
        BucketLease(store, "k-1", ttl_s=30, job_dir=job_dir).acquire().release()
    first, second = [r for r in caplog.records if "taking over" in r.getMessage()]
    assert first.levelno == logging.WARNING and "expired" in first.getMessage()
    assert second.levelno == logging.INFO
    assert second.getMessage().endswith(
        "it was stopped at once (a second signal after SIGINT (Ctrl-C))")


@pytest.mark.parametrize("expires", ["Infinity", "NaN", "true", "1e999"])
def test_a_lease_whose_expiry_is_no_finite_time_binds_nobody(tmp_path, expires):
    """A damaged or forged ``lease.json`` (JSON readers take ``Infinity`` and ``NaN``): it held
    the job for ever (``expires`` > any now) and saying why crashed (``gmtime(inf)``:
    OverflowError). Such a record is unreadable: the next run takes the job over."""
    from stoker.runtime.lease import read_lease

    (tmp_path / "lease.json").write_text(
        f'{{"token": "old", "host": "{socket.gethostname()}", "pid": {os.getpid()}, '
        f'"acquired": 0, "expires": {expires}}}')
    assert read_lease(tmp_path) is None
    record = json.loads((tmp_path / "lease.json").read_text())
    assert not holder_alive(record)
    assert why_free(record) == "it is unreadable"
    lease = JobLease(tmp_path).acquire()  # taken over, not JobBusy
    lease.release()


def test_check_reads_the_lease_now_and_names_who_took_it_over(tmp_path):
    """A run frozen past its lease (kill -STOP) missed the renewal that would have noticed the
    takeover: ``check`` reads ``lease.json`` itself, and writes nothing."""
    lease = JobLease(tmp_path, ttl_s=60).acquire()
    try:
        assert lease.check() and lease.lost is None
        record = json.loads((tmp_path / "lease.json").read_text())
        (tmp_path / "lease.json").write_text(json.dumps({**record, "token": "other", "pid": 4343}))
        before = (tmp_path / "lease.json").read_bytes()
        assert not lease.check()
        assert lease.lost.startswith("taken over by host ") and "pid 4343" in lease.lost
        assert (tmp_path / "lease.json").read_bytes() == before
        (tmp_path / "lease.json").unlink()
        assert not lease.check()  # stays lost
    finally:
        lease.release()
    removed = JobLease(tmp_path / "second", ttl_s=60).acquire()
    (tmp_path / "second" / "lease.json").unlink()
    assert not removed.check() and removed.lost == "lease removed"
    removed.release()
