"""Preflight on a GPU host: refuse an image whose CUDA version the host's driver cannot run.

A CUDA 13.0 image on a driver that supports CUDA 12.4 fails at the first kernel, minutes into a
paid run; NVML tells before anything starts. The NVML module is a parameter (``pynvml`` from the
``nvidia-ml-py`` package in production) so that tests on machines without a GPU pass a stand-in
with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

CUDA_LABEL = "io.stoker.cuda-version"


class PreflightError(RuntimeError):
    """The host cannot run the image; the message names what the image needs and the host has."""


class CudaDriverTooOldError(PreflightError):
    """The host's driver supports an older CUDA than the image's."""


@dataclass(frozen=True)
class HostCuda:
    """What the host's NVIDIA driver offers (from NVML).

    Attributes:
        driver_version: driver version string, e.g. ``580.82.07``.
        cuda_version: highest CUDA version the driver supports, ``major.minor``.
        device_count: GPUs visible to NVML.
    """

    driver_version: str
    cuda_version: str
    device_count: int


def _parse_major_minor(version: str, what: str) -> tuple[int, int]:
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise PreflightError(f"{what} {version!r}: expected major.minor, e.g. 12.8") from None


def host_cuda(nvml: ModuleType | Any) -> HostCuda:
    """Read the driver version and its CUDA version through NVML.

    Args:
        nvml: the ``pynvml`` module (or an object with its functions and ``NVMLError``).

    Raises:
        PreflightError: NVML cannot be initialised (no driver), or it sees no GPU.
    """
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise PreflightError(f"no usable NVIDIA driver on this host (NVML: {e})") from None
    try:
        encoded = nvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 for CUDA 12.4
        driver = nvml.nvmlSystemGetDriverVersion()
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as e:
        raise PreflightError(f"NVML could not report the driver's CUDA version: {e}") from None
    finally:
        nvml.nvmlShutdown()
    driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    cuda = f"{encoded // 1000}.{encoded % 1000 // 10}"
    if count < 1:
        raise PreflightError(f"NVIDIA driver {driver} is loaded but NVML sees no GPU")
    return HostCuda(driver_version=driver, cuda_version=cuda, device_count=count)


def preflight_cuda(image_cuda_version: str | None, nvml: ModuleType | Any) -> HostCuda | None:
    """Check that this host's driver can run an image built for ``image_cuda_version``.

    A driver runs CUDA versions up to the one it reports (``nvmlSystemGetCudaDriverVersion``).
    The check is conservative: it does not count on CUDA minor-version compatibility, which
    leaves out PTX JIT and some libraries.

    Args:
        image_cuda_version: the image's CUDA ``major.minor`` (its ``io.stoker.cuda-version``
            label); None or ``"none"``: a CPU image, nothing to check.
        nvml: the ``pynvml`` module (or a stand-in with the same functions).

    Returns:
        The host's driver facts, or None for a CPU image.

    Raises:
        CudaDriverTooOldError: the driver supports an older CUDA (names both versions and the
            driver).
        PreflightError: no usable driver or no GPU.
    """
    if image_cuda_version in (None, "", "none"):
        return None
    needed = _parse_major_minor(image_cuda_version, "image CUDA version")
    host = host_cuda(nvml)
    if _parse_major_minor(host.cuda_version, "driver CUDA version") < needed:
        raise CudaDriverTooOldError(
            f"the image needs CUDA {image_cuda_version}, but NVIDIA driver {host.driver_version} "
            f"on this host supports CUDA up to {host.cuda_version}: update the driver, or use an "
            f"image built for CUDA <= {host.cuda_version} (images/matrix.yaml)")
    return host


def image_cuda_version(labels: dict[str, str] | None) -> str | None:
    """The CUDA version recorded in an image's labels (None: not a Stoker image, or CPU)."""
    value = (labels or {}).get(CUDA_LABEL)
    return None if value in (None, "", "none") else value


def preflight_image(ref: str, nvml: ModuleType | Any | None = None,
                    docker_host: str | None = None) -> HostCuda | None:
    """Preflight for an image present on this host's Docker Engine (pull it first).

    Args:
        ref: image reference or id.
        nvml: NVML module; None: import ``pynvml``.
        docker_host: daemon URL; None: ``DOCKER_HOST`` or the default socket.

    Raises:
        CudaDriverTooOldError, PreflightError: see ``preflight_cuda``.
        stoker.images.build.DockerUnavailableError: the daemon does not answer.
        docker.errors.ImageNotFound: the image is not on this engine.
    """
    from stoker.images.build import connect

    if nvml is None:
        import pynvml as nvml
    api = connect(docker_host)
    try:
        labels = api.inspect_image(ref)["Config"].get("Labels")
    finally:
        api.close()
    return preflight_cuda(image_cuda_version(labels), nvml)
