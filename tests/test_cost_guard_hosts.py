# ruff: noqa: F811 - the fixtures imported from test_cost_guard_actions are parameters here
"""Cost-guard inputs from issue 16 against real engines: the Docker Engine, moto's EC2 server on
127.0.0.1 and the NVML stand-in. Jobs that start between decision and action keep their instance
(input 2); stopping a container does not defer its instance (input 3); a live compute process
without a heartbeat is never stopped (input 4).
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from fake_nvml import FakeNvml, Gpu
from test_cost_guard_actions import (  # noqa: F401 - fixtures
    FAST_POLICY,
    TRAP,
    _launch,
    _state,
    aws_env,
    busybox_image,
    docker_client,
    ec2_endpoint,
)

from stoker.config import TrainConfig
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.decide import Verdict
from stoker.costguard.host import discover_all, standard_actors
from stoker.costguard.nvml import NvmlReader
from stoker.costguard.sweep import run_sweep
from stoker.ownership import CLOUD_OWNER_TAG, DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL
from stoker.runtime.spec import RunSpec

pytestmark = pytest.mark.integration
WINDOW = 3  # snapshots in FAST_POLICY's window; snapshot WINDOW is the first re-check


@pytest.fixture
def label():
    """A test-unique job label: the sweep sees only this test's containers."""
    return f"costguard-host-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def owned(docker_client, busybox_image, label):
    """Starts owned containers of job ``label`` (removed afterwards)."""
    made = []

    def start(job: str = label):
        made.append(docker_client.containers.run(
            busybox_image, ["sh", "-c", TRAP], name=f"{job}-{len(made)}", detach=True,
            labels={DOCKER_OWNER_LABEL: "true", DOCKER_JOB_LABEL: job}, network_mode="none"))
        deadline = time.monotonic() + 30
        while b"ready" not in made[-1].logs():
            assert time.monotonic() < deadline, "container did not start"
            time.sleep(0.05)
        made[-1].reload()
        return made[-1]

    yield start
    for container in made:
        container.remove(force=True)


@pytest.fixture
def ec2(ec2_endpoint, aws_env):
    import boto3

    client = boto3.client("ec2", region_name="us-east-1", endpoint_url=ec2_endpoint)
    image = client.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    return client, _launch(client, image, {CLOUD_OWNER_TAG: "true"}), ec2_endpoint


def stale_heartbeat(work_dir, job: str) -> None:
    job_dir = work_dir / "jobs" / job
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "heartbeat.json").write_text(json.dumps(
        {"time": time.time() - 7200, "step": 5, "pid": 1, "world_size": 1, "outcome": None}))


def guard(work_dir, label, docker_client, instance=None, endpoint=None):
    ec2 = {"instance_id": instance, "region": "us-east-1", "endpoint_url": endpoint}
    return CostGuardConfig(work_dir=work_dir, dry_run=False, policy=FAST_POLICY, docker={
        "label_filters": [f"{DOCKER_JOB_LABEL}={label}"], "stop_timeout_s": 20},
        ec2=ec2 if instance else {})


def sweep(config, fake, docker_client):
    with NvmlReader(fake) as reader:
        report = run_sweep(config, reader, discover_all(config, docker_client),
                           standard_actors(config, docker_client))
    return {r.kind: r for r in report.resources}, report


@pytest.mark.parametrize("starts", ["container", "spec"])
def test_job_starting_before_the_instance_stop_keeps_the_instance(
        docker_client, owned, ec2, label, tmp_path, starts):
    """Input 2: idle at decision; before the stop a container starts, or a job writes its spec
    (no heartbeat yet). The re-check re-reads everything on the instance and skips it."""
    client, instance, endpoint = ec2

    def start_job(frame: int) -> None:
        if frame != WINDOW:
            return
        if starts == "container":
            owned()
        else:
            job_dir = tmp_path / "jobs" / "late"
            job_dir.mkdir(parents=True)
            RunSpec(train=TrainConfig(), data_dir=str(tmp_path),
                    job_dir=str(job_dir)).dump(job_dir / "spec.yaml")

    fake = FakeNvml([[Gpu(index=0), Gpu(index=1)]], on_frame=start_job)
    rows, _ = sweep(guard(tmp_path, label, docker_client, instance, endpoint), fake,
                    docker_client)
    row = rows["instance"]
    assert row.decision.verdict == Verdict.IDLE  # what the window showed
    assert row.action_status == "skipped", row.action
    expected = "is no_gpu on it" if starts == "container" else "job late starting"
    assert expected in row.action
    assert _state(client, instance) == "running"


def test_stopping_a_container_does_not_defer_its_instance(
        docker_client, owned, ec2, label, tmp_path):
    """Input 3: the sweep stops an idle container, then its instance in the same sweep: the
    stopped container's PID in the window is accounted for, not unresolvable."""
    client, instance, endpoint = ec2
    container = owned()
    stale_heartbeat(tmp_path, label)
    pid = container.attrs["State"]["Pid"]
    held = [Gpu(index=0, memory_used_mib=300, processes=[(pid, 300)]), Gpu(index=1)]
    fake = FakeNvml([held] * (WINDOW + 1) + [[Gpu(index=0), Gpu(index=1)]])
    rows, _ = sweep(guard(tmp_path, label, docker_client, instance, endpoint), fake,
                    docker_client)
    assert rows["container"].action_status == "stopped", rows["container"].action
    container.reload()
    assert container.status == "exited"
    assert rows["instance"].action_status == "stopped", rows["instance"].action
    assert _state(client, instance) in ("stopping", "stopped")


def test_live_process_without_heartbeat_is_not_stopped(docker_client, owned, label, tmp_path):
    """Input 4: bursts between samples read 0% every time; 300 MiB held by the container's live
    process and no job folder: busy, and the container keeps running."""
    container = owned()
    pid = container.attrs["State"]["Pid"]
    fake = FakeNvml([[Gpu(index=0, utilization=0, memory_used_mib=300,
                          processes=[(pid, 300)])]])
    rows, report = sweep(guard(tmp_path, label, docker_client), fake, docker_client)
    row = rows["container"]
    assert row.decision.verdict == Verdict.BUSY and row.action_status == "none"
    assert f"PIDs [{pid}] on GPU-fake-0000" in " ".join(row.decision.reasons)
    container.reload()
    assert container.status == "running"
    assert report.gpus[0].decision.verdict == Verdict.BUSY
    assert report.gpus[0].action == f"held by container {container.name}"
