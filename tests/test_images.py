"""Training images: content hash and preflight (unit), then real builds on the Docker Engine.

The integration part builds the real images/Dockerfile once per session (module fixture) on a
locally made Debian base that stands in for the public base images, installs from a wheelhouse
(no package index is reachable inside builds here), pushes to the registry on 127.0.0.1:5000,
and runs the image: its help, and one short CPU training job logging to a real MLflow server.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
from image_support import (
    CACHE_TAG,
    ENTRY,
    delete_repository,
    docker_client,
    ensure_standin_base,
    ensure_wheelhouse,
    extra_registry,
    make_image_folder,
    manifest_digest,
    mlflow_server,
    require_registry,
)

from stoker.config import ConfigError
from stoker.images import (
    BaseImageNotFoundError,
    DockerUnavailableError,
    PushRejectedError,
    RegistryAuthError,
    RegistryCredentials,
    RegistryCredentialsMissingError,
    build_and_push,
    connect,
    credentials_from_env,
    registry_digest,
)
from stoker.imagespec import (
    SOURCE_ROOT,
    ImageRequest,
    ImageSpec,
    content_hash,
    image_ref,
    load_matrix,
    write_context,
)
from stoker.preflight import CudaDriverTooOldError, PreflightError, preflight_cuda

SESSION = uuid.uuid4().hex[:10]
# The first session builds the image from scratch (a few minutes, in the first test's setup).
pytestmark = pytest.mark.timeout(1500)


# --- unit: content hash, context, matrix --------------------------------------------------------

@pytest.fixture
def source_copy(tmp_path) -> Path:
    """A copy of the files that make the image, so tests can edit them."""
    for part in ("images", "stoker/runtime"):
        shutil.copytree(SOURCE_ROOT / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("stoker/__init__.py", "stoker/config.py"):
        shutil.copy2(SOURCE_ROOT / name, tmp_path / name)
    return tmp_path


def _spec(root: Path, **fields) -> ImageSpec:
    return ImageSpec.from_matrix(ENTRY, matrix_path=root / "images/matrix.yaml",
                                 source_root=root, **fields)


def test_hash_is_stable_and_ignores_names_times_and_caches(source_copy):
    spec = _spec(source_copy)
    first = content_hash(spec)
    assert len(first) == 64 and content_hash(spec) == first
    # Where the image goes, file times and byte-code caches do not change what it is.
    assert content_hash(spec.model_copy(update={"registry": "r.example:5000",
                                                "repository": "other/name"})) == first
    os.utime(source_copy / "stoker/runtime/trainer.py", (1, 1))
    (source_copy / "stoker/runtime/__pycache__").mkdir()
    (source_copy / "stoker/runtime/__pycache__/trainer.cpython-311.pyc").write_bytes(b"x")
    assert content_hash(spec) == first
    ref = image_ref(spec, first)
    assert ref == f"127.0.0.1:5000/stoker/train:{first[:32]}"


@pytest.mark.parametrize("change", [
    "dockerfile", "lock", "runtime_source", "new_runtime_file", "config", "verify_script"])
def test_hash_changes_with_every_input_file(source_copy, change):
    spec = _spec(source_copy)
    before = content_hash(spec)
    path = {
        "dockerfile": "images/Dockerfile", "lock": "images/requirements-runtime.txt",
        "runtime_source": "stoker/runtime/launch.py", "new_runtime_file": "stoker/runtime/x.py",
        "config": "stoker/config.py", "verify_script": "images/verify_image.py",
    }[change]
    target = source_copy / path
    target.write_text((target.read_text() if target.exists() else "") + "\n# changed\n")
    assert content_hash(spec) != before


@pytest.mark.parametrize("update", [
    {"base_image": "debian:trixie-slim"}, {"torch": "2.12.0"}, {"python": "3.12"},
    {"cuda": "12.8"}, {"torch_index_url": "https://example.invalid/simple"}])
def test_hash_changes_with_build_arguments(source_copy, update):
    spec = _spec(source_copy)
    changed = spec.model_copy(update={"entry": spec.entry.model_copy(update=update)})
    assert content_hash(changed) != content_hash(spec)


def test_hash_covers_the_wheelhouse_by_name_and_size(source_copy, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"1234")
    spec = _spec(source_copy, pip_install_from="wheelhouse", wheelhouse=wheels)
    before = content_hash(spec)
    assert before != content_hash(_spec(source_copy))
    (wheels / ".marker").write_text("hidden files are not part of the context")
    assert content_hash(spec) == before
    (wheels / "b-2.0-py3-none-any.whl").write_bytes(b"5")
    assert content_hash(spec) != before


def test_context_holds_exactly_the_hashed_files_and_is_reproducible(source_copy):
    spec = _spec(source_copy)
    first, second = io.BytesIO(), io.BytesIO()
    write_context(spec, first)
    write_context(spec, second)
    assert first.getvalue() == second.getvalue()
    with tarfile.open(fileobj=io.BytesIO(first.getvalue())) as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
        folders = {m.name for m in tar.getmembers() if m.isdir()}
    assert files == {name for name, _ in spec.context_files()}
    assert {"Dockerfile", "requirements-runtime.txt", "stoker/config.py",
            "stoker/runtime/launch.py"} <= files
    assert "wheelhouse" in folders  # COPY wheelhouse/ needs it even when empty


def test_matrix_default_and_build_arguments():
    matrix = load_matrix()
    default = matrix.entry()
    assert default is matrix.entries[matrix.default] and default.cuda is not None
    assert "cudnn-runtime" in default.base_image
    args = ImageSpec(entry=default).build_args()
    assert args["BASE_IMAGE"] == default.base_image
    assert args["STOKER_CUDA_VERSION"] == default.cuda
    assert args["STOKER_PYTHON_VERSION"] == default.python
    assert args["STOKER_TORCH_VERSION"] == default.torch
    assert ImageSpec(entry=matrix.entry(ENTRY)).build_args()["STOKER_CUDA_VERSION"] == "none"


def test_matrix_and_request_errors_name_the_field(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text("default: a\nentries:\n  a: {base_image: x, cuda: '12', python: '3.11', "
                   "torch: '2.13.0'}\n")
    with pytest.raises(ConfigError, match=r"entries\.a\.cuda: must be major\.minor"):
        load_matrix(bad)
    bad.write_text("default: b\nentries:\n  a: {base_image: x, cuda: null, python: '3.11', "
                   "torch: '2.13.0'}\n")
    with pytest.raises(ConfigError, match="default 'b' is not one of"):
        load_matrix(bad)
    with pytest.raises(ConfigError, match="matrix entry 'nope': not found"):
        ImageRequest(matrix_entry="nope").spec()
    with pytest.raises(ConfigError, match="wheelhouse: required"):
        ImageRequest(pip_install_from="wheelhouse").spec()
    with pytest.raises(ConfigError, match="image.registry: must be host"):
        ImageSpec.from_matrix(registry="http://127.0.0.1:5000")
    with pytest.raises(ConfigError, match="image.repository: must be a lower-case path"):
        ImageSpec.from_matrix(repository="Stoker/train:v1")


# --- unit: credentials, daemon errors -------------------------------------------------------------

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


# --- unit: CUDA preflight with an NVML stand-in (no GPU here) -------------------------------------

class FakeNVMLError(Exception):
    pass


def fake_nvml(cuda: int | None, driver: str = "550.54.15", devices: int = 1):
    """Same function names as pynvml; ``cuda=None`` means no driver (nvmlInit fails)."""
    calls: list[str] = []

    def init():
        calls.append("init")
        if cuda is None:
            raise FakeNVMLError("NVML Shared Library Not Found")

    return SimpleNamespace(
        NVMLError=FakeNVMLError, calls=calls, nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetCudaDriverVersion=lambda: cuda,
        nvmlSystemGetDriverVersion=lambda: driver,
        nvmlDeviceGetCount=lambda: devices)


def test_preflight_refuses_a_driver_too_old_naming_both_versions():
    nvml = fake_nvml(12040)
    with pytest.raises(CudaDriverTooOldError) as e:
        preflight_cuda("13.0", nvml)
    assert "CUDA 13.0" in str(e.value) and "up to 12.4" in str(e.value)
    assert "550.54.15" in str(e.value)
    assert nvml.calls == ["init", "shutdown"]


@pytest.mark.parametrize(("image", "driver_cuda"), [("12.4", 12040), ("12.8", 13000),
                                                      ("12.10", 12100)])
def test_preflight_accepts_a_driver_that_is_new_enough(image, driver_cuda):
    host = preflight_cuda(image, fake_nvml(driver_cuda, devices=8))
    assert host.device_count == 8 and host.driver_version == "550.54.15"


def test_preflight_cpu_image_needs_no_driver_and_gpu_image_needs_one():
    nvml = fake_nvml(None)
    assert preflight_cuda("none", nvml) is None and preflight_cuda(None, nvml) is None
    assert nvml.calls == []
    with pytest.raises(PreflightError, match="no usable NVIDIA driver"):
        preflight_cuda("12.8", nvml)
    with pytest.raises(PreflightError, match="sees no GPU"):
        preflight_cuda("12.8", fake_nvml(12080, devices=0))


def test_preflight_with_the_real_nvml_library():
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # this machine: no driver; the real library's error is handled
        with pytest.raises(PreflightError, match="no usable NVIDIA driver"):
            preflight_cuda("12.8", pynvml)
        return
    assert preflight_cuda("1.0", pynvml).device_count >= 1  # a GPU host


# --- integration: real Docker Engine and registry -------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    client = docker_client()
    require_registry()
    yield client
    client.close()


@pytest.fixture(scope="module")
def standin_base(engine) -> str:
    return ensure_standin_base(engine)


@pytest.fixture(scope="module")
def wheelhouse(request) -> Path:
    return ensure_wheelhouse(request.config.cache.mkdir("stoker-image-wheelhouse"), ENTRY)


@pytest.fixture(scope="module")
def spec(standin_base, wheelhouse) -> ImageSpec:
    return ImageSpec.from_matrix(ENTRY, base_image=standin_base,
                                 repository=f"stoker-test/train-{SESSION}",
                                 pip_install_from="wheelhouse", wheelhouse=wheelhouse)


@pytest.fixture(scope="module")
def built(engine, spec):
    """The real images/Dockerfile, built and pushed once for this module."""
    lines: list[str] = []
    result = build_and_push(spec, on_log=lines.append)
    previous = _image_id(engine, CACHE_TAG)
    engine.images.get(result.ref).tag(CACHE_TAG)
    if previous and previous != engine.images.get(CACHE_TAG).id and not _tags(engine, previous):
        with contextlib.suppress(docker.errors.APIError):  # e.g. still used by a container
            engine.images.remove(previous)
    yield result, lines
    delete_repository(spec.registry, spec.repository)
    if _image_id(engine, result.ref):
        engine.images.remove(result.ref)


def _tags(engine, image_id: str) -> list[str]:
    try:
        return engine.images.get(image_id).tags
    except docker.errors.ImageNotFound:
        return []


def _image_id(engine, ref: str) -> str | None:
    try:
        return engine.images.get(ref).id
    except docker.errors.ImageNotFound:
        return None


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
    result, lines = built
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
    assert labels["org.opencontainers.image.revision"] == _git_head()
    assert labels["org.opencontainers.image.source"]
    created = datetime.strptime(labels["org.opencontainers.image.created"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs((datetime.now(UTC).replace(tzinfo=None) - created).total_seconds()) < 3600
    uid = engine.containers.run(result.ref, entrypoint=["id", "-u"], network_mode="none",
                                name=f"stoker-test-id-{SESSION}", remove=True)
    assert uid.decode().strip() == "10001"


@pytest.mark.integration
def test_unchanged_image_returns_the_digest_without_building(engine, built, spec):
    result, _ = built
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
    result, _ = built
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

    result, _ = built
    _local(engine, result.ref)
    job = tmp_path / "job"
    make_image_folder(job / "data")
    (job / "out").mkdir(parents=True)
    with mlflow_server(tmp_path / "mlflow") as tracking_uri:
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
def test_missing_base_tag_is_a_named_error(engine):
    base = f"127.0.0.1:5000/stoker-test/no-such-base-{SESSION}:1.0"
    spec = ImageSpec.from_matrix(ENTRY, base_image=base, repository=f"stoker-test/nobase-{SESSION}")
    with pytest.raises(BaseImageNotFoundError) as e:
        build_and_push(spec, on_log=lambda line: None)
    assert base in str(e.value) and "registry 127.0.0.1:5000" in str(e.value)


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
