"""The docker launcher against a real Docker Engine, running the real training image."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from conftest import events

from stoker.launch.docker import DockerLauncher, combine_exit_codes
from stoker.launch.retry import Outcome, classify_exit
from stoker.ownership import DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL

pytestmark = pytest.mark.integration


def test_node_exit_codes_combine_into_one():
    assert combine_exit_codes([0, 0]) == 0
    assert combine_exit_codes([75, 0]) == 75
    assert combine_exit_codes([75, 137]) == 137
    assert combine_exit_codes([1, 75]) == 1


def launcher_for(image: str, **kwargs) -> DockerLauncher:
    from image_support import free_port

    return DockerLauncher(image=image, gpus=0, shm_size="256m", shutdown_grace_s=20,
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", **kwargs)



def wait_for_step(container, job_dir, step: int, timeout_s: float = 300) -> None:
    """Until rank 0 of the job in ``container`` reports ``step`` (the container still runs)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(
            e["event"] == "step" and e["step"] >= step for e in events(job_dir)):
        container.reload()
        assert container.status in ("created", "running"), container.logs()[-3000:]
        time.sleep(0.1)


def test_two_nodes_as_two_containers(training_image, make_spec, docker_engine, mlflow_http):
    # The image carries mlflow-skinny: it logs to a tracking server over HTTP.
    spec = make_spec(f"two-nodes-{uuid.uuid4().hex[:8]}", epochs=1, tracking_uri=mlflow_http.uri)
    launcher = launcher_for(training_image.ref, nnodes=2, nproc_per_node=1)
    lines: list[str] = []
    code = launcher.run(spec, on_line=lines.append, timeout_s=600)
    assert code == 0, "\n".join(lines[-60:])
    result = json.loads((spec.parent / "result.json").read_text())
    assert result["world_size"] == 2 and result["step"] == 22
    assert any(line.startswith("[node 0]") for line in lines)  # logs streamed per node
    assert not docker_engine.containers.list(all=True, filters={
        "label": f"{DOCKER_JOB_LABEL}={spec.parent.name}"})  # removed afterwards


def test_docker_stop_checkpoints_and_the_next_attempt_resumes(training_image, make_spec,
                                                              docker_engine, mlflow_http):
    spec = make_spec(f"stopped-{uuid.uuid4().hex[:8]}", epochs=6, tracking_uri=mlflow_http.uri)
    launcher = launcher_for(training_image.ref, nproc_per_node=2)
    (container,) = launcher.start(spec)
    try:
        labels = docker_engine.containers.get(container.id).labels
        assert labels[DOCKER_OWNER_LABEL] == "true"
        assert labels[DOCKER_JOB_LABEL] == spec.parent.name
        wait_for_step(container, spec.parent, 5)
        container.stop(timeout=40)  # `docker stop`: SIGTERM, SIGKILL after 40 s
        status = container.wait(timeout=60)
        logs = container.logs().decode()
    finally:
        container.remove(force=True)
    assert status["StatusCode"] == 75, logs[-3000:]
    assert classify_exit(status["StatusCode"]) is Outcome.PREEMPTED  # resumed at once
    stopped = [e for e in events(spec.parent) if e["event"] == "end"][-1]
    assert stopped["outcome"] == "preempted"
    assert (spec.parent / "checkpoints" / f"step-{stopped['step']:09d}" / "COMMITTED").exists()

    lines: list[str] = []
    assert launcher.run(spec, on_line=lines.append, timeout_s=600) == 0, "\n".join(lines[-60:])
    starts = [e for e in events(spec.parent) if e["event"] == "start"]
    assert starts[-1]["resumed"] and starts[-1]["step"] == stopped["step"]
    assert json.loads((spec.parent / "result.json").read_text())["step"] == 6 * 22



def test_stoker_stop_stops_a_job_whose_ranks_run_in_a_container(training_image, make_spec,
                                                                 docker_engine):
    """``stoker stop`` found ranks only below the lease holder: for the Docker launcher it
    recorded the request and told the user to stop the container. It now sends SIGTERM to the
    job's containers: the ranks name the user's stop, commit a stop checkpoint and exit 75,
    which with the request is a stopped attempt (not retried)."""
    import socket
    import subprocess
    import threading

    from stoker.jobs.stop import stop_job
    from stoker.jobs.stop_request import read_stop_request
    from stoker.launch.retry import outcome_of
    from stoker.runtime.records import write_json

    spec = make_spec(f"user-stop-{uuid.uuid4().hex[:8]}", epochs=6, tracking=False)
    launcher = launcher_for(training_image.ref, nproc_per_node=2)
    holder = subprocess.Popen(["sleep", "600"])  # holds the lease, as `stoker run` would
    write_json(spec.parent / "lease.json", {"host": socket.gethostname(), "pid": holder.pid,
                                            "expires": time.time() + 600})
    (container,) = launcher.start(spec)
    stopped: list = []
    try:
        wait_for_step(container, spec.parent, 5)
        stopper = threading.Thread(target=lambda: stopped.append(
            stop_job(spec.parent, "maintenance", timeout_s=120)))
        stopper.start()
        status = container.wait(timeout=120)
        logs = container.logs().decode()
        holder.kill()  # its run ends once the attempt does: the lease is free
        holder.wait()
        stopper.join(timeout=60)
    finally:
        container.remove(force=True)
        holder.kill()
    assert status["StatusCode"] == 75, logs[-3000:]
    assert "stop requested (SIGTERM: stopped by user: maintenance): checkpoint committed" in \
        logs, logs[-3000:]
    assert outcome_of(status["StatusCode"], read_stop_request(spec.parent) is not None) \
        is Outcome.STOPPED
    assert stopped == ["stopped"]


def sleeper_image(engine) -> str:
    """A tiny image holding only the host's /bin/sleep and its libraries (imported, not built)."""
    import io
    import os
    import subprocess
    import tarfile

    libs = [part for line in subprocess.run(["ldd", "/bin/sleep"], capture_output=True,
                                            text=True, check=True).stdout.splitlines()
            for part in line.split() if part.startswith("/")]
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for path in ["/bin/sleep", *libs]:
            tar.add(os.path.realpath(path), arcname=path.lstrip("/"))
    engine.api.import_image_from_data(data.getvalue(), repository="stoker-test/sleeper",
                                      tag="1")
    return "stoker-test/sleeper:1"


def test_refuses_while_an_earlier_runs_container_trains_the_job(docker_engine, make_spec):
    """Input 1(a): an orphaned container of the job (its orchestrator was killed) still runs:
    the launcher starts no second one, and names the container and how to stop it."""
    from stoker.launch.docker import DockerLaunchError

    image = sleeper_image(docker_engine)
    spec = make_spec(f"orphaned-{uuid.uuid4().hex[:8]}", epochs=1, tracking=False)
    job = spec.parent.name
    orphan = docker_engine.containers.run(
        image, ["/bin/sleep", "300"], detach=True, name=f"stoker-{job}-n0-orphan",
        labels={DOCKER_OWNER_LABEL: "true", DOCKER_JOB_LABEL: job})
    try:
        launcher = launcher_for(image, orphan_wait_s=2)
        started = time.monotonic()
        with pytest.raises(DockerLaunchError, match=rf"docker stop -t \d+ {orphan.name}"):
            launcher.run(spec, timeout_s=60)
        assert time.monotonic() - started < 30
        found = docker_engine.containers.list(all=True, filters={
            "label": f"{DOCKER_JOB_LABEL}={job}"})
        assert [c.id for c in found] == [orphan.id]  # no second trainer was started
    finally:
        orphan.remove(force=True)


def test_waits_for_an_orphan_that_stops_once_the_lease_moved(docker_engine, make_spec):
    """Input 1(b): an orphan that exits by itself (as the runtime does once the job lease is no
    longer its own) is waited for, not refused."""
    from stoker.launch.docker import DockerLaunchError, JobContainersRunning

    image = sleeper_image(docker_engine)
    spec = make_spec(f"adopted-{uuid.uuid4().hex[:8]}", epochs=1, tracking=False)
    job = spec.parent.name
    orphan = docker_engine.containers.run(
        image, ["/bin/sleep", "3"], detach=True, name=f"stoker-{job}-n0-orphan",
        labels={DOCKER_OWNER_LABEL: "true", DOCKER_JOB_LABEL: job})
    try:
        launcher = launcher_for(image, orphan_wait_s=60)
        # The stand-in image has no torchrun: starting fails, but only after the orphan left.
        with pytest.raises(DockerLaunchError) as failure:
            launcher.run(spec, timeout_s=60)
        assert not isinstance(failure.value, JobContainersRunning), failure.value
        orphan.reload()
        assert orphan.status == "exited"
    finally:
        orphan.remove(force=True)


ORCHESTRATOR = """
import sys
from pathlib import Path
from stoker.jobs.lease import JobLease
from stoker.launch.docker import DockerLauncher
from stoker.runtime.spec import RunSpec
spec_path, image, port = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lease = JobLease(spec_path.parent, float(sys.argv[4])).acquire()
RunSpec.load(spec_path).model_copy(update={"lease_token": lease.token}).dump(spec_path)
DockerLauncher(image=image, gpus=0, shm_size="256m", shutdown_grace_s=20,
               rdzv_endpoint=f"127.0.0.1:{port}").run(spec_path, timeout_s=900)
"""


def test_a_container_whose_orchestrator_died_stops_once_the_lease_expires(
        training_image, make_spec, docker_engine):
    """Issue 46: `kill -9` of the orchestrator (stoker run) with launcher.kind=docker left the
    training container running when no rerun came: a GPU paid for, nobody recording. The
    runtime inside watches the lease: once it expires it commits a stop checkpoint and the
    container exits; no container of the job is left after the expiry + 30 s."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from image_support import free_port

    ttl_s = 8.0
    spec = make_spec(f"orphan-{uuid.uuid4().hex[:8]}", epochs=200, tracking=False,
                     checkpoint_every_steps=1000)
    job = spec.parent.name
    orchestrator = subprocess.Popen(
        [sys.executable, "-c", ORCHESTRATOR, str(spec), training_image.ref, str(free_port()),
         str(ttl_s)], env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    label = {"label": f"{DOCKER_JOB_LABEL}={job}"}
    try:
        deadline = time.monotonic() + 300
        while not any(e["event"] == "step" for e in events(spec.parent)):
            assert orchestrator.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert docker_engine.containers.list(filters=label)  # it trains in a container
        os.kill(orchestrator.pid, signal.SIGKILL)
        orchestrator.wait(30)
        killed = time.monotonic()
        while docker_engine.containers.list(filters=label) \
                and time.monotonic() < killed + ttl_s + 30:
            time.sleep(1)
        assert not docker_engine.containers.list(filters=label), "a container trains unowned"
        ends = [e for e in events(spec.parent) if e["event"] == "end"]
        assert ends and ends[-1]["outcome"] == "preempted"  # with its stop checkpoint
        assert (spec.parent / "checkpoints" / f"step-{ends[-1]['step']:09d}" / "COMMITTED").exists()
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
        for container in docker_engine.containers.list(all=True, filters=label):
            container.remove(force=True)
