"""Training images on the real Docker Engine and registry, plus credential and daemon errors.

The integration part builds the real images/Dockerfile once per session (module fixture) on a
locally made Debian base that stands in for the public base images, installs from a wheelhouse
(no package index is reachable inside builds here), pushes to the registry on 127.0.0.1:5000,
and runs the image: its help, and one short CPU training job logging to a real MLflow server.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from datetime import UTC, datetime

import docker.errors
import pytest
from image_fixtures import SESSION, _image_id  # noqa: E402
from image_support import (
    ENTRY,
    REGISTRY,
    delete_repository,
    extra_registry,
    make_image_folder,
    manifest_digest,
    skip_or_fail,
)
from mlflow_server import MlflowServer

from stoker.images.build import (
    BaseImageNotFoundError,
    DockerUnavailableError,
    ImageBuildError,
    PushRejectedError,
    RegistryAuthError,
    RegistryCredentials,
    RegistryCredentialsMissingError,
    build_and_push,
    connect,
    credentials_from_env,
    ensure_base_image,
    registry_digest,
    without_userinfo,
)
from stoker.images.spec import (
    SOURCE_ROOT,
    ImageSpec,
    content_hash,
    image_ref,
)

# The first session builds the image from scratch (a few minutes, in the first test's setup).
pytestmark = pytest.mark.timeout(1500)


# --- unit: credentials, daemon errors -------------------------------------------------------------

def test_missing_engine_skips_but_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no Docker Engine.*CI=true"):
        skip_or_fail("no Docker Engine reachable")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no Docker Engine"):
        skip_or_fail("no Docker Engine reachable")


@pytest.mark.parametrize(("remote", "label"), [
    ("https://ci:ghp_secret@github.com/org/stoker.git", "https://github.com/org/stoker.git"),
    ("git@github.com:org/stoker.git", "git@github.com:org/stoker.git"),
    ("/srv/git/stoker", "/srv/git/stoker")])
def test_source_label_never_carries_a_token(remote, label):
    assert without_userinfo(remote) == label


def test_credentials_from_env_name_the_missing_variable():
    assert credentials_from_env({}) is None
    with pytest.raises(RegistryCredentialsMissingError, match="STOKER_REGISTRY_PASSWORD"):
        credentials_from_env({"STOKER_REGISTRY_USERNAME": "alice"})
    creds = credentials_from_env({"STOKER_REGISTRY_USERNAME": "alice",
                                  "STOKER_REGISTRY_PASSWORD": "hunter2"})
    assert creds.auth_config("r:5000")["password"] == "hunter2"
    assert "hunter2" not in repr(creds) and "hunter2" not in str(creds)


@pytest.mark.parametrize("host", ["unix:///nonexistent/stoker-docker.sock", "tcp://127.0.0.1:1"])
def test_unreachable_daemon_fails_fast_naming_it(host):
    spec = ImageSpec.from_matrix(ENTRY)
    started = time.monotonic()
    with pytest.raises(DockerUnavailableError, match=f"Docker daemon at {host} is not reachable"):
        build_and_push(spec, docker_host=host, on_log=lambda line: None)
    assert time.monotonic() - started < 15  # one attempt, no retry loop


# --- integration: real Docker Engine and registry -------------------------------------------------

def _local(engine, ref: str):
    """The image for ``ref`` on this engine, pulled from the registry when not present."""
    if _image_id(engine, ref) is None:
        engine.images.pull(ref)
    return engine.images.get(ref)


def _git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=SOURCE_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.integration
def test_build_pushes_labels_and_runs_as_non_root(engine, built, spec):
    result, lines, head = built
    assert result.built and result.size_bytes > 100e6
    assert result.ref == image_ref(spec, content_hash(spec))
    # The registry's own HTTP API holds the tag at the digest the build returned.
    assert manifest_digest(spec.registry, spec.repository, result.tag) == result.digest
    assert any(line.startswith("Step 1/") for line in lines)
    image = _local(engine, result.ref)
    assert any(d.endswith(result.digest) for d in image.attrs["RepoDigests"])
    config = image.attrs["Config"]
    assert config["User"] == "stoker"
    assert config["Entrypoint"] == ["/opt/stoker/venv/bin/python", "-m", "stoker.runtime.launch"]
    labels = config["Labels"]
    entry = spec.entry
    assert labels["io.stoker.cuda-version"] == "none"
    assert labels["io.stoker.torch-version"] == entry.torch
    assert labels["io.stoker.python-version"] == entry.python
    assert labels["io.stoker.content-hash"] == result.content_hash
    assert labels["org.opencontainers.image.revision"] == head
    assert labels["org.opencontainers.image.source"]
    created = datetime.strptime(labels["org.opencontainers.image.created"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs((datetime.now(UTC).replace(tzinfo=None) - created).total_seconds()) < 3600
    uid = engine.containers.run(result.ref, entrypoint=["id", "-u"], network_mode="none",
                                name=f"stoker-test-id-{SESSION}", remove=True)
    assert uid.decode().strip() == "10001"


@pytest.mark.integration
def test_unchanged_image_returns_the_digest_without_building(engine, built, spec):
    result, *_ = built
    engine.images.remove(result.ref)  # untag here: a rebuild would bring the tag back
    lines: list[str] = []
    again = build_and_push(spec, on_log=lines.append)
    assert not again.built
    assert (again.ref, again.digest) == (result.ref, result.digest)
    assert not any("Step" in line for line in lines)
    assert _image_id(engine, result.ref) is None  # nothing was built or pulled
    api = connect()
    assert registry_digest(api, result.ref) == result.digest
    api.close()


@pytest.mark.integration
def test_image_smoke_commands(engine, built):
    result, *_ = built
    _local(engine, result.ref)
    runtime_help = engine.containers.run(
        result.ref, ["-m", "stoker.runtime", "--help"], entrypoint=["python"],
        network_mode="none", name=f"stoker-test-help-{SESSION}", remove=True).decode()
    assert "run spec YAML" in runtime_help
    launcher_help = engine.containers.run(
        result.ref, ["--help"], network_mode="none", name=f"stoker-test-launch-{SESSION}",
        remove=True).decode()
    assert "--nproc-per-node" in launcher_help and "--rdzv-backend" in launcher_help
    prefect = engine.containers.run(
        result.ref, ["-c", "import importlib.util as u; print(u.find_spec('prefect'))"],
        entrypoint=["python"], network_mode="none", name=f"stoker-test-noprefect-{SESSION}",
        remove=True).decode()
    assert prefect.strip() == "None"


@pytest.mark.integration
def test_one_cpu_training_job_in_the_image_logs_to_mlflow(engine, built, tmp_path):
    from mlflow import MlflowClient

    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    result, *_ = built
    _local(engine, result.ref)
    job = tmp_path / "job"
    make_image_folder(job / "data")
    (job / "out").mkdir(parents=True)
    with MlflowServer(tmp_path / "mlflow") as server:
        tracking_uri = server.uri
        RunSpec(train=TrainConfig(epochs=1, global_batch_size=4, checkpoint_every_steps=2,
                                  keep_latest_k=1),
                data_dir="/job/data", job_dir="/job/out", tracking_uri=tracking_uri,
                experiment="image-smoke", run_name="in-image",
                tags=result.lineage_tags()).dump(job / "spec.yaml")
        subprocess.run(["chmod", "-R", "a+rwX", str(job)], check=True)  # the image's user
        container = engine.containers.run(
            result.ref, ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1",
                         "--max-restarts=0", "-m", "stoker.runtime", "/job/spec.yaml"],
            network_mode="host", volumes={str(job): {"bind": "/job", "mode": "rw"}},
            name=f"stoker-test-train-{SESSION}", detach=True)
        try:
            status = container.wait(timeout=300)
            logs = container.logs().decode()
        finally:
            container.remove(force=True)
        assert status["StatusCode"] == 0, logs[-3000:]
        run_id = (job / "out/mlflow_run_id").read_text().strip()
        run = MlflowClient(tracking_uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {"train_loss", "val_accuracy"} <= run.data.metrics.keys()
    assert run.data.tags["stoker.image_digest"] == result.digest
    assert run.data.tags["stoker.image"] == result.ref
    assert (job / "out/result.json").is_file()
    assert any((job / "out/checkpoints").glob("step-*/COMMITTED"))


@pytest.mark.integration
def test_base_image_is_pulled_from_its_registry_when_not_local(engine, standin_base):
    ref = f"{REGISTRY}/stoker-test/base-{SESSION}:bookworm"
    engine.images.get(standin_base).tag(ref)
    try:
        for chunk in engine.api.push(ref, stream=True, decode=True):
            assert "error" not in chunk, chunk
        engine.images.remove(ref)  # untag: only the registry has this name now
        lines: list[str] = []
        api = connect()
        ensure_base_image(api, ref, on_log=lines.append)
        api.close()
        assert engine.images.get(ref).id == engine.images.get(standin_base).id
        assert f"pulling base image {ref}" in lines
    finally:
        delete_repository(REGISTRY, f"stoker-test/base-{SESSION}")
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.images.remove(ref)


@pytest.mark.integration
def test_missing_base_tag_is_a_named_error(engine):
    base = f"127.0.0.1:5000/stoker-test/no-such-base-{SESSION}:1.0"
    spec = ImageSpec.from_matrix(ENTRY, base_image=base, repository=f"stoker-test/nobase-{SESSION}")
    with pytest.raises(BaseImageNotFoundError) as e:
        build_and_push(spec, on_log=lambda line: None)
    assert base in str(e.value) and "registry 127.0.0.1:5000" in str(e.value)


@pytest.mark.integration
def test_a_failed_step_says_its_cause_in_a_short_first_line(engine, built, spec):
    """New-user trial: the error line repeated the ~600-character shell command of the pip
    step and the reason (pip's own ERROR line) was further up the log."""
    missing = spec.model_copy(update={"entry": spec.entry.model_copy(update={"torch": "9.9.9"})})
    with pytest.raises(ImageBuildError) as e:
        build_and_push(missing, on_log=lambda line: None)  # the apt layers come from the cache
    first = str(e.value).splitlines()[0]
    assert first.endswith("(ERROR: No matching distribution found for torch==9.9.9)"), first
    assert "returned a non-zero code: 1" in first or "did not complete" in first, first
    assert len(first) < 300, first


@pytest.mark.integration
def test_rejected_push_is_a_named_error(engine, built, spec, tmp_path):
    with extra_registry(tmp_path / "ro", readonly=True) as registry:
        rejected = spec.model_copy(update={"registry": registry})
        with pytest.raises(PushRejectedError) as e:
            build_and_push(rejected, on_log=lambda line: None)  # builds from cache, then pushes
    ref = image_ref(rejected, content_hash(rejected))
    assert f"registry {registry} rejected the push of {ref}" in str(e.value)
    engine.images.remove(ref)


@pytest.mark.integration
def test_registry_credentials_missing_rejected_and_never_logged(engine, spec, tmp_path,
                                                                monkeypatch, caplog):
    import bcrypt

    password = f"pw-{uuid.uuid4().hex}"
    line = "ci:" + bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    monkeypatch.delenv("STOKER_REGISTRY_USERNAME", raising=False)
    monkeypatch.delenv("STOKER_REGISTRY_PASSWORD", raising=False)
    logged: list[str] = []
    with extra_registry(tmp_path / "auth", htpasswd=line) as registry:
        private = spec.model_copy(update={"registry": registry})
        with pytest.raises(RegistryCredentialsMissingError,
                           match=f"registry {registry} requires credentials"):
            build_and_push(private, on_log=logged.append)
        wrong = RegistryCredentials(username="ci", password="not-it")
        with pytest.raises(RegistryAuthError, match=f"registry {registry} rejected the cred"):
            build_and_push(private, credentials=wrong, on_log=logged.append)
        # Accepted: the registry answers "no such tag" instead of "unauthorized".
        monkeypatch.setenv("STOKER_REGISTRY_USERNAME", "ci")
        monkeypatch.setenv("STOKER_REGISTRY_PASSWORD", password)
        api = connect()
        ref = image_ref(private, content_hash(private))
        assert registry_digest(api, ref, credentials_from_env()) is None
        api.close()
    assert password not in "\n".join(logged) + caplog.text
