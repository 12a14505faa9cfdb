# ruff: noqa: F811 - the S3 fixtures are imported from test_bucket and used as parameters
"""Two nodes and one job in a bucket, against moto's S3 HTTP server on 127.0.0.1: records that
matter reach the bucket when written (a SIGKILL right after loses nothing), a node whose lease
was taken over commits no checkpoint and writes no record there (fencing), a save given up
after its upload tries is surfaced, and `stoker jobs`/`stoker status` see the bucket's jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from stoker.runtime.checkpoint import Checkpointer, CheckpointError
from tests.test_bucket import BUCKET, keys_in, restartable_s3, s3, s3_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def config(work: Path, store: str, job_id: str, lease_s: float = 60.0):
    from stoker.config import PipelineConfig

    return PipelineConfig(work_dir=work, checkpoint_dir=store, job_id=job_id,
                          job_lease_s=lease_s)


NODE_A = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from stoker.config import PipelineConfig
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.job import JobClaim
    from stoker.jobs.store import RecordSync
    config = PipelineConfig(work_dir=sys.argv[1], checkpoint_dir=sys.argv[2], job_id="k-1")
    claim = JobClaim(config).__enter__()
    sync = RecordSync(claim.store, claim.job_dir)  # as the train task runs it: every 3 s
    sync.start()
    time.sleep(0.5)
    AttemptLog(claim.job_dir).start(1, "spot", "flow-a")
    print("written", flush=True)
    time.sleep(60)
""")


def test_an_attempt_record_reaches_the_bucket_before_a_sigkill(s3_env, tmp_path):
    """Node A writes its attempt-start record and is SIGKILLed at once (well inside the 3 s
    sync period); node B, with an empty work_dir, sees the attempt in the bucket and closes it
    as interrupted, so A's attempt counts."""
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.store import JobStore

    store = f"s3://{BUCKET}/sigkill"
    node_a = subprocess.Popen([sys.executable, "-c", NODE_A, str(tmp_path / "a"), store],
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert node_a.stdout.readline().strip() == "written", node_a.stderr.read()[-3000:]
    finally:
        node_a.kill()
        node_a.wait(timeout=30)
    job_b = tmp_path / "b" / "jobs" / "k-1"
    assert "attempts.jsonl" in JobStore(store).pull("k-1", job_b)
    log = AttemptLog(job_b)
    assert [(r["number"], r["outcome"]) for r in log.close_interrupted()] == [(1, "interrupted")]
    assert log.next_number() == 2


def test_the_runtime_writes_the_mlflow_run_id_through(s3_env):
    """The MLflow run id reaches the bucket when the runtime writes it, under its lease."""
    from stoker.jobs.bucket_lease import BucketLease
    from stoker.jobs.store import JobStore
    from stoker.runtime.bucket import bucket_fence

    store = JobStore(f"s3://{BUCKET}/runid")
    lease = BucketLease(store, "k-2", ttl_s=30).acquire()
    try:
        fence = bucket_fence(f"{store.url}/k-2/checkpoints", lease.token)
        fence.write("mlflow_run_id", b"run-123")
        assert store.fs.cat_file(f"{BUCKET}/runid/k-2/mlflow_run_id") == b"run-123"
    finally:
        lease.release()


def test_a_new_job_s_run_id_reaches_the_bucket_when_the_run_is_created(s3_env, tmp_path):
    """A new job's MLflow run is created in rank 0's background after ``attach``: its id
    reaches the bucket then, not at the orchestrator's next sync (3 s), so a node lost in the
    first seconds still leaves the link to its run; one created before ``attach`` is written
    by ``attach``."""
    from types import SimpleNamespace

    from stoker.jobs.bucket_lease import BucketLease
    from stoker.jobs.store import JobStore
    from stoker.runtime.bucket import attach
    from stoker.runtime.reporting import ReportingMixin
    from stoker.runtime.tracking import RunTracker

    store = JobStore(f"s3://{BUCKET}/newrun")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name, created_first in (("k-6", False), ("k-7", True)):
        job = tmp_path / "jobs" / name
        job.mkdir(parents=True)
        location = f"{store.url}/{name}/checkpoints"
        lease = BucketLease(store, name, ttl_s=30).acquire()
        try:
            spec = SimpleNamespace(checkpoint_dir=location, lease_token=lease.token,
                                   job_dir=str(job))
            trainer = SimpleNamespace(ckpt=Checkpointer(location, 0, 1), run_id=None, spec=spec)

            def open_run(trainer=trainer) -> RunTracker:  # as ReportingMixin._open_tracker
                return RunTracker(uri, "new-runs", on_created=lambda run_id: (
                    ReportingMixin._run_created(trainer, run_id)))

            tracker = open_run() if created_first else None
            attach(trainer, spec, lambda reason: None)
            tracker = tracker or open_run()
            assert (job / "mlflow_run_id").read_text() == tracker.run_id
            stored = store.fs.cat_file(f"{BUCKET}/newrun/{name}/mlflow_run_id").decode()
            assert stored == tracker.run_id, name
        finally:
            lease.release()


def test_a_node_that_lost_its_lease_commits_nothing_in_the_bucket(s3_env, tmp_path):
    """Node A stops renewing (a network partition), its lease expires and node B (another
    work_dir) takes the job over. Before A notices at a renewal, its runtime tries to commit a
    checkpoint and its orchestrator to write the attempt record: both are refused, A's local
    lease is given up (so its runtime stops, exit 75), and B commits and writes normally."""
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.job import JobClaim
    from stoker.jobs.store import RecordSync
    from stoker.runtime.bucket import bucket_fence, caused_by_lost_lease

    store = f"s3://{BUCKET}/fence"
    claim_a = JobClaim(config(tmp_path / "a", store, "k-3", lease_s=3)).__enter__()
    claim_b = None
    try:
        claim_a.bucket_lease._stop.set()  # partitioned: no more renewals from A
        claim_a.bucket_lease._renewer.join(timeout=5)
        time.sleep(3.2)
        claim_b = JobClaim(config(tmp_path / "b", store, "k-3")).__enter__()
        assert claim_b.lease is not None and claim_a.lease.lost is None  # A has not noticed

        ckpt_a = Checkpointer(f"{store}/k-3/checkpoints", 0, 1)
        stops: list[str] = []
        ckpt_a.fence = bucket_fence(ckpt_a_url := f"{store}/k-3/checkpoints",
                                    claim_a.lease.token, stops.append).check
        ckpt_a.save(5, {"w": torch.ones(2)}, {"rng": 5})
        with pytest.raises(CheckpointError) as error:
            ckpt_a.wait()
        assert caused_by_lost_lease(error.value) and stops  # the runtime stops (exit 75)
        assert not [k for k in keys_in(s3_env, "fence/k-3/") if k.endswith("/COMMITTED")]

        AttemptLog(claim_a.job_dir).start(2, "spot", "flow-a")  # A's orchestrator, stale
        assert claim_a.lease.lost and "bucket lease" in claim_a.lease.lost
        assert not RecordSync(claim_a.store, claim_a.job_dir).sync()
        assert "fence/k-3/attempts.jsonl" not in keys_in(s3_env, "fence/k-3/")

        AttemptLog(claim_b.job_dir).start(1, "spot", "flow-b")
        assert b"flow-b" in claim_b.store.fs.cat_file(f"{BUCKET}/fence/k-3/attempts.jsonl")
        ckpt_b = Checkpointer(ckpt_a_url, 0, 1)
        ckpt_b.fence = bucket_fence(ckpt_a_url, claim_b.lease.token).check
        ckpt_b.save(5, {"w": torch.ones(2)}, {"rng": 5})
        ckpt_b.wait()
        assert Checkpointer(ckpt_a_url, 0, 1).committed_steps() == [5]
    finally:
        if claim_b is not None:
            claim_b.__exit__(None, None, None)
        claim_a.__exit__(None, None, None)


def test_a_given_up_save_is_surfaced_in_records_status_and_mlflow(restartable_s3, tmp_path):
    """The bucket stays down through every upload try of a save: the runtime records a
    ``checkpoint_failed`` event, the attempt record names the step, `stoker status` warns, and
    the job's MLflow run carries a tag and a metric; the step is not committed."""
    from types import SimpleNamespace

    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from stoker.cli import app
    from stoker.jobs.attempts import AttemptLog
    from stoker.runtime.bucket import attach
    from stoker.runtime.progress import ProgressWriter
    from stoker.runtime.tracking import RunTracker

    start, stop = restartable_s3
    job = tmp_path / "work" / "jobs" / "k-4"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trainer = SimpleNamespace(
        ckpt=Checkpointer("s3://down-bucket/k-4/checkpoints", 0, 1, upload_attempts=2),
        progress=ProgressWriter(job, 1), tracker=RunTracker(uri, "given-up"), run_id=None)
    spec = SimpleNamespace(checkpoint_dir=None, lease_token=None)
    attach(trainer, spec, lambda reason: None)
    log = AttemptLog(job)
    log.start(1, "spot")
    stop()
    trainer.ckpt.save(7, {"w": torch.ones(2)}, {"rng": 7})
    trainer.ckpt.wait()  # given up: logged, not raised
    start()
    trainer.progress.close()
    log.end(1, {"outcome": "completed", "exit_code": 0, "duration_s": 1.0})
    assert log.history()[0]["failed_saves"] == [7]
    assert 7 not in Checkpointer("s3://down-bucket/k-4/checkpoints", 0, 1).committed_steps()
    run = MlflowClient(uri).get_run(trainer.tracker.run_id)
    assert run.data.tags["stoker.checkpoint_failed"].startswith("step 7:")
    assert run.data.metrics["checkpoint_failed_saves"] == 1.0
    shown = CliRunner().invoke(app, ["status", "k-4", "--work-dir", str(tmp_path / "work")])
    assert shown.exit_code == 0, shown.output
    assert "warning    checkpoint step 7 was not saved" in shown.output


def test_jobs_and_status_on_a_fresh_node_show_the_bucket_s_jobs(s3_env, tmp_path):
    """Node A trains a job into the bucket; `stoker jobs`/`stoker status --checkpoint-dir` on
    a node with an empty work_dir list it, with A's attempt, MLflow run and A as its owner."""
    from typer.testing import CliRunner

    from stoker.cli import app
    from stoker.jobs.attempts import AttemptLog
    from stoker.jobs.job import JobClaim

    store = f"s3://{BUCKET}/listing"
    claim = JobClaim(config(tmp_path / "a", store, "k-5")).__enter__()
    try:
        AttemptLog(claim.job_dir).start(1, "spot", "flow-a")
        (claim.job_dir / "mlflow_run_id").write_text("run-abc")
        claim.store.push(claim.job_dir)
        fresh = str(tmp_path / "b")
        listed = CliRunner().invoke(app, ["jobs", "-w", fresh, "--checkpoint-dir", store])
        assert listed.exit_code == 0, listed.output
        [row] = [line for line in listed.output.splitlines() if line.startswith("k-5")]
        assert row.split()[1] == "training" and "run-abc" in row
        shown = CliRunner().invoke(app, ["status", "k-5", "-w", fresh, "-s", store])
        assert shown.exit_code == 0, shown.output
        assert "training (host" in shown.output and "mlflow run run-abc" in shown.output
        assert "flow run" not in listed.output  # only the table
    finally:
        claim.__exit__(None, None, None)
    assert "no jobs" in CliRunner().invoke(app, ["jobs", "-w", str(tmp_path / "c")]).output
    wrong = CliRunner().invoke(app, ["jobs", "-w", fresh, "-s", "s3://no-such-bucket-x/jobs"])
    assert wrong.exit_code == 2 and "checkpoint_dir s3://no-such-bucket-x/jobs" in wrong.output
