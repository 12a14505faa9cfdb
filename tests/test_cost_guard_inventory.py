"""Cost-guard inputs: the NVML reader's edge cases (fake NVML) and local job discovery (real
processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fake_nvml import FakeNvml, Gpu, NVMLError_NoPermission, mig_gpu

from stoker.costguard.inventory import discover_jobs, job_pids
from stoker.costguard.nvml import NvmlReader
from stoker.costguard.signals import read_job, read_jobs


def test_reader_units_and_errors():
    class BrokenHandle(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, index):
            if index == 1:
                raise NVMLError_NoPermission()
            return super().nvmlDeviceGetHandleByIndex(index)

    fake = BrokenHandle([[Gpu(index=0, mig=[]), Gpu(index=1), mig_gpu(index=2, devices=0),
                          mig_gpu(index=3, devices=2, processes=[(123, None)])]])
    with NvmlReader(fake) as reader:
        snapshot = reader.snapshot()
    assert fake.calls == ["init", "shutdown"]
    by_key = {g.key: g for g in snapshot.gpus}
    assert list(by_key) == ["GPU-fake-0000", "gpu1", "GPU-fake-0002", "MIG-fake-3-0",
                            "MIG-fake-3-1"]
    whole = by_key["GPU-fake-0000"]  # MIG capable but off: one whole GPU, fully read
    assert whole.error is None and whole.utilization_percent == 0 and whole.processes == ()
    assert "handle: Insufficient Permissions" in by_key["gpu1"].error
    assert by_key["GPU-fake-0002"].error == "MIG enabled but no MIG devices"
    mig = by_key["MIG-fake-3-1"]
    assert mig.parent_uuid == "GPU-fake-0003" and mig.mig_index == 1
    assert mig.error == "utilization: Not Supported" and mig.utilization_percent is None
    assert mig.processes[0].pid == 123 and mig.processes[0].used_memory_bytes is None


def test_snapshot_outside_the_context_or_without_a_binding_is_unknown():
    snapshot = NvmlReader(FakeNvml([[Gpu()]])).snapshot()
    assert snapshot.error and not snapshot.gpus
    with NvmlReader(json) as reader:  # nvml_module pointing at something else
        snapshot = reader.snapshot()
    assert "'json' is not an NVML binding" in snapshot.error and not snapshot.gpus


def _job(tmp_path: Path, name: str, pid, world_size: int, outcome=None, **beat) -> Path:
    job_dir = tmp_path / "jobs" / name
    job_dir.mkdir(parents=True)
    (job_dir / "heartbeat.json").write_text(json.dumps(
        {"time": time.time(), "step": 1, "epoch": 0, "pid": pid, "world_size": world_size,
         "outcome": outcome, **beat}))
    return job_dir


@pytest.fixture
def torchrun_like(tmp_path):
    """An 'agent' process with two 'rank' children whose command lines name a job's spec."""
    spec = tmp_path / "jobs" / "ddp-job" / "spec.yaml"
    agent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "ranks = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
        f"{str(spec)!r}]) for _ in range(2)]\n"
        "time.sleep(60)")])
    deadline = time.monotonic() + 20
    while len(psutil.Process(agent.pid).children()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield agent, [c.pid for c in psutil.Process(agent.pid).children()]
    finally:
        for child in psutil.Process(agent.pid).children():
            child.kill()
        agent.kill()
        agent.wait()


def test_local_job_is_its_process_tree(tmp_path, torchrun_like):
    agent, ranks = torchrun_like
    job = read_job(_job(tmp_path, "ddp-job", ranks[0], world_size=2), read_mlflow=False)
    assert job_pids(job) == frozenset([agent.pid, *ranks])
    (resource,) = discover_jobs([job], claimed=set())
    assert resource.kind == "job" and resource.pids == frozenset([agent.pid, *ranks])
    assert discover_jobs([job], claimed={"ddp-job"}) == []  # judged with its container


def test_heartbeat_pid_of_another_process_is_not_the_job(tmp_path):
    # This test process lives, but its command line names no job spec: a reused or
    # container-namespace PID must not make Stoker claim it.
    job = read_job(_job(tmp_path, "elsewhere", psutil.Process().pid, 1), read_mlflow=False)
    assert job_pids(job) is None and discover_jobs([job], set()) == []
    ended = read_job(_job(tmp_path, "ended", 1, 1, outcome="completed"), read_mlflow=False)
    assert not ended.running
    assert [j.name for j in read_jobs(tmp_path, read_mlflow=False)] == ["elsewhere", "ended"]


def test_a_heartbeat_names_its_process_by_pid_and_start_time(tmp_path):
    """A rank forked from a standby launcher has the standby's command line (no spec path):
    the heartbeat's start time names it. A pid whose process started at another time (reused,
    or from a container's namespace) is not the job; nor is a pid that is no pid at all."""
    me = psutil.Process()
    mine = read_job(_job(tmp_path, "forked", me.pid, 1, pid_started=me.create_time()),
                    read_mlflow=False)
    assert job_pids(mine) == frozenset([me.pid, *(c.pid for c in me.children(recursive=True))])
    reused = read_job(_job(tmp_path, "reused", me.pid, 1, pid_started=me.create_time() - 3),
                      read_mlflow=False)
    assert job_pids(reused) is None
    for n, bad in enumerate((2**31, -5, "4242", True)):
        odd = read_job(_job(tmp_path, f"odd-{n}", bad, 1, pid_started="yesterday"),
                       read_mlflow=False)
        assert job_pids(odd) is None and discover_jobs([odd], set()) == []


def test_mlflow_last_metric_time_counts_as_progress(tmp_path):
    from mlflow import MlflowClient

    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("costguard", artifact_location=tmp_path.as_uri())
    run = client.create_run(experiment)
    now = time.time()
    client.log_metric(run.info.run_id, "train_loss", 0.5, timestamp=int((now - 30) * 1000))
    job_dir = _job(tmp_path, "tracked", 1, 1)
    beat = json.loads((job_dir / "heartbeat.json").read_text()) | {"time": now - 3600}
    (job_dir / "heartbeat.json").write_text(json.dumps(beat))
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(job_dir),
            tracking_uri=uri).dump(job_dir / "spec.yaml")
    (job_dir / "mlflow_run_id").write_text(run.info.run_id)

    job = read_job(job_dir)
    assert job.last_progress == pytest.approx(now - 30, abs=0.01)  # MLflow, not the old beat
    assert read_job(job_dir, read_mlflow=False).last_progress == pytest.approx(now - 3600)

    (job_dir / "mlflow_run_id").write_text("0" * 32)  # a run the store does not have
    missing = read_job(job_dir)
    assert missing.errors == () and "MLflow last metric time unavailable" in missing.notes[0]
    assert missing.last_progress == pytest.approx(now - 3600)


def test_mlflow_is_not_asked_while_the_heartbeat_is_fresh(tmp_path):
    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    job_dir = _job(tmp_path, "fresh", 1, 1)
    beat = json.loads((job_dir / "heartbeat.json").read_text()) | {"time": time.time() - 10}
    (job_dir / "heartbeat.json").write_text(json.dumps(beat))
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(job_dir),
            tracking_uri="http://127.0.0.1:9").dump(job_dir / "spec.yaml")  # nothing listens
    (job_dir / "mlflow_run_id").write_text("0" * 32)
    assert read_job(job_dir, mlflow_if_older_than_s=1800).notes == ()
