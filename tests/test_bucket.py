"""Job state in a bucket, against a real S3 HTTP endpoint on 127.0.0.1 (moto's server, reached
through AWS_ENDPOINT_URL as users reach MinIO): checkpoints committed last, torn uploads ignored,
retention deleting in the bucket, the bucket going down during a save, wrong credentials, and a
job killed on one node that resumes on another (`stoker run`: Prefect, DVC, torchrun, MLflow)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from stoker.runtime.checkpoint import Checkpointer

BUCKET = "stoker-jobs"
ADMIN = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}
ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout_s: float = 240, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"process ended ({process.returncode}): "
                                 f"{process.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server that checks signatures: an IAM user's keys work, others are refused.
    Yields the environment a user would set (AWS_ENDPOINT_URL and that user's keys)."""
    import boto3

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(endpoint), timeout_s=60, process=None)
        iam = boto3.client("iam", endpoint_url=endpoint, **_keys(ADMIN))
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=ALLOW_ALL)
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        boto3.client("s3", endpoint_url=endpoint, **_keys(env)).create_bucket(Bucket=BUCKET)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


def _keys(env: dict) -> dict:
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region_name": env["AWS_DEFAULT_REGION"]}


def _answers(endpoint: str) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(endpoint, timeout=1)
    except OSError as e:
        return not isinstance(e, ConnectionError) and "refused" not in str(e)
    return True


@pytest.fixture
def s3_env(s3, monkeypatch):
    from s3fs import S3FileSystem

    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    # s3fs caches filesystems by their arguments: one made for another module's server (its
    # endpoint read from the environment then) would be handed out again.
    S3FileSystem.clear_instance_cache()
    yield s3
    S3FileSystem.clear_instance_cache()


def keys_in(s3: dict, prefix: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], **_keys(s3))
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def put(s3: dict, key: str, body: bytes) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], **_keys(s3))
    client.put_object(Bucket=BUCKET, Key=key, Body=body)


def test_checkpoints_in_a_bucket_commit_last_purge_there_and_skip_torn_uploads(s3_env):
    """Files first, COMMITTED last; keep_latest_k deletes in the bucket; a step holding files
    but no marker (a torn upload) and one whose hash does not match are never loaded."""
    url = f"s3://{BUCKET}/unit/ckpt"
    ckpt = Checkpointer(url, 0, 1, keep_latest_k=2)
    assert ckpt.remote and ckpt.async_save  # uploads never block the loop beyond the host copy
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"w": torch.full((3,), float(step))}, {"rng": step})
    ckpt.wait()
    assert ckpt.committed_steps() == [3, 4]
    stored = keys_in(s3_env, "unit/ckpt/")
    assert not [k for k in stored if "step-000000001" in k or "step-000000002" in k]
    assert "unit/ckpt/step-000000004/COMMITTED" in stored
    assert not [k for k in stored if ".tmp-" in k]

    put(s3_env, "unit/ckpt/step-000000009/shared.pt", b"half an upload")  # torn: no marker
    put(s3_env, "unit/ckpt/step-000000009/rank-00000.pt", b"x")
    warnings: list[str] = []
    loaded = Checkpointer(url, 0, 1).load_latest(warn=warnings.append)
    assert loaded.step == 4 and torch.equal(loaded.shared["w"], torch.full((3,), 4.0))
    assert any("step-000000009" in w and "no COMMITTED" in w for w in warnings)

    marker = json.loads(Checkpointer(url, 0, 1).fs.cat_file(f"{BUCKET}/unit/ckpt/"
                                                             "step-000000004/COMMITTED"))
    marker["files"]["shared.pt"] = "0" * 64
    put(s3_env, "unit/ckpt/step-000000004/COMMITTED", json.dumps(marker).encode())
    assert Checkpointer(url, 0, 1).load_latest(warn=warnings.append).step == 3


@pytest.fixture
def restartable_s3(monkeypatch):
    """An S3 server in this process that can go down and come back with its objects (moto
    keeps them in memory across a restart); yields (start, stop)."""
    import boto3
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    port = free_port()
    servers: list[ThreadedMotoServer] = []

    def start() -> None:
        servers.append(ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False))
        servers[-1].start()

    def stop() -> None:
        servers[-1].stop()

    for name, value in {**ADMIN, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                        "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(name, value)
    S3FileSystem.clear_instance_cache()  # a cached filesystem keeps its old endpoint
    start()
    boto3.client("s3").create_bucket(Bucket="down-bucket")
    yield start, stop
    stop()
    S3FileSystem.clear_instance_cache()


def test_a_bucket_down_during_a_save_retries_and_never_trusts_half_a_step(restartable_s3,
                                                                          caplog):
    """The store goes away mid-training: saves return at once (training goes on), an upload is
    retried until the store is back, one given up after its tries leaves no committed step, and
    the next save commits again."""
    start, stop = restartable_s3
    url = "s3://down-bucket/job/checkpoints"
    ckpt = Checkpointer(url, 0, 1, keep_latest_k=5, upload_attempts=3)
    ckpt.save(1, {"w": torch.ones(2)}, {"rng": 1})
    ckpt.wait()

    stop()
    began = time.monotonic()
    ckpt.save(2, {"w": torch.full((2,), 2.0)}, {"rng": 2})
    assert time.monotonic() - began < 0.5  # the loop does not wait for the store
    time.sleep(0.5)
    start()  # back before the last try: the retry commits step 2
    ckpt.wait()
    assert ckpt.failed_saves == [] and ckpt.committed_steps() == [1, 2]
    assert "step-000000002: upload try 2 of 3" in caplog.text  # it did fail once

    stop()
    ckpt.save(3, {"w": torch.full((2,), 3.0)}, {"rng": 3})
    ckpt.wait()  # every try failed: logged, not raised
    assert ckpt.failed_saves == [3]
    start()
    reader = Checkpointer(url, 0, 1)
    assert 3 not in reader.committed_steps()
    assert reader.load_latest().step == 2
    ckpt.save(4, {"w": torch.full((2,), 4.0)}, {"rng": 4})
    ckpt.wait()
    assert Checkpointer(url, 0, 1).load_latest().step == 4


def test_two_nodes_cannot_hold_one_job(s3_env):
    """The lease object: a live holder refuses a second node; a conditional write that loses a
    race refuses too; after release the job can be taken."""
    from stoker.jobs.bucket_lease import BucketLease, _Conflict
    from stoker.jobs.lease import JobBusy
    from stoker.jobs.store import JobStore

    store = JobStore(f"s3://{BUCKET}/leases")
    first = BucketLease(store, "job-1", ttl_s=30).acquire()
    try:
        with pytest.raises(JobBusy, match="job-1 is being trained by host"):
            BucketLease(store, "job-1", ttl_s=30).acquire()
        second = BucketLease(store, "job-1", ttl_s=30)
        stale = second.objects.get()[1]
        assert first.renew()  # the object changed since `second` read it
        with pytest.raises(_Conflict):  # If-Match on an outdated ETag: the store refuses
            second.objects.put(second._record(), stale)
    finally:
        first.release()
    assert keys_in(s3_env, "leases/job-1/") == []
    BucketLease(store, "job-1", ttl_s=30).acquire().release()

    lost: list[str] = []  # another node took the job over: the holder learns it at renewal
    holder = BucketLease(store, "job-2", ttl_s=0.6, on_lost=lost.append).acquire()
    try:
        other = {**holder._record(), "token": "other-node", "host": "node-b", "pid": 1}
        put(s3_env, "leases/job-2/lease.json", json.dumps(other).encode())
        wait_for(lambda: lost, timeout_s=10)
        assert "taken over by host node-b" in lost[0] and holder.lost == lost[0]
    finally:
        holder.release()
    assert keys_in(s3_env, "leases/job-2/")  # not ours any more: left to its owner


@pytest.fixture(scope="module")
def api_env(s3):
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), **s3}


def command(work: Path, store: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}",
            f"checkpoint_dir={store}", "tracking.system_metrics_interval_s=null",
            "train.epochs=2", "train.checkpoint_every_steps=5", *overrides]


def test_wrong_credentials_are_one_named_error_before_training(api_env, tmp_path):
    env = {**api_env, "AWS_SECRET_ACCESS_KEY": "not-the-secret-1234"}
    work = tmp_path / "work"
    run = subprocess.run(command(work, f"s3://{BUCKET}/jobs"), env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    line = run.stderr.strip()
    assert line.count("\n") == 0 and "Traceback" not in line, line
    assert f"checkpoint_dir s3://{BUCKET}/jobs: cannot write there" in line
    assert "not-the-secret-1234" not in run.stdout + run.stderr
    assert not list(work.glob("jobs/*/progress.jsonl"))  # nothing trained


def kill_everything(process: subprocess.Popen) -> None:
    """SIGKILL the orchestrator and every process under it at once (a lost machine)."""
    tree = [process.pid] + [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)


def final_model(store: str, name: str) -> dict:
    loaded = Checkpointer(f"{store}/{name}/checkpoints", 0, 1).load_latest()
    return loaded.step, loaded.shared["model"]


def test_a_job_killed_on_one_node_resumes_on_another_from_the_bucket(api_env, s3_env, tmp_path):
    """Node A trains into the bucket and is SIGKILLed with its disk deleted; node B runs the
    same command: it finds the job by key in the bucket, resumes from the last committed
    step in the same MLflow run, counts A's attempt, and ends bitwise equal to a run that was
    never interrupted."""
    from mlflow import MlflowClient

    from stoker.jobs.attempts import AttemptLog
    from stoker.runtime.progress import read_events

    store, tracking = f"s3://{BUCKET}/nodes", f"sqlite:///{tmp_path / 'shared-mlflow.db'}"
    # Long enough that node A is still training when the bucket holds all it waits for (2
    # epochs could end first on a fast or lightly loaded machine: nothing left to resume).
    sized = (f"tracking.tracking_uri={tracking}", "train.epochs=10",
             "train.checkpoint_every_steps=20")
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    first = subprocess.Popen(command(node_a, store, *sized),
                             env=api_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=tmp_path, start_new_session=True)
    try:
        wait_for(lambda: any(k.endswith("/COMMITTED") for k in keys_in(api_env, "nodes/"))
                 and any(k.endswith("/mlflow_run_id") for k in keys_in(api_env, "nodes/"))
                 and any(k.endswith("/attempts.jsonl") for k in keys_in(api_env, "nodes/"))
                 # billed up to the last heartbeat in the bucket (the attempt record is
                 # written through at once; the heartbeat follows every 3 s)
                 and any(k.endswith("/heartbeat.json") for k in keys_in(api_env, "nodes/")),
                 process=first)
        kill_everything(first)
    finally:
        if first.poll() is None:
            first.kill()
    name = keys_in(api_env, "nodes/")[0].split("/")[1]
    run_id = (node_a / "jobs" / name / "mlflow_run_id").read_text()
    ended = [e for e in read_events(node_a / "jobs" / name) if e["event"] == "end"]
    assert not ended, f"node A finished training before it was killed: {ended}"
    shutil.rmtree(node_a)  # the machine and its disk are gone

    second = subprocess.run(command(node_b, store, *sized),
                            env=api_env, capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    job = node_b / "jobs" / name
    assert (job / "mlflow_run_id").read_text() == run_id  # the same MLflow run continued
    history = AttemptLog(job).history()
    assert [(a["number"], a["outcome"]) for a in history] == [(1, "interrupted"), (2, "completed")]
    assert history[0]["interrupted"] and history[0]["duration_s"] > 0
    starts = [e for e in read_events(job) if e["event"] == "start"]
    assert starts[0]["step"] == 0 and starts[-1]["step"] > 0  # resumed, not restarted
    run = MlflowClient(tracking).get_run(run_id)
    assert run.data.tags["stoker.attempts"] == "2" and run.info.status == "FINISHED"
    stored = keys_in(api_env, f"nodes/{name}/")
    assert f"nodes/{name}/pipeline_done.json" in stored
    assert f"nodes/{name}/lease.json" not in stored  # released when the flow ended

    baseline = subprocess.run(command(tmp_path / "node-c", str(tmp_path / "store-c"), *sized[1:]),
                              env=api_env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
    assert baseline.returncode == 0, baseline.stdout[-3000:] + baseline.stderr[-3000:]
    step_b, model_b = final_model(store, name)
    [job_c] = (tmp_path / "store-c").iterdir()  # the same key, another start time
    assert job_c.name.split("-")[0] == name.split("-")[0]
    step_c, model_c = final_model(str(tmp_path / "store-c"), job_c.name)
    assert step_b == step_c and model_b.keys() == model_c.keys()
    assert all(torch.equal(model_b[k], model_c[k]) for k in model_b)


def test_mlflow_server_keeps_artifacts_in_the_bucket(s3, tmp_path):
    """The fully remote set-up's artifact store: `mlflow server --artifacts-destination s3://…`
    stores what a client logs over HTTP as objects in the bucket."""
    from mlflow import MlflowClient

    from tests.mlflow_server import MlflowServer

    env = {**s3, "MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"]}
    with MlflowServer(tmp_path / "mlflow", f"s3://{BUCKET}/mlartifacts", env) as server:
        client = MlflowClient(server.uri)
        run = client.create_run(client.create_experiment("bucket-artifacts"))
        (tmp_path / "model.txt").write_text("weights")
        client.log_artifact(run.info.run_id, str(tmp_path / "model.txt"))
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["model.txt"]
    assert [k for k in keys_in(s3, "mlartifacts/") if k.endswith("/model.txt")]


def test_a_dataset_pulls_from_a_dvc_remote_in_the_bucket(s3_env, tmp_path):
    """The fully remote set-up's data: a DVC repository whose remote is ``s3://…`` (dvc-s3,
    endpoint and keys from the environment) pushes there and `pull_dataset` pulls from it."""
    from stoker.data.pull import pull_dataset
    from tests.data_repos import make_repo

    repo = make_repo(tmp_path / "data", {"v1": {"a": 3, "b": 2}},
                     remote=f"s3://{BUCKET}/dvc")
    assert [k for k in keys_in(s3_env, "dvc/files/md5/")]  # pushed as objects in the bucket
    ref = pull_dataset(str(repo), "v1", "data/images", tmp_path / "datasets")
    assert sorted(p.name for p in Path(ref.local_path).iterdir()) == ["a", "b"]
    assert len(list(Path(ref.local_path).rglob("*.png"))) == 5


def test_checkpoint_dir_is_a_path_or_url_and_names_itself_when_wrong(tmp_path, monkeypatch):
    from stoker.config import ConfigError, PipelineConfig, validate

    monkeypatch.chdir(tmp_path)
    assert PipelineConfig(checkpoint_dir="store").checkpoint_dir == str(tmp_path / "store")
    assert PipelineConfig(checkpoint_dir="s3://b/jobs/").checkpoint_dir == "s3://b/jobs"
    assert PipelineConfig().checkpoint_dir is None  # default: <work_dir>/jobs, as before
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        validate(PipelineConfig, {"checkpoint_dir": "S 3://b"})


def test_a_stale_local_cache_is_refreshed_from_the_bucket(s3_env, tmp_path):
    """A node that ran the job earlier comes back after another node ran it: the attempt
    record grows from the bucket; records only it has stay; a missing one is copied."""
    from stoker.jobs.store import JobStore

    store = JobStore(f"s3://{BUCKET}/cache")
    job = tmp_path / "jobs" / "k-1"
    job.mkdir(parents=True)
    (job / "attempts.jsonl").write_text('{"number": 1, "state": "started"}\n')
    (job / "result.json").write_text('{"local": true}')
    put(s3_env, "cache/k-1/attempts.jsonl",
        b'{"number": 1, "state": "started"}\n{"number": 1, "state": "ended"}\n')
    put(s3_env, "cache/k-1/result.json", b'{"local": false}')
    put(s3_env, "cache/k-1/mlflow_run_id", b"abc123")
    assert sorted(store.pull("k-1", job)) == ["attempts.jsonl", "mlflow_run_id"]
    assert (job / "attempts.jsonl").read_text().count("\n") == 2
    assert (job / "result.json").read_text() == '{"local": true}'
    assert (job / "mlflow_run_id").read_text() == "abc123"


def test_docker_containers_checkpoint_to_the_bucket_and_resume_from_it(
        s3, training_image, make_spec, docker_engine, mlflow_http):
    """The docker launcher with ``checkpoint_dir`` in a bucket: the training image reaches the
    store with the credentials of the environment (never in the logs), `docker stop` commits a
    stop checkpoint there, and the next attempt resumes from the bucket's newest step."""
    import uuid

    from conftest import events

    from stoker.launch.docker import DockerLauncher
    from stoker.runtime.spec import RunSpec

    job = f"docker-bucket-{uuid.uuid4().hex[:8]}"
    path = make_spec(job, epochs=4, tracking_uri=mlflow_http.uri)
    url = f"s3://{BUCKET}/docker/{job}/checkpoints"
    RunSpec.load(path).model_copy(update={"checkpoint_dir": url}).dump(path)
    launcher = DockerLauncher(image=training_image.ref, gpus=0, shm_size="256m",
                              shutdown_grace_s=20, nproc_per_node=2,
                              rdzv_endpoint=f"127.0.0.1:{free_port()}", environment=dict(s3))
    (container,) = launcher.start(path)
    try:
        wait_for(lambda: any(e["event"] == "step" and e["step"] >= 25
                             for e in events(path.parent)), timeout_s=300)
        container.stop(timeout=40)
        status = container.wait(timeout=60)
        logs = container.logs().decode()
    finally:
        container.remove(force=True)
    assert status["StatusCode"] == 75, logs[-3000:]
    stopped = [e for e in events(path.parent) if e["event"] == "end"][-1]
    marker = f"docker/{job}/checkpoints/step-{stopped['step']:09d}/COMMITTED"
    assert marker in keys_in(s3, f"docker/{job}/")
    assert not (path.parent / "checkpoints").exists()  # nothing went to the local disk

    lines: list[str] = []
    assert launcher.run(path, on_line=lines.append, timeout_s=600) == 0, "\n".join(lines[-60:])
    starts = [e for e in events(path.parent) if e["event"] == "start"]
    assert starts[-1]["resumed"] and starts[-1]["step"] == stopped["step"]
    said = logs + "\n".join(lines)
    assert s3["AWS_SECRET_ACCESS_KEY"] not in said and s3["AWS_ACCESS_KEY_ID"] not in said
