"""The cost-guard flow under a real (test) Prefect server, with a fake NVML injected by name.

A stalled local job: its rank-0 process is alive and named in its heartbeat, holds 60 GiB on GPU 0
at zero utilization, and its heartbeat is two hours old; its spec records the Prefect flow run
that runs it. Dry run: reported, flow run untouched. Act mode: the flow run is cancelled. Both
publish the Markdown artifact and emit events, read back from the server's event store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from fake_nvml import FakeNvml, Gpu

from stoker.config import TrainConfig
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.inventory import Resource
from stoker.ownership import PREFECT_OWNER_TAG
from stoker.runtime.spec import RunSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def running_flow_run(tags: list[str]):
    """A flow run in state Running, as a training pipeline's would be."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    @flow(name="pipeline")
    def pipeline() -> None:  # never executed: only its flow run record is needed
        pass

    with get_client(sync_client=True) as client:
        return client.create_flow_run(pipeline, tags=tags, state=Running())


def flow_run_state(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state_type.value


@pytest.fixture
def stalled_job(harness, tmp_path):
    """A job folder with a live rank-0 process, a stale heartbeat and a tagged flow run."""
    name = f"job-{uuid.uuid4().hex[:8]}"
    job_dir = tmp_path / "jobs" / name
    job_dir.mkdir(parents=True)
    run = running_flow_run([PREFECT_OWNER_TAG])
    spec_path = job_dir / "spec.yaml"
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(job_dir),
            tags={"prefect.flow_run_id": str(run.id)}).dump(spec_path)
    # Stands in for a hung rank 0: a live process whose command line names the job's spec.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                             str(spec_path)])
    hung_since = time.time() - 7200
    (job_dir / "progress.jsonl").write_text(
        json.dumps({"event": "start", "time": hung_since - 600, "step": 0}) + "\n")
    (job_dir / "heartbeat.json").write_text(json.dumps(
        {"time": hung_since, "step": 412, "epoch": 3, "pid": proc.pid, "world_size": 1,
         "outcome": None}))
    os.utime(spec_path, (hung_since - 600, hung_since - 600))  # written when the job started
    fake_name = f"fake_nvml_{uuid.uuid4().hex[:8]}"
    sys.modules[fake_name] = FakeNvml([[
        Gpu(index=0, utilization=0, memory_used_mib=60_000, processes=[(proc.pid, 60_000)]),
        Gpu(index=1)]])
    try:
        yield name, run, tmp_path, fake_name
    finally:
        proc.kill()
        proc.wait()
        del sys.modules[fake_name]


def config_for(work_dir, nvml_module: str, dry_run: bool) -> CostGuardConfig:
    return CostGuardConfig(
        work_dir=work_dir, dry_run=dry_run, nvml_module=nvml_module, docker={"enabled": False},
        policy={"window_s": 0.2, "sample_interval_s": 0.1, "min_samples": 3, "min_idle_s": 0,
                "stop_stalled": True})


def run_flow(config: CostGuardConfig):
    from flows.cost_guard import cost_guard

    state = cost_guard(config, return_state=True)
    assert state.is_completed(), state.message
    return state.result(), state.state_details.flow_run_id


def artifact_of(flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["stoker-cost-guard"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return artifact.data


def events_of(flow_run_id, expect: set[str], timeout_s: float = 30.0) -> list[dict]:
    """Cost-guard events the server stored for one flow run (events are stored asynchronously:
    wait until every expected name is there)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            response = client.request("POST", "/events/filter", json={
                "filter": {"event": {"prefix": ["stoker.cost-guard."]},
                           "related": {"id": [f"prefect.flow-run.{flow_run_id}"]}},
                "limit": 50})
        found = response.json()["events"]
        if expect <= {e["event"] for e in found} or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def test_dry_run_reports_the_stalled_job_and_touches_nothing(stalled_job):
    name, run, work_dir, fake = stalled_job
    summary, flow_run_id = run_flow(config_for(work_dir, fake, dry_run=True))

    (job,) = summary["resources"]
    reasons = job.pop("reasons")
    assert job == {"resource": f"job:{name}", "verdict": "stalled", "action": "dry_run",
                   "detail": "dry run: would cancel flow run"}
    assert any("heartbeat has not advanced" in r for r in reasons), reasons
    assert [g["verdict"] for g in summary["gpus"]] == ["stalled", "idle"]
    assert flow_run_state(run.id) == "RUNNING"

    markdown = artifact_of(flow_run_id)
    assert "**dry run**" in markdown and name in markdown and "**stalled**" in markdown
    assert "heartbeat has not advanced for 72" in markdown  # ~7200 s

    events = events_of(flow_run_id, {"stoker.cost-guard.stalled", "stoker.cost-guard.idle",
                                     "stoker.cost-guard.swept"})
    names = sorted(e["event"] for e in events)
    assert names == ["stoker.cost-guard.idle", "stoker.cost-guard.stalled",
                     "stoker.cost-guard.stalled", "stoker.cost-guard.swept"]
    job_event = next(e for e in events
                     if e["resource"]["prefect.resource.id"] == f"stoker.job.{name}")
    assert job_event["payload"]["dry_run"] is True
    assert any(r["prefect.resource.id"] == f"prefect.flow-run.{run.id}"
               for r in job_event["related"])


def test_act_mode_cancels_the_stalled_flow_run(stalled_job):
    name, run, work_dir, fake = stalled_job
    summary, flow_run_id = run_flow(config_for(work_dir, fake, dry_run=False))

    (job,) = summary["resources"]
    assert job["verdict"] == "stalled" and job["action"] == "cancelled", job
    # Without infrastructure to stop, the server moves Cancelling on to Cancelled.
    assert flow_run_state(run.id) in ("CANCELLING", "CANCELLED")
    assert "**cancelled**" in artifact_of(flow_run_id)

    events = events_of(flow_run_id, {"stoker.cost-guard.action"})
    (action,) = [e for e in events if e["event"] == "stoker.cost-guard.action"]
    assert action["resource"]["prefect.resource.id"] == f"stoker.job.{name}"
    assert action["payload"]["action_status"] == "cancelled"
    assert action["payload"]["dry_run"] is False


def test_prefect_actor_refuses_an_untagged_flow_run(harness):
    from tasks.cost_guard import PrefectActor

    run = running_flow_run(["someone-else"])
    job = Resource(kind="job", id="j", name="j", devices=None, pids=frozenset(),
                   started_at=None, flow_run_id=str(run.id))
    result = PrefectActor().act(job)
    assert result.status == "refused" and PREFECT_OWNER_TAG in result.detail
    assert flow_run_state(run.id) == "RUNNING"
    missing = PrefectActor().act(Resource(kind="job", id="j", name="j", devices=None,
                                          pids=frozenset(), started_at=None))
    assert missing.status == "refused"


@pytest.fixture
def fake_module():
    """Registers NVML stand-ins under unique module names (config.nvml_module)."""
    names = []

    def register(fake) -> str:
        names.append(f"fake_nvml_{uuid.uuid4().hex[:8]}")
        sys.modules[names[-1]] = fake
        return names[-1]

    yield register
    for name in names:
        del sys.modules[name]


def test_odd_pids_and_leaked_memory_are_reported_with_events(harness, tmp_path, fake_module):
    """Input 1 and 5 end to end: a 'no PID' sentinel and a dead PID make their GPUs unknown, a
    GPU holding 30 GB without a process is a leak; the sweep completes and says so."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    fake = fake_module(FakeNvml([[
        Gpu(index=0, memory_used_mib=300, processes=[(4294967295, 300)]),
        Gpu(index=1, memory_used_mib=30_000, processes=[(proc.pid, 30_000)]),
        Gpu(index=2, memory_used_mib=30_000, processes=[]),
        Gpu(index=3)]]))
    summary, flow_run_id = run_flow(config_for(tmp_path, fake, dry_run=False))
    assert [g["verdict"] for g in summary["gpus"]] == ["unknown", "unknown", "leak", "idle"]

    events = events_of(flow_run_id, {"stoker.cost-guard.leak", "stoker.cost-guard.unknown",
                                     "stoker.cost-guard.swept"})
    by_gpu = {e["resource"]["prefect.resource.id"]: e for e in events
              if e["event"] != "stoker.cost-guard.swept"}
    sentinel = by_gpu["stoker.gpu.GPU-fake-0000"]
    assert sentinel["event"] == "stoker.cost-guard.unknown"
    assert "PID 4294967295" in " ".join(sentinel["payload"]["reasons"])
    dead = by_gpu["stoker.gpu.GPU-fake-0001"]
    assert dead["event"] == "stoker.cost-guard.unknown"
    assert f"PID {proc.pid} not found" in " ".join(dead["payload"]["reasons"])
    leak = by_gpu["stoker.gpu.GPU-fake-0002"]
    assert leak["event"] == "stoker.cost-guard.leak"
    assert leak["payload"]["action_status"] == "none"
    markdown = artifact_of(flow_run_id)
    assert "**leak**" in markdown and "4294967295" in markdown


class CrashingNvml(FakeNvml):
    """A binding that fails in a way the reader does not expect (not an NVMLError)."""

    def nvmlDeviceGetCount(self) -> int:
        raise RuntimeError("binding returned garbage")


def test_a_crashed_sweep_still_publishes_an_artifact_and_an_event(harness, tmp_path,
                                                                   fake_module):
    from flows.cost_guard import cost_guard

    fake = fake_module(CrashingNvml([[Gpu()]]))
    state = cost_guard(config_for(tmp_path, fake, dry_run=True), return_state=True)
    assert state.is_failed()
    flow_run_id = state.state_details.flow_run_id
    markdown = artifact_of(flow_run_id)
    assert "**The sweep failed**" in markdown and "binding returned garbage" in markdown
    (failed,) = [e for e in events_of(flow_run_id, {"stoker.cost-guard.failed"})
                 if e["event"] == "stoker.cost-guard.failed"]
    assert failed["payload"]["error_type"] == "RuntimeError"


def test_without_nvml_a_job_is_rated_and_the_summary_says_why(stalled_job):
    """New-user trial: on a machine without NVML the summary rated the job `unknown` with an
    empty `detail`, the reason only in `notes`; each verdict now carries its reasons. On a host
    without a GPU device file (no driver) the job cannot be on a GPU: `no_gpu`, NVML's error in
    its reasons (a later trial: a CPU-only job was `unknown`); with one, still `unknown`."""
    import pynvml

    from stoker.runtime.launch import gpu_device_present

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        missing = str(e)
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML loads on this host: the no-NVML path cannot be shown with it")
    name, _run, work_dir, _fake = stalled_job
    summary, _ = run_flow(config_for(work_dir, "pynvml", dry_run=True))
    (job,) = summary["resources"]
    expected = "unknown" if gpu_device_present() else "no_gpu"
    assert job["resource"] == f"job:{name}" and job["verdict"] == expected, job
    assert job["action"] == "none"
    assert any(missing in r for r in job["reasons"]), (missing, job)
