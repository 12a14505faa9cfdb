"""Cost-guard decisions against a fake NVML with pynvml's interface: only idle and stalled act.

Each case runs a whole sweep (sample the window, judge, re-check, act) with a fake clock, a
Stoker resource and an actor that records what it was asked to stop.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from fake_nvml import MIB, FakeNvml, Gpu, NVMLError_LibraryNotFound, NVMLError_NoPermission, mig_gpu

from stoker.config import ConfigError, validate
from stoker.costguard.actions import ActionResult
from stoker.costguard.config import CostGuardConfig, Policy
from stoker.costguard.decide import Verdict
from stoker.costguard.inventory import Resource, container_devices
from stoker.costguard.nvml import NvmlReader, load_nvml
from stoker.costguard.signals import read_job
from stoker.costguard.sweep import run_sweep
from stoker.runtime.progress import ProgressWriter
from stoker.tracking.pricing import PriceTable

SAMPLES = 5  # window_s / sample_interval_s + 1
NOWHERE_PID = 999_999_999  # above any Linux pid_max: never resolvable


class Clock:
    """Unix time that moves only when the sweep sleeps between samples."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class RecordingActor:
    """Stands in for the Docker actor (tested against a real engine in test_cost_guard_actions)."""

    kind = "container"

    def __init__(self) -> None:
        self.stopped: list[Resource] = []

    def act(self, resource: Resource) -> ActionResult:
        self.stopped.append(resource)
        return ActionResult("stopped", f"recorded {resource.name}")


def write_heartbeat(job_dir: Path, at: float, pid: int = 4242, outcome: str | None = None) -> None:
    """The runtime's heartbeat.json format (stoker.runtime.progress)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "heartbeat.json").write_text(json.dumps(
        {"time": at, "step": 10, "epoch": 0, "pid": pid, "world_size": 1, "outcome": outcome}))


def make_config(tmp_path: Path, **policy) -> CostGuardConfig:
    fields = {"window_s": 40, "sample_interval_s": 10, "min_idle_s": 0, "warmup_grace_s": 600,
              "idle_timeout_s": 1800, "stall_timeout_s": 1800, "stop_stalled": True, **policy}
    return CostGuardConfig(work_dir=tmp_path, dry_run=False, policy=Policy(**fields))


def sweep(tmp_path, frames, resource_for, clock=None, config=None, nvml=None, on_frame=None):
    """Run one sweep; ``resource_for(call)`` gives the resource at each discovery (0: decision,
    1: the re-check right before acting)."""
    clock = clock or Clock()
    actor = RecordingActor()
    calls = []

    def discover():
        calls.append(1)
        return [resource_for(len(calls) - 1, clock)], []

    fake = nvml if nvml is not None else FakeNvml(frames, on_frame=on_frame)
    with NvmlReader(fake, clock=clock) as reader:
        report = run_sweep(config or make_config(tmp_path), reader, discover,
                           {"container": actor}, clock=clock, sleep=clock.sleep)
    (row,) = report.resources
    return row, actor, report


def container(devices=("0",), pids=(), started_ago_s=3600.0, job_dir: Path | None = None):
    """A Stoker container, started ``started_ago_s`` before it is first seen."""
    started: list[float] = []

    def make(_call: int, clock: Clock) -> Resource:
        started.append(started[0] if started else clock.now - started_ago_s)
        jobs = (read_job(job_dir, read_mlflow=False),) if job_dir else ()
        return Resource(kind="container", id="c0ffee", name="trainer", devices=devices,
                        pids=frozenset(pids), started_at=started[0], jobs=jobs)
    return make


def steady(**gpu) -> list[list[Gpu]]:
    return [[Gpu(**gpu)]]


def test_genuinely_idle_gpu_is_stopped(tmp_path):
    row, actor, report = sweep(tmp_path, steady(utilization=0, memory_used_mib=0),
                               container())
    assert row.decision.verdict == Verdict.IDLE
    assert [r.id for r in actor.stopped] == ["c0ffee"]
    assert row.action_status == "stopped"
    assert row.decision.signals["samples"] == SAMPLES
    price = PriceTable().price("NVIDIA H200", "on_demand")
    assert row.usd_per_hour == pytest.approx(price) and report.usd_per_hour == pytest.approx(price)
    # Observed idle: from the first sample to the decision, 40 s on one GPU.
    assert row.idle_gpu_hours == pytest.approx(40 / 3600)
    assert report.gpus[0].decision.verdict == Verdict.IDLE


def test_bursty_utilization_with_long_gaps_is_busy(tmp_path):
    # Memory held, zero utilization except one burst, heartbeat older than the stall timeout.
    job = tmp_path / "jobs" / "bursty"
    clock = Clock()
    write_heartbeat(job, clock.now - 2400)
    frames = [[Gpu(utilization=u, memory_used_mib=30_000, processes=[(os.getpid(), 30_000)])]
              for u in (0, 0, 0, 97, 0)]
    row, actor, _ = sweep(tmp_path, frames, container(job_dir=job), clock=clock)
    assert row.decision.verdict == Verdict.BUSY
    assert "utilization up to 97%" in row.decision.reasons[0]
    assert not actor.stopped


def test_long_gap_between_bursts_is_bridged_by_the_heartbeat(tmp_path):
    # No burst in this window and memory released, but the last step was 5 minutes ago.
    job = tmp_path / "jobs" / "bursty"
    clock = Clock()
    write_heartbeat(job, clock.now - 300)
    row, actor, _ = sweep(tmp_path, steady(utilization=0, memory_used_mib=0),
                          container(job_dir=job), clock=clock)
    assert row.decision.verdict == Verdict.BUSY
    assert any("heartbeat" in r and "idle_timeout_s" in r for r in row.decision.reasons)
    assert not actor.stopped


def test_data_loading_with_memory_held_and_fresh_heartbeat_is_busy(tmp_path):
    job = tmp_path / "jobs" / "loading"
    clock = Clock()
    write_heartbeat(job, clock.now - 20)
    row, actor, _ = sweep(tmp_path, steady(utilization=0, memory_used_mib=40_000,
                                           processes=[(os.getpid(), 40_000)]),
                          container(job_dir=job), clock=clock)
    assert row.decision.verdict == Verdict.BUSY
    assert "stall_timeout_s" in row.decision.reasons[-1]
    assert not actor.stopped


def test_mig_with_unsupported_utilization_is_unknown(tmp_path):
    frames = [[mig_gpu(devices=2, memory_used_mib=0)]]
    row, actor, report = sweep(tmp_path, frames, container(devices=("0",)))
    assert row.decision.verdict == Verdict.UNKNOWN
    assert len(row.gpus) == 2 and all(g.startswith("MIG-") for g in row.gpus)
    assert any("utilization: Not Supported" in r for r in row.decision.reasons)
    assert [g.decision.verdict for g in report.gpus] == [Verdict.UNKNOWN] * 2
    assert not actor.stopped


def test_unresolvable_pids_make_the_gpu_unknown(tmp_path):
    # Looks idle (little memory, no utilization), but a process nobody can name is on it.
    frames = steady(utilization=0, memory_used_mib=200, processes=[(NOWHERE_PID, 200)])
    row, actor, report = sweep(tmp_path, frames, container(devices=("0",)))
    assert row.decision.verdict == Verdict.UNKNOWN
    assert any(f"PIDs [{NOWHERE_PID}] cannot be resolved" in r for r in row.decision.reasons)
    assert report.gpus[0].decision.verdict == Verdict.UNKNOWN
    assert not actor.stopped


def test_unresolvable_pid_leaves_a_process_judged_resource_unknown(tmp_path):
    # A resource judged by its processes cannot tell whether the stray PID is its own.
    frames = [[Gpu(index=0), Gpu(index=1, processes=[(NOWHERE_PID, 100)])]]
    row, actor, _ = sweep(tmp_path, frames, container(devices=None, pids=[os.getpid()]))
    assert row.decision.verdict == Verdict.UNKNOWN
    assert "cannot tell which GPUs" in " ".join(row.decision.reasons)
    assert not actor.stopped


@pytest.mark.parametrize("nvml", [
    "missing-module", "library-not-found", "process-list-denied"])
def test_nvml_missing_or_failing_is_unknown(tmp_path, nvml):
    if nvml == "missing-module":
        fake = load_nvml("stoker_no_such_nvml_binding")
    elif nvml == "library-not-found":
        fake = FakeNvml(steady(), init_error=NVMLError_LibraryNotFound())
    else:
        fake = FakeNvml(steady(processes=NVMLError_NoPermission()))
    row, actor, report = sweep(tmp_path, None, container(), nvml=fake)
    assert row.decision.verdict == Verdict.UNKNOWN
    assert not actor.stopped
    if nvml != "process-list-denied":
        assert report.notes and not report.gpus


def test_stalled_job_is_stopped_when_configured(tmp_path):
    job = tmp_path / "jobs" / "hung"
    clock = Clock()
    write_heartbeat(job, clock.now - 7200)
    frames = steady(utilization=0, memory_used_mib=60_000, processes=[(os.getpid(), 60_000)])
    row, actor, _ = sweep(tmp_path, frames, container(job_dir=job), clock=clock)
    assert row.decision.verdict == Verdict.STALLED
    assert [r.id for r in actor.stopped] == ["c0ffee"]
    assert row.idle_gpu_hours == pytest.approx(2.0, rel=0.01)  # held since the last heartbeat
    # The stop request names the stall and its step: the next run of the job refuses it.
    from stoker.jobs.stop_request import TrainingStopped, read_stop_request, refuse_stalled

    request = read_stop_request(job)
    assert (request.by, request.verdict, request.step) == ("cost-guard", "stalled", 10)
    with pytest.raises(TrainingStopped, match="stalled at step 10 and was stopped by cost-guard"):
        refuse_stalled(job, resume_stalled=False)
    assert refuse_stalled(job, resume_stalled=True) == request

    report_only = make_config(tmp_path, stop_stalled=False)
    row, actor, _ = sweep(tmp_path, frames, container(job_dir=job), clock=clock,
                          config=report_only)
    assert row.decision.verdict == Verdict.STALLED and not actor.stopped
    assert row.action_status == "none"


def test_a_hung_job_at_full_utilization_is_stalled_not_busy(tmp_path):
    """A collective that never returns spins the GPU at 100%: its stale heartbeat decides."""
    job = tmp_path / "jobs" / "hung"
    clock = Clock()
    write_heartbeat(job, clock.now - 7200)
    frames = steady(utilization=100, memory_used_mib=60_000, processes=[(os.getpid(), 60_000)])
    row, actor, _ = sweep(tmp_path, frames, container(job_dir=job), clock=clock)
    assert row.decision.verdict == Verdict.STALLED, row.decision.reasons
    assert "hung" in row.decision.reasons[-1]
    assert [r.id for r in actor.stopped] == ["c0ffee"]


def test_stalled_needs_a_heartbeat(tmp_path):
    frames = steady(utilization=0, memory_used_mib=60_000, processes=[(os.getpid(), 60_000)])
    row, actor, _ = sweep(tmp_path, frames, container())
    assert row.decision.verdict == Verdict.BUSY
    assert "no heartbeat to judge progress by" in row.decision.reasons
    assert not actor.stopped


def test_new_job_gets_warmup_grace(tmp_path):
    row, actor, _ = sweep(tmp_path, steady(), container(started_ago_s=120))
    assert row.decision.verdict == Verdict.WARMING_UP
    assert not actor.stopped


def test_job_starting_between_decision_and_action_survives(tmp_path):
    # The window is idle; the re-check sample (one more snapshot) shows a job on the GPU.
    idle = [Gpu()] * 1
    started = [Gpu(utilization=85, memory_used_mib=12_000, processes=[(os.getpid(), 12_000)])]
    frames = [idle] * SAMPLES + [started]
    row, actor, _ = sweep(tmp_path, frames, container())
    assert row.decision.verdict == Verdict.IDLE  # what the window showed
    assert row.action_status == "skipped"
    assert "re-check: now busy" in row.action
    assert not actor.stopped


def test_heartbeat_appearing_before_action_saves_the_job(tmp_path):
    # A job (re)starts in the container and beats before the GPU shows any load.
    job = tmp_path / "jobs" / "restarted"
    clock = Clock()
    write_heartbeat(job, clock.now - 7200)

    def beat(frame: int) -> None:
        if frame == SAMPLES:  # the re-check snapshot
            write_heartbeat(job, clock.now)

    row, actor, _ = sweep(tmp_path, steady(), container(job_dir=job), clock=clock,
                          on_frame=beat)
    assert row.decision.verdict == Verdict.IDLE and row.action_status == "skipped"
    assert not actor.stopped


def test_min_idle_s_waits_across_sweeps(tmp_path):
    config = make_config(tmp_path, min_idle_s=300)
    clock = Clock()
    same = container()
    row, actor, _ = sweep(tmp_path, steady(), same, clock=clock, config=config)
    assert row.decision.verdict == Verdict.IDLE and row.action_status == "waiting"
    assert not actor.stopped
    clock.now += 300  # the next scheduled sweep: idle since the first one's window
    row, actor, _ = sweep(tmp_path, steady(), same, clock=clock, config=config)
    assert row.action_status == "stopped" and len(actor.stopped) == 1
    assert row.decision.signals["idle_for_s"] == pytest.approx(40 + 300 + 40)
    # A restarted container (new start time) starts a new streak.
    clock.now += 300
    row, actor, _ = sweep(tmp_path, steady(), container(started_ago_s=3000), clock=clock,
                          config=config)
    assert row.action_status == "waiting" and not actor.stopped


def test_dry_run_decides_but_acts_on_nothing(tmp_path):
    config = make_config(tmp_path).model_copy(update={"dry_run": True})
    row, actor, report = sweep(tmp_path, steady(), container(), config=config)
    assert row.decision.verdict == Verdict.IDLE and row.action_status == "dry_run"
    assert report.dry_run and not actor.stopped


def test_a_busy_gpu_elsewhere_does_not_keep_an_idle_container_alive(tmp_path):
    frames = [[Gpu(index=0), Gpu(index=1, utilization=99, memory_used_mib=70_000,
                                 processes=[(os.getpid(), 70_000)])]]
    row, actor, report = sweep(tmp_path, frames, container(devices=("GPU-fake-0000",)))
    assert row.gpus == ("GPU-fake-0000",) and row.decision.verdict == Verdict.IDLE
    assert len(actor.stopped) == 1
    assert [g.decision.verdict for g in report.gpus] == [Verdict.IDLE, Verdict.BUSY]


def test_heartbeat_format_matches_the_runtime(tmp_path):
    writer = ProgressWriter(tmp_path / "job", world_size=2, heartbeat_every_s=0)
    writer.event("start", 0)
    writer.event("step", 3, epoch=0, loss=1.0, lr=0.1, samples_per_s=10.0)
    writer.close()
    job = read_job(tmp_path / "job", read_mlflow=False)
    assert job.running and job.heartbeat.pid == os.getpid() and job.heartbeat.step == 3
    assert job.started_at is not None and abs(job.last_progress - time.time()) < 60


def test_unreadable_heartbeat_makes_the_job_unknown(tmp_path):
    job = tmp_path / "jobs" / "torn"
    job.mkdir(parents=True)
    (job / "heartbeat.json").write_text("{not json")
    row, actor, _ = sweep(tmp_path, steady(), container(job_dir=job))
    assert row.decision.verdict == Verdict.UNKNOWN
    assert "heartbeat.json: unreadable" in " ".join(row.decision.reasons)
    assert not actor.stopped


def test_container_devices_from_inspect():
    gpus = {"HostConfig": {"DeviceRequests": [
        {"Driver": "", "Count": 0, "DeviceIDs": ["1", "GPU-abc"], "Capabilities": [["gpu"]]}]}}
    assert container_devices(gpus) == ("1", "GPU-abc")
    all_gpus = {"HostConfig": {"DeviceRequests": [{"Count": -1, "Capabilities": [["gpu"]]}]}}
    assert container_devices(all_gpus) == ("all",)
    first_two = {"HostConfig": {"DeviceRequests": [{"Count": 2, "Capabilities": [["gpu"]]}]}}
    assert container_devices(first_two) == ("0", "1")
    env = {"Config": {"Env": ["NVIDIA_VISIBLE_DEVICES=all"]}}
    assert container_devices({**env, "HostConfig": {"Runtime": "runc"}}) is None
    assert container_devices({**env, "HostConfig": {"Runtime": "nvidia"}}) == ("all",)
    none = {"Config": {"Env": ["NVIDIA_VISIBLE_DEVICES=void"]}, "HostConfig": {"Runtime": "nvidia"}}
    assert container_devices(none) == ()


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"policy.idle_utilization_percent: .*100.*got 150"):
        validate(CostGuardConfig, {"policy": {"idle_utilization_percent": 150}})
    with pytest.raises(ConfigError, match=r"policy: window_s must be >= sample_interval_s"):
        validate(CostGuardConfig, {"policy": {"window_s": 5, "sample_interval_s": 10}})
    with pytest.raises(ConfigError, match=r"ec2.instance_id: must look like i-"):
        validate(CostGuardConfig, {"ec2": {"instance_id": "web-1"}})
    with pytest.raises(ConfigError, match=r"docker.label_filters: each filter"):
        validate(CostGuardConfig, {"docker": {"label_filters": ["=x"]}})
    assert CostGuardConfig().dry_run is True  # safe default
    assert MIB == 1024 * 1024
