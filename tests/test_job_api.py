"""``stoker.jobs.Job``: the public face of a job's state (issue 42), on a real job folder."""

from __future__ import annotations

import os

import pytest

from stoker.config import PipelineConfig
from stoker.jobs import Job
from stoker.jobs.lease import JobBusy


def test_a_job_records_its_attempts_stop_request_and_status(tmp_path):
    job = Job(tmp_path / "jobs" / "abcdef12-20261205T080000Z")
    job.path.mkdir(parents=True)
    assert job.name == "abcdef12-20261205T080000Z"
    assert job.attempts() == [] and job.stop_request() is None and job.done() is None
    job.begin_attempt(1, "spot", launcher="local")
    assert [a["state"] for a in job.attempts()] == ["started"]
    job.end_attempt(1, {"exit_code": 75, "outcome": "preempted", "started": 1.0,
                        "duration_s": 2.0, "capacity_type": "spot"})
    assert job.attempts()[0]["outcome"] == "preempted" and job.attempts()[0]["state"] == "ended"
    summary = job.status()
    assert summary.attempts == 1 and summary.preemptions == 1 and summary.state == "unfinished"
    request = job.request_stop("user", "maintenance\nwindow")
    assert request.reason == "maintenance window"  # one line wherever it is quoted
    assert job.stop_request().describe() == "stopped by user: maintenance window"
    assert job.status().state == "stopped"
    assert job.processes().describe() == "none on this host"
    assert Job.named(tmp_path, job.name) == job


def test_claim_leases_the_job_and_refuses_a_second_owner(tmp_path):
    config = PipelineConfig(work_dir=tmp_path, job_id="mine")
    with Job.claim(config, "flow-run-1") as claim:
        job = Job(claim.job_dir)
        assert job.name == "mine" and job.lease()["pid"] == os.getpid()
        assert job.lease()["flow_run_id"] == "flow-run-1"
        with pytest.raises(JobBusy), Job.claim(config, "flow-run-2"):
            pass
    assert Job(tmp_path / "jobs" / "mine").status().state != "training"  # released


def test_every_launcher_is_a_launcher():
    from stoker.launch.base import Launcher
    from stoker.launch.docker import DockerLauncher
    from stoker.launch.factory import KubernetesAdapter
    from stoker.launch.local import LocalLauncher
    from stoker.launch.slurm import SlurmLauncher

    for launcher in (LocalLauncher, DockerLauncher, KubernetesAdapter, SlurmLauncher):
        assert issubclass(launcher, Launcher), launcher
