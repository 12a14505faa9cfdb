"""CUDA preflight: NVML stand-in (no GPU here) behind pynvml's names, and the real library."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fake_nvml import FakeNvml, Gpu, NVMLError_LibraryNotFound

from stoker.images.preflight import CudaDriverTooOldError, PreflightError, preflight_cuda


@dataclass
class DriverNvml(FakeNvml):
    """The cost guard's NVML stand-in plus the two system queries the preflight makes."""

    cuda_driver_version: int = 12040  # nvmlSystemGetCudaDriverVersion: 12040 is CUDA 12.4
    driver_version: str = "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver_version

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version


def fake_nvml(cuda: int | None, devices: int = 1) -> DriverNvml:
    """``cuda=None``: no driver (nvmlInit raises the real NVMLError_LibraryNotFound)."""
    return DriverNvml(frames=[[Gpu(index=i) for i in range(devices)]],
                      init_error=NVMLError_LibraryNotFound() if cuda is None else None,
                      cuda_driver_version=cuda or 0)


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


# --- The docker launch path: the preflight runs whatever the image's source --------------------

@pytest.fixture(scope="module")
def labelled_images():
    """Two tiny images (busybox, no entrypoint): one labelled CUDA 13.0, one a CPU image."""
    import tarfile
    import tempfile
    import uuid

    from test_cost_guard_actions import _unavailable

    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:  # any failure to reach the engine means: no Docker here
        _unavailable(f"Docker Engine not reachable: {e}")
    made = {}
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = f"{tmp}/rootfs.tar"
        with tarfile.open(rootfs, "w") as tar:
            tar.add("/bin/busybox", arcname="bin/busybox")
        tag = uuid.uuid4().hex[:12]
        for cuda in ("13.0", "none"):
            repository = f"stoker-preflight-{cuda.replace('.', '')}"
            client.api.import_image_from_file(
                rootfs, repository=repository, tag=tag,
                changes=[f"LABEL io.stoker.cuda-version={cuda}"])
            made[cuda] = f"{repository}:{tag}"
    yield client, made
    for ref in made.values():
        client.images.remove(ref, force=True)
    client.close()


def spec_for(tmp_path):
    import uuid

    from stoker.config import TrainConfig
    from stoker.runtime.spec import RunSpec

    job_dir = tmp_path / "jobs" / f"preflight-{uuid.uuid4().hex[:12]}"  # unique job label
    job_dir.mkdir(parents=True)
    RunSpec(train=TrainConfig(), data_dir=str(tmp_path), job_dir=str(job_dir)).dump(
        job_dir / "spec.yaml")
    return job_dir / "spec.yaml"


def leftovers(client, spec_path) -> list:
    from stoker.ownership import DOCKER_JOB_LABEL

    return client.containers.list(all=True, filters={
        "label": f"{DOCKER_JOB_LABEL}={spec_path.parent.name}"})


def test_docker_launch_refuses_a_given_image_too_new_for_the_driver(labelled_images, tmp_path):
    """Input 6: an image given by reference (not built by the flow), labelled CUDA 13.0, on a
    host whose driver supports 12.4: refused before any container exists."""
    from stoker.launch.docker import DockerLauncher

    client, images = labelled_images
    spec = spec_for(tmp_path)
    nvml = fake_nvml(12040)
    launcher = DockerLauncher(image=images["13.0"], gpus="all", nvml=nvml)
    with pytest.raises(CudaDriverTooOldError, match="needs CUDA 13.0.*up to 12.4"):
        launcher.start(spec)
    assert nvml.calls == ["init", "shutdown"]
    assert leftovers(client, spec) == []
    # A CPU run of the same image needs no driver: no preflight.
    assert DockerLauncher(image=images["13.0"], gpus=0, nvml=fake_nvml(None)).preflight(
        {"io.stoker.cuda-version": "13.0"}) is None


def test_a_container_that_fails_to_start_is_removed(labelled_images, tmp_path):
    """Input 6: the start fails (the busybox image has no torchrun entrypoint): the container
    created for it is removed, none is left in state Created."""
    from stoker.launch.docker import DockerLauncher, DockerLaunchError

    client, images = labelled_images
    spec = spec_for(tmp_path)
    with pytest.raises(DockerLaunchError, match="cannot start node 0"):
        DockerLauncher(image=images["none"], gpus=0).start(spec)
    assert leftovers(client, spec) == []
