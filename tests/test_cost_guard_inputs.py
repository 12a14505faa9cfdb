"""Cost-guard inputs from issue 16 that need no engine: odd PIDs, bursty jobs without a
heartbeat, leaked memory, jobs starting. A whole sweep each, against the NVML stand-in.

The docs page (docs/explanation/cost-guard.md) has the decision table these tests follow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fake_nvml import FakeNvml, Gpu
from test_cost_guard_decide import Clock, RecordingActor, container, make_config, write_heartbeat

from stoker.costguard.decide import Verdict
from stoker.costguard.inventory import Resource
from stoker.costguard.nvml import NvmlReader
from stoker.costguard.signals import read_job
from stoker.costguard.sweep import run_sweep


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def sweep_many(tmp_path, frames, resources, clock=None, config=None):
    """One sweep over several resources (the same list at decision and re-check)."""
    clock = clock or Clock()
    actor = RecordingActor()
    with NvmlReader(FakeNvml(frames), clock=clock) as reader:
        report = run_sweep(config or make_config(tmp_path), reader,
                           lambda: ([make(0, clock) for make in resources], []),
                           {"container": actor}, clock=clock, sleep=clock.sleep)
    return report, actor


def named(resource_for, name: str, devices):
    def make(call, clock):
        from dataclasses import replace

        return replace(resource_for(call, clock), id=name, name=name, devices=devices)
    return make


@pytest.mark.parametrize("odd_pid", [4294967295, 2**31, -1, 0, "dead"])
def test_odd_pid_makes_only_its_gpu_unknown(tmp_path, odd_pid):
    """Row 2: an unresolvable PID -> that GPU unknown (raw value in the reason); the sweep
    finishes and the idle container on the other GPU is stopped."""
    pid = dead_pid() if odd_pid == "dead" else odd_pid
    frames = [[Gpu(index=0), Gpu(index=1, memory_used_mib=200, processes=[(pid, 200)])]]
    report, actor = sweep_many(tmp_path, frames, [
        named(container(), "idle-on-0", ("0",)), named(container(), "on-1", ("1",))])
    rows = {r.id: r for r in report.resources}
    assert rows["idle-on-0"].decision.verdict == Verdict.IDLE
    assert [r.id for r in actor.stopped] == ["idle-on-0"]
    odd = rows["on-1"]
    assert odd.decision.verdict == Verdict.UNKNOWN and odd.action_status == "none"
    assert any(f"PID {pid} " in reason for reason in odd.decision.reasons), odd.decision.reasons
    gpus = {g.id: g for g in report.gpus}
    assert gpus["GPU-fake-0001"].decision.verdict == Verdict.UNKNOWN
    assert gpus["GPU-fake-0000"].decision.verdict == Verdict.IDLE


def test_garbled_pid_from_an_old_binding_is_unknown_not_a_crash(tmp_path):
    frames = [[Gpu(index=0), Gpu(index=1, processes=[(None, 10)])]]
    report, actor = sweep_many(tmp_path, frames, [named(container(), "on-1", ("1",))])
    (row,) = report.resources
    assert row.decision.verdict == Verdict.UNKNOWN
    assert "PID None is not an integer" in " ".join(row.decision.reasons)
    assert not actor.stopped


def test_live_process_without_heartbeat_keeps_the_gpu_from_idle(tmp_path):
    """Row 9: bursty work sampled at 0% in every sample, 300 MiB held, a live compute process,
    no job folder -> busy, not stopped."""
    frames = [[Gpu(utilization=0, memory_used_mib=300, processes=[(os.getpid(), 300)])]]
    report, actor = sweep_many(tmp_path, frames, [container(pids=[os.getpid()])])
    (row,) = report.resources
    assert row.decision.verdict == Verdict.BUSY, row.decision.reasons
    assert "compute processes are live" in " ".join(row.decision.reasons)
    assert report.gpus[0].decision.verdict == Verdict.BUSY
    assert not actor.stopped


def test_live_process_with_stale_heartbeat_is_idle(tmp_path):
    """Row 10: the same GPU, but the job's heartbeat is older than idle_timeout_s -> idle."""
    clock = Clock()
    job = tmp_path / "jobs" / "quiet"
    write_heartbeat(job, clock.now - 7200)
    frames = [[Gpu(utilization=0, memory_used_mib=300, processes=[(os.getpid(), 300)])]]
    report, actor = sweep_many(tmp_path, frames, [container(pids=[os.getpid()], job_dir=job)],
                               clock=clock)
    (row,) = report.resources
    assert row.decision.verdict == Verdict.IDLE
    assert "compute processes still listed" in " ".join(row.decision.reasons)
    assert len(actor.stopped) == 1


def test_memory_held_without_owner_is_a_leak_never_stopped(tmp_path):
    """Row 6: 0%, 30 GB held, no process, heartbeat 20 min old -> leak, alert only."""
    clock = Clock()
    job = tmp_path / "jobs" / "crashed"
    write_heartbeat(job, clock.now - 1200)
    frames = [[Gpu(utilization=0, memory_used_mib=30_000, processes=[])]]
    report, actor = sweep_many(tmp_path, frames, [container(job_dir=job)], clock=clock)
    (row,) = report.resources
    assert row.decision.verdict == Verdict.LEAK, row.decision.reasons
    assert row.action_status == "none" and row.action == "alert only"
    assert "no live owner" in row.decision.reasons[0]
    assert report.gpus[0].decision.verdict == Verdict.LEAK
    assert report.gpus[0].usd_per_hour > 0  # the waste is priced, though nothing is stopped
    assert not actor.stopped


def test_memory_held_with_a_dead_pid_is_unknown(tmp_path):
    """Row 2 again: the owner's PID is listed but gone -> unknown (an event says so, see
    test_cost_guard_flow), never idle or stopped."""
    pid = dead_pid()
    frames = [[Gpu(utilization=0, memory_used_mib=30_000, processes=[(pid, 30_000)])]]
    report, actor = sweep_many(tmp_path, frames, [container()])
    assert report.resources[0].decision.verdict == Verdict.UNKNOWN
    assert f"PID {pid} not found on this host" in " ".join(report.resources[0].decision.reasons)
    assert not actor.stopped


@pytest.mark.parametrize("before", ["no heartbeat", "last run's heartbeat"])
def test_job_with_spec_but_no_heartbeat_counts_as_starting(tmp_path, before):
    """Row 7: a job folder with spec.yaml written just now and no heartbeat since (none at all,
    or the previous run's, hours old) -> busy."""
    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    job = tmp_path / "jobs" / "fresh"
    job.mkdir(parents=True)
    if before != "no heartbeat":
        write_heartbeat(job, Clock().now - 7200, outcome="preempted")
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(job)).dump(job / "spec.yaml")
    signals = read_job(job, read_mlflow=False)

    def instance(_call, _clock):
        return Resource(kind="instance", id="i-0123456789abcdef0", name="box",
                        devices=("all",), pids=frozenset(), started_at=None, jobs=(signals,))

    report, _ = sweep_many(tmp_path, [[Gpu()]], [instance])
    (row,) = report.resources
    assert row.decision.verdict == Verdict.BUSY
    assert "job fresh starting" in row.decision.reasons[0]


def test_without_nvml_the_sweep_does_not_wait_out_its_window():
    """New-user trial: on a host without NVML a sweep still sampled for the whole 60 s window,
    every sample the same init failure. It takes one sample; a readable NVML still gets the
    whole window."""
    from stoker.costguard.config import Policy
    from stoker.costguard.sweep import sample_window

    class NoLibrary:
        class NVMLError(Exception):
            pass

        def nvmlInit(self):
            raise self.NVMLError("NVML Shared Library Not Found")

    slept: list[float] = []
    policy = Policy(window_s=60, sample_interval_s=5)
    with NvmlReader(NoLibrary()) as reader:
        snapshots = sample_window(reader, policy, sleep=slept.append)
    assert [s.error for s in snapshots] == ["NVML init failed: NVML Shared Library Not Found"]
    assert slept == []
    with NvmlReader(FakeNvml([[Gpu(index=0)]])) as reader:
        snapshots = sample_window(reader, policy, sleep=slept.append)
    assert len(snapshots) == policy.samples_per_window and len(slept) == len(snapshots) - 1


@pytest.mark.parametrize("host", ["no GPU device", "GPU device"])
def test_without_nvml_a_cpu_job_is_no_gpu_and_a_gpu_host_stays_unknown(tmp_path, host):
    """New-user trial: on a machine without NVML (no driver) a CPU-only training job was rated
    `unknown`. A host without a GPU device file cannot run anything on a GPU: its local jobs are
    `no_gpu`, saying why (NVML's error too), and are never acted on, even with a heartbeat two
    hours old. With a GPU device file NVML's failure could hide a GPU: still unknown."""
    import json
    import time

    import psutil
    from fake_nvml import NVMLError_LibraryNotFound

    from stoker.config import TrainConfig
    from stoker.costguard.inventory import discover_jobs
    from stoker.costguard.signals import read_jobs
    from stoker.runtime.spec import RunSpec

    job = tmp_path / "jobs" / "cpu-job"
    job.mkdir(parents=True)
    spec = job / "spec.yaml"
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(job)).dump(spec)
    rank0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(spec)])
    dev = tmp_path / "dev"
    dev.mkdir()
    if host == "GPU device":
        (dev / "nvidia0").touch()
    try:
        stale = time.time() - 7200
        (job / "heartbeat.json").write_text(json.dumps(
            {"time": stale, "step": 10, "epoch": 0, "pid": rank0.pid, "world_size": 1,
             "pid_started": psutil.Process(rank0.pid).create_time(), "outcome": None}))
        os.utime(spec, (stale, stale))
        clock = Clock()
        actor = RecordingActor()
        config = make_config(tmp_path, stop_idle=True, min_idle_s=0, warmup_grace_s=0)
        with NvmlReader(FakeNvml([[Gpu()]], init_error=NVMLError_LibraryNotFound()),
                        clock=clock) as reader:
            report = run_sweep(
                config, reader,
                lambda: (discover_jobs(read_jobs(tmp_path, read_mlflow=False), set(), dev), []),
                {"job": actor}, clock=clock, sleep=clock.sleep)
    finally:
        rank0.kill()
        rank0.wait()
    (row,) = report.resources
    assert row.key == "job:cpu-job"
    reasons = " ".join(row.decision.reasons)
    if host == "GPU device":
        assert row.decision.verdict == Verdict.UNKNOWN, row.decision
    else:
        assert row.decision.verdict == Verdict.NO_GPU, row.decision
        assert "no GPU device on this host" in reasons
    assert "NVML" in reasons and "Library Not Found" in reasons, reasons
    assert not row.decision.act and row.action_status == "none" and not actor.stopped
