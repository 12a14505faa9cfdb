"""Cost-guard actors against real engines: a Docker Engine and an AWS-compatible EC2 API.

Docker: two containers from a tiny local image, one labelled Stoker-owned and one not; a sweep
that finds both on idle GPUs stops only the labelled one, which gets SIGTERM first (its trap logs
it and exits 0). EC2: moto's server on 127.0.0.1 stands in for AWS; a tagged instance is stopped,
an untagged one is not. The GPUs are a fake NVML (there is no GPU here).
"""

from __future__ import annotations

import json
import os
import socket
import tarfile
import time
import uuid

import pytest
from fake_nvml import FakeNvml, Gpu

from stoker.costguard.actions import DockerActor, Ec2Actor
from stoker.costguard.config import CostGuardConfig
from stoker.costguard.decide import Verdict
from stoker.costguard.host import discover_all, standard_actors
from stoker.costguard.inventory import Resource
from stoker.costguard.nvml import NvmlReader
from stoker.costguard.sweep import run_sweep
from stoker.ownership import CLOUD_OWNER_TAG, DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL

pytestmark = pytest.mark.integration

FAST_POLICY = {"window_s": 0.2, "sample_interval_s": 0.1, "min_samples": 3, "min_idle_s": 0,
               "warmup_grace_s": 0}
TRAP = ("trap 'echo got SIGTERM; exit 0' TERM; echo ready; "
        "while true; do sleep 0.1; done")


def _unavailable(reason: str):
    """Skip with the reason, but fail in CI (CI=true), where every engine must be present."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def docker_client():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:  # any failure to reach the engine means: no Docker here
        _unavailable(f"Docker Engine not reachable: {e}")
    yield client
    client.close()


@pytest.fixture(scope="module")
def busybox_image(docker_client, tmp_path_factory):
    """A two-megabyte image: /bin/busybox with sh, sleep and echo links (docker import)."""
    tar_path = tmp_path_factory.mktemp("image") / "rootfs.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add("/bin/busybox", arcname="bin/busybox")
        for applet in ("sh", "sleep", "echo"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    repository, tag = "stoker-costguard-test", uuid.uuid4().hex[:12]
    docker_client.api.import_image_from_file(str(tar_path), repository=repository, tag=tag)
    yield f"{repository}:{tag}"
    docker_client.images.remove(f"{repository}:{tag}", force=True)


@pytest.fixture
def containers(docker_client, busybox_image):
    """(labelled, unlabelled) running containers of one test-unique job label."""
    job = f"costguard-test-{uuid.uuid4().hex[:12]}"
    made = []
    for owned in (True, False):
        labels = {DOCKER_JOB_LABEL: job, **({DOCKER_OWNER_LABEL: "true"} if owned else {})}
        made.append(docker_client.containers.run(
            busybox_image, ["sh", "-c", TRAP], name=f"{job}-{'owned' if owned else 'foreign'}",
            labels=labels, network_mode="none", detach=True))
    deadline = time.monotonic() + 30
    while not all(b"ready" in c.logs() for c in made):  # traps installed
        assert time.monotonic() < deadline, "containers did not start"
        time.sleep(0.05)
    for c in made:
        c.reload()
    yield job, made[0], made[1]
    for c in made:
        c.remove(force=True)


def test_only_the_labelled_container_is_stopped_and_gets_sigterm_first(
        docker_client, containers, tmp_path):
    job, owned, foreign = containers
    # Each container holds a small CUDA context on its own GPU and does nothing with it; the
    # owned one's job last beat two hours ago (a live process alone would keep it busy).
    job_dir = tmp_path / "jobs" / job
    job_dir.mkdir(parents=True)
    (job_dir / "heartbeat.json").write_text(json.dumps(
        {"time": time.time() - 7200, "step": 5, "pid": 1, "world_size": 1, "outcome": None}))
    fake = FakeNvml([[Gpu(index=0, memory_used_mib=300,
                          processes=[(owned.attrs["State"]["Pid"], 300)]),
                      Gpu(index=1, memory_used_mib=300,
                          processes=[(foreign.attrs["State"]["Pid"], 300)])]])
    config = CostGuardConfig(work_dir=tmp_path, dry_run=False, policy=FAST_POLICY, docker={
        "label_filters": [f"{DOCKER_JOB_LABEL}={job}"], "stop_timeout_s": 20})
    with NvmlReader(fake) as reader:
        report = run_sweep(config, reader, discover_all(config, docker_client),
                           standard_actors(config, docker_client))

    (row,) = report.resources
    assert row.id == owned.id and row.decision.verdict == Verdict.IDLE
    assert row.action_status == "stopped", row.action
    owned.reload()
    foreign.reload()
    assert owned.status == "exited"
    assert b"got SIGTERM" in owned.logs()
    assert owned.attrs["State"]["ExitCode"] == 0  # the trap's exit: SIGTERM, not SIGKILL (137)
    assert foreign.status == "running"
    gpu1 = next(g for g in report.gpus if g.id == "GPU-fake-0001")
    # A foreign live process on a GPU: busy, and named in "held by".
    assert gpu1.decision.verdict == Verdict.BUSY
    assert f"process {foreign.attrs['State']['Pid']} (sh)" in gpu1.action

    # The actor itself refuses a container without the label, whatever it is asked.
    refused = DockerActor(docker_client, stop_timeout_s=1).act(Resource(
        kind="container", id=foreign.id, name=foreign.name, devices=None, pids=frozenset(),
        started_at=None))
    assert refused.status == "refused" and DOCKER_OWNER_LABEL in refused.detail
    foreign.reload()
    assert foreign.status == "running" and b"got SIGTERM" not in foreign.logs()


# --- EC2 against moto's server on loopback -----------------------------------------------------

@pytest.fixture(scope="module")
def ec2_endpoint():
    try:
        import boto3  # noqa: F401
        import moto.server as server_module
    except ImportError as e:
        _unavailable(f"moto[server] and boto3 are needed for the EC2 tests: {e}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Fake credentials and region; no shared config, no instance metadata lookups."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _launch(client, image: str, tags: dict[str, str]) -> str:
    spec = {"ImageId": image, "MinCount": 1, "MaxCount": 1, "InstanceType": "p5.48xlarge"}
    if tags:
        spec["TagSpecifications"] = [{"ResourceType": "instance", "Tags": [
            {"Key": k, "Value": v} for k, v in tags.items()]}]
    return client.run_instances(**spec)["Instances"][0]["InstanceId"]


def _state(client, instance_id: str) -> str:
    found = client.describe_instances(InstanceIds=[instance_id])
    return found["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_tagged_instance_is_stopped_untagged_is_not(ec2_endpoint, aws_env, tmp_path):
    import boto3

    client = boto3.client("ec2", region_name="us-east-1", endpoint_url=ec2_endpoint)
    image = client.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    tagged = _launch(client, image, {CLOUD_OWNER_TAG: "true", "Name": "gpu-box"})
    untagged = _launch(client, image, {"Name": "someone-elses-box"})
    wrong_value = _launch(client, image, {CLOUD_OWNER_TAG: "false"})
    fake = FakeNvml([[Gpu(index=0), Gpu(index=1)]])  # a host whose GPUs do nothing

    def sweep(instance_id: str):
        config = CostGuardConfig(work_dir=tmp_path, dry_run=False, policy=FAST_POLICY,
                                 docker={"enabled": False},
                                 ec2={"instance_id": instance_id, "region": "us-east-1",
                                      "endpoint_url": ec2_endpoint})
        with NvmlReader(fake) as reader:
            report = run_sweep(config, reader, discover_all(config, None),
                               standard_actors(config, None))
        (row,) = report.resources
        assert row.kind == "instance" and row.decision.verdict == Verdict.IDLE
        return row

    for instance in (untagged, wrong_value):
        row = sweep(instance)
        assert row.action_status == "refused" and CLOUD_OWNER_TAG in row.action
        assert _state(client, instance) == "running"
    row = sweep(tagged)
    assert row.action_status == "stopped", row.action
    assert _state(client, tagged) in ("stopping", "stopped")
    assert row.usd_per_hour > 0 and len(row.gpus) == 2

    gone = Ec2Actor(client).act(Resource(kind="instance", id="i-0000000000000dead",
                                         name="x", devices=("all",), pids=frozenset(),
                                         started_at=None))
    assert gone.status == "gone"


def test_unreachable_ec2_api_fails_the_action_not_the_sweep(ec2_endpoint, aws_env, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    import boto3
    from botocore.config import Config

    client = boto3.client("ec2", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{closed}",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=2))
    result = Ec2Actor(client).act(Resource(kind="instance", id="i-0123456789abcdef0", name="x",
                                           devices=("all",), pids=frozenset(), started_at=None))
    assert result.status == "failed" and "EC2" in result.detail
