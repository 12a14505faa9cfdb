"""`stoker status` and `stoker jobs` show where a job's Slurm job stands while it waits in the
queue (issue 43's trial: nothing was shown until it ran), on a real Slurm (.ci/start-slurm.sh);
skipped without one, failed under CI=true. Slurm's answers are read as untrusted text."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from slurm_cluster import require_cluster
from typer.testing import CliRunner

from stoker.cli import app
from stoker.config import SlurmLauncherConfig, TrainConfig
from stoker.jobs.attempts import AttemptLog
from stoker.launch.slurm import SlurmLauncher, slurm
from stoker.launch.slurm_queue import (
    SLURM_JOB_FILE,
    job_queue_state,
    parse_queue_line,
    record_submitted,
    recorded_job_id,
)
from stoker.runtime.records import write_json
from stoker.runtime.spec import RunSpec


@pytest.fixture
def cluster():
    """A Slurm that answers (SLURM_CONF, else the one .ci/start-slurm.sh writes), with the
    partitions low and high over 2 nodes."""
    require_cluster("high")


def queued_job(work: Path) -> tuple[Path, Path]:
    """A job folder as `stoker run` leaves it before the launch: its spec, a live lease (this
    process), attempt 1 recorded as started on Slurm."""
    job = work / "jobs" / "qqqq0000-queued"
    job.mkdir(parents=True)
    spec = RunSpec(train=TrainConfig(epochs=1), data_dir=str(work / "data"), job_dir=str(job),
                   tracking_uri=None, artifact_location=None, run_name="queued", tags={})
    spec.dump(job / "spec.yaml")
    write_json(job / "lease.json", {"token": "t", "host": socket.gethostname(),
                                    "pid": os.getpid(), "expires": time.time() + 600})
    AttemptLog(job).start(1, "on_demand", None, "slurm")
    return job, job / "spec.yaml"


def wait_for_reason(job_id: str, prefix: str = "", timeout_s: float = 60) -> str:
    """Slurm's reason for the pending job, once its scheduler gave one (starting with
    ``prefix``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = slurm("squeue", "-h", "-j", job_id, "-o", "%T|%r").strip()
        state, _, reason = line.partition("|")
        if state == "PENDING" and reason not in ("", "None") and reason.startswith(prefix):
            return reason
        assert time.monotonic() < deadline, (state, reason)
        time.sleep(0.5)


@pytest.mark.integration
@pytest.mark.xdist_group("slurm")
def test_status_and_jobs_show_a_queued_slurm_job_with_slurms_reason(cluster, tmp_path):
    blocker = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "-o", "/dev/null",
                              "--wrap", "sleep 120"],
                             check=True, capture_output=True, text=True).stdout.strip()
    job, spec = queued_job(tmp_path)
    launcher = SlurmLauncher(SlurmLauncherConfig(nodes=2, partition="low"), shutdown_grace_s=5,
                             poll_s=0.5, orphan_wait_s=10)
    thread = threading.Thread(target=lambda: launcher.run(spec, on_line=lambda _: None,
                                                          timeout_s=300), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while launcher.job_id is None:
            assert time.monotonic() < deadline, "not submitted"
            time.sleep(0.2)
        job_id = launcher.job_id
        assert wait_for_reason(job_id) in ("Resources", "Priority")
        reason = "(Resources|Priority)"  # the scheduler may swap them between two looks
        shown = CliRunner().invoke(app, ["status", job.name, "--work-dir", str(tmp_path)]).output
        assert re.search(rf"^slurm +Slurm job {job_id} PENDING \({reason}\): .+; it trains "
                         "once Slurm starts it$", shown, re.M), shown
        assert re.search(r"^attempt 1: queued on Slurm for \d+ s on on_demand capacity$", shown,
                         re.M), shown  # not "running" beside PENDING
        listed = CliRunner().invoke(app, ["jobs", "--work-dir", str(tmp_path)]).output
        assert re.search(rf"^{job.name} +queued \({reason}\) ", listed, re.M), listed
        slurm("scontrol", "hold", job_id)  # held: Slurm says so, and so does stoker status
        held = wait_for_reason(job_id, "JobHeld")  # JobHeldUser, or JobHeldAdmin for root
        shown = CliRunner().invoke(app, ["status", job.name, "--work-dir", str(tmp_path)]).output
        assert f"Slurm job {job_id} PENDING ({held}): held" in shown, shown
    finally:
        launcher.cancel()
        thread.join(timeout=60)
        subprocess.run(["scancel", blocker], check=False)
    assert not thread.is_alive()


def test_slurms_answers_and_the_recorded_id_are_read_as_untrusted(tmp_path):
    """A state that is not one word, a reason with control characters or a shell's
    metacharacters, a recorded id that is not a job number, an earlier attempt's job: none is
    shown as it came, and Slurm is not asked about a job that is not the open attempt's."""
    odd = parse_queue_line("7", "PENDING|Resources\x1b[31m; rm -rf ~ `id` " + "x" * 200)
    assert odd.state == "PENDING" and len(odd.reason) <= 80
    assert "\x1b" not in odd.reason and ";" not in odd.reason and "`" not in odd.reason
    assert parse_queue_line("7", "pending; echo|Resources").state == "UNKNOWN"
    assert parse_queue_line("7", "RUNNING|None").reason is None
    job = tmp_path / "job"
    job.mkdir()
    write_json(job / SLURM_JOB_FILE, {"job_id": "12; scancel -u root", "submitted": time.time()})
    assert recorded_job_id(job, 0.0) is None
    record_submitted(job, "12")
    assert recorded_job_id(job, 0.0) == "12"
    assert recorded_job_id(job, time.time() + 10) is None  # a later attempt's: not this job
    AttemptLog(job).start(1, "on_demand", None, "local")  # not on Slurm: nothing to ask
    assert job_queue_state(job) is None
