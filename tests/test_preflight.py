"""CUDA preflight: NVML stand-in (no GPU here) behind pynvml's names, and the real library."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stoker.preflight import CudaDriverTooOldError, PreflightError, preflight_cuda


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
