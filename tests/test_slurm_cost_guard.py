"""The cost guard on the real Slurm of .ci/start-slurm.sh: an idle Stoker job running as a Slurm
job is stopped the way ``stoker stop`` stops it (SIGTERM to its steps, stop checkpoint, scancel
after the grace); a Slurm job without Stoker's marks is refused. The GPUs are a fake NVML (there
is no GPU here) that shows the job's processes on an idle GPU."""

# ruff: noqa: F811 - the fixtures imported from test_slurm are parameters here
from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import events
from fake_nvml import FakeNvml, Gpu
from test_slurm import (  # noqa: F401 - fixtures
    TRAIN,
    cluster,
    in_background,
    launcher,
    wait_for_step,
)

from stoker.config import RetryConfig, TrainConfig
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.decide import Verdict
from stoker.costguard.host import discover_all, standard_actors
from stoker.costguard.inventory import Resource
from stoker.costguard.nvml import NvmlReader
from stoker.costguard.slurm import SlurmActor
from stoker.costguard.sweep import run_sweep
from stoker.jobs.stop_request import read_stop_request
from stoker.launch.retry import Outcome, run_with_retries
from stoker.launch.slurm import jobs_of, slurm
from stoker.runtime.spec import RunSpec

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("slurm")]
IDLE_POLICY = {"window_s": 0.2, "sample_interval_s": 0.1, "min_samples": 3, "min_idle_s": 0,
               "warmup_grace_s": 0, "idle_timeout_s": 0.01}


def job_spec(work: Path, job: str, dataset) -> Path:
    job_dir = work / "jobs" / job
    job_dir.mkdir(parents=True)
    spec = RunSpec(train=TrainConfig(**{**TRAIN, "epochs": 40}), data_dir=dataset.local_path,
                   job_dir=str(job_dir), tracking_uri=None, artifact_location=None,
                   run_name=job, tags={})
    spec.dump(job_dir / "spec.yaml")
    return job_dir / "spec.yaml"


def test_an_idle_slurm_job_is_stopped_with_a_stop_checkpoint(cluster, dataset, tmp_path):
    """The guard listed local jobs only by their heartbeat's PID and had no way to stop a Slurm
    job without Prefect. It now lists Stoker's Slurm jobs (``scontrol listpids`` on this host's
    nodes) and stops an idle one as ``stoker stop`` does: the attempt ends stopped, after a
    stop checkpoint, and nothing stays queued."""
    job = f"guard-{uuid.uuid4().hex[:6]}"
    spec = job_spec(tmp_path, job, dataset)
    lines: list[str] = []
    thread, attempts = in_background(lambda: run_with_retries(
        lambda n: launcher().run(spec, on_line=lines.append, timeout_s=300), RetryConfig(),
        stop_requested=lambda: read_stop_request(spec.parent) is not None))
    wait_for_step(spec.parent, 3)
    beat = json.loads((spec.parent / "heartbeat.json").read_text())
    fake = FakeNvml([[Gpu(index=0, memory_used_mib=300, processes=[(beat["pid"], 300)])]])
    config = CostGuardConfig(work_dir=tmp_path, dry_run=False, policy=IDLE_POLICY,
                             docker={"enabled": False}, prefect={"enabled": False},
                             read_mlflow=False, slurm={"enabled": True, "stop_timeout_s": 30})
    with NvmlReader(fake) as reader:
        report = run_sweep(config, reader, discover_all(config, None),
                           standard_actors(config, None))
    thread.join(timeout=120)

    (row,) = report.resources
    assert (row.kind, row.name, row.decision.verdict) == ("slurm", f"stoker-{job}",
                                                          Verdict.IDLE), row
    assert row.action_status == "stopped" and "after SIGTERM (stop checkpoint)" in row.action
    assert [a.outcome for a in attempts[0]] == [Outcome.STOPPED], "\n".join(lines[-40:])
    assert read_stop_request(spec.parent).by == "cost-guard"
    ends = [e for e in events(spec.parent) if e["event"] == "end"]
    assert ends[-1]["outcome"] == "preempted" and ends[-1]["step"] >= 3, ends
    assert not jobs_of(job)


def test_the_actor_refuses_a_slurm_job_without_stokers_marks(cluster):
    job_id = slurm("sbatch", "--parsable", "-N1", "-o", "/dev/null",
                   "--job-name=stoker-not-ours", "--wrap", "sleep 60").strip()
    try:
        result = SlurmActor(stop_timeout_s=1).act(Resource(
            kind="slurm", id=job_id, name="stoker-not-ours", devices=None, pids=frozenset(),
            started_at=None))
        state = slurm("squeue", "-h", "-j", job_id, "-o", "%T").strip()
    finally:
        subprocess.run(["scancel", job_id], check=False)
    assert result.status == "refused" and "stoker-job=<job> comment" in result.detail
    assert state in ("PENDING", "RUNNING")  # not signalled
