"""A fake NVML binding with pynvml's interface, for machines without a GPU.

It exposes the same function names, return shapes (``.gpu``, ``.used``, ``.pid``,
``.usedGpuMemory``) and error classes as ``pynvml`` (the real ``NVMLError`` subclasses, taken
from nvidia-ml-py), and plays a script: frame N answers the N-th snapshot (one
``nvmlDeviceGetCount`` call per snapshot); the last frame repeats. A MIG device answers
utilization with NVMLError_NotSupported, as real MIG devices do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

MIB = 1024 * 1024

NVMLError = pynvml.NVMLError
NVMLError_NotSupported = pynvml.NVMLError_NotSupported
NVMLError_NotFound = pynvml.NVMLError_NotFound
NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
NVMLError_NoPermission = pynvml.NVMLError_NoPermission
NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE


@dataclass
class Gpu:
    """One GPU (or MIG device) in one frame. ``processes``: (pid, MiB or None) pairs.
    ``mig``: None: no MIG support; a list: MIG capable, with these MIG devices."""

    index: int = 0
    name: str = "NVIDIA H200"
    uuid: str | None = None
    utilization: float | BaseException = 0
    memory_used_mib: float = 0
    memory_total_mib: float = 143_771
    processes: Sequence[tuple[int, float | None]] | BaseException = ()
    mig: list[Gpu] | None = None
    mig_enabled: bool | None = None  # None: enabled when it has MIG devices
    is_mig_device: bool = False

    def __post_init__(self) -> None:
        self.uuid = self.uuid or f"GPU-fake-{self.index:04d}"


@dataclass
class FakeNvml:
    """Module-like object: pass it where ``pynvml`` goes.

    Args:
        frames: per snapshot, the GPUs; the last frame repeats.
        init_error: raised by nvmlInit (e.g. NVMLError_LibraryNotFound()).
        on_frame: called with the frame number when a snapshot starts (to change files between
            samples, e.g. a heartbeat that appears).
    """

    frames: Sequence[Sequence[Gpu]]
    init_error: BaseException | None = None
    on_frame: Callable[[int], None] | None = None
    snapshots: int = 0
    calls: list[str] = field(default_factory=list)

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE

    @property
    def frame(self) -> Sequence[Gpu]:
        return self.frames[min(self.snapshots - 1, len(self.frames) - 1)]

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        self.snapshots += 1
        if self.on_frame:
            self.on_frame(self.snapshots - 1)
        return len(self.frame)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Gpu:
        return self.frame[index]

    def nvmlDeviceGetName(self, handle: Gpu) -> str:
        return handle.name

    def nvmlDeviceGetUUID(self, handle: Gpu) -> str:
        return handle.uuid

    def nvmlDeviceGetUtilizationRates(self, handle: Gpu):
        if handle.is_mig_device:
            raise NVMLError_NotSupported()
        if isinstance(handle.utilization, BaseException):
            raise handle.utilization
        return SimpleNamespace(gpu=int(handle.utilization), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Gpu, version=None):
        used = int(handle.memory_used_mib * MIB)
        total = int(handle.memory_total_mib * MIB)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Gpu):
        if isinstance(handle.processes, BaseException):
            raise handle.processes
        return [SimpleNamespace(pid=pid, usedGpuMemory=None if mib is None else int(mib * MIB),
                                gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                for pid, mib in handle.processes]

    def nvmlDeviceGetMigMode(self, handle: Gpu):
        if handle.mig is None:
            raise NVMLError_NotSupported()
        enabled = bool(handle.mig) if handle.mig_enabled is None else handle.mig_enabled
        return [NVML_DEVICE_MIG_ENABLE if enabled else 0] * 2

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Gpu) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Gpu, index: int) -> Gpu:
        if handle.mig is None or index >= len(handle.mig):
            raise NVMLError_NotFound()
        return handle.mig[index]


def mig_gpu(index: int = 0, devices: int = 2, **fields) -> Gpu:
    """An A100 in MIG mode with ``devices`` MIG devices (fields apply to each)."""
    children = [Gpu(index=index, name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                    uuid=f"MIG-fake-{index}-{i}", is_mig_device=True, **fields)
                for i in range(devices)]
    return Gpu(index=index, name="NVIDIA A100-SXM4-80GB", mig=children, mig_enabled=True,
               utilization=NVMLError_NotSupported())
