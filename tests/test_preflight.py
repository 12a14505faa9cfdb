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
