"""Read GPU state through NVML: utilization, memory and compute processes per GPU or MIG device.

The reader takes the NVML binding as a module object (``pynvml`` from nvidia-ml-py, or a fake with
the same functions and ``NVMLError`` classes in tests). It never raises for NVML trouble: a failed,
unsupported or missing query is recorded as the GPU's ``error``, which makes its state unknown,
and a failure of NVML as a whole (library missing, no driver) is the snapshot's ``error``.

Units are "GPUs" as a scheduler sees them: a whole GPU when MIG is off, each MIG device when on.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

MIB = 1024 * 1024
_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


@dataclass(frozen=True)
class ProcessUse:
    """A compute process on a GPU: its PID as NVML reports it (host namespace when the guard runs
    on the host) and its memory in bytes (None where NVML cannot attribute memory)."""

    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True)
class GpuReading:
    """One GPU (or MIG device) at one moment. ``error`` set: state unknown (the reason)."""

    key: str
    index: int
    mig_index: int | None
    uuid: str | None
    parent_uuid: str | None
    name: str | None
    utilization_percent: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    processes: tuple[ProcessUse, ...] | None
    error: str | None = None

    @property
    def memory_used_mib(self) -> float | None:
        return None if self.memory_used_bytes is None else self.memory_used_bytes / MIB


@dataclass(frozen=True)
class Snapshot:
    """Every GPU of the host at ``time`` (Unix s). ``error`` set: NVML unusable, state unknown."""

    time: float
    gpus: tuple[GpuReading, ...]
    error: str | None = None


def load_nvml(module_name: str = "pynvml") -> ModuleType | str:
    """Import the NVML binding, or return why it cannot be imported (a message)."""
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        return f"NVML binding {module_name!r} not importable: {e}"


class NvmlReader:
    """Takes snapshots of all GPUs through an NVML binding; use as a context manager.

    Args:
        nvml: the ``pynvml`` module (or a fake with the same API), or a message saying why there
            is none (every snapshot is then unknown with that message).
        clock: Unix time source for snapshot times.
    """

    def __init__(self, nvml: ModuleType | Any | str, clock: Callable[[], float] = time.time):
        if not isinstance(nvml, str) and not hasattr(nvml, "NVMLError"):
            nvml = f"{getattr(nvml, '__name__', nvml)!r} is not an NVML binding (no NVMLError)"
        self.nvml = nvml
        self.clock = clock
        self._init_error: str | None = nvml if isinstance(nvml, str) else None
        self._initialized = False
        self._errors: tuple[type[BaseException], ...] = ()
        if not isinstance(nvml, str):
            mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
            self._errors = (nvml.NVMLError, OSError, *([mismatch] if mismatch else []))

    def __enter__(self) -> NvmlReader:
        if self._init_error is None:
            try:
                self.nvml.nvmlInit()
                self._initialized = True
            except self._errors as e:
                self._init_error = f"NVML init failed: {e}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._initialized:
            self._initialized = False
            with contextlib.suppress(*self._errors):  # shutting down: nothing left to protect
                self.nvml.nvmlShutdown()

    @property
    def unusable(self) -> str | None:
        """Why NVML cannot be read at all on this host (its init failed, or no binding), else
        None. Never retried within one reader: every snapshot would say the same."""
        return self._init_error

    def snapshot(self) -> Snapshot:
        """All GPUs now. Never raises for NVML errors; they become ``error`` fields."""
        now = self.clock()
        if self._init_error is not None:
            return Snapshot(now, (), self._init_error)
        if not self._initialized:
            return Snapshot(now, (), "NVML not initialized (use the reader as a context manager)")
        try:
            count = self.nvml.nvmlDeviceGetCount()
        except self._errors as e:
            return Snapshot(now, (), f"NVML device count failed: {e}")
        gpus: list[GpuReading] = []
        for index in range(count):
            gpus.extend(self._read_device(index))
        return Snapshot(now, tuple(gpus))

    def _read_device(self, index: int) -> list[GpuReading]:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except self._errors as e:
            return [_failed(index, None, f"handle: {e}")]
        uuid = self._optional(nvml.nvmlDeviceGetUUID, handle)
        try:
            mig_on = self._mig_enabled(handle)
        except self._errors as e:
            return [_failed(index, uuid, f"MIG mode: {e}")]
        if not mig_on:
            return [self._read_unit(handle, index, None, uuid, None)]
        try:
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except self._errors as e:
            return [_failed(index, uuid, f"MIG device count: {e}")]
        units = []
        for slot in range(slots):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # an empty MIG slot
            except self._errors as e:
                units.append(_failed(index, None, f"MIG device {slot}: {e}", mig_index=slot,
                                     parent_uuid=uuid))
                continue
            units.append(self._read_unit(mig, index, slot, self._optional(
                nvml.nvmlDeviceGetUUID, mig), uuid))
        return units or [_failed(index, uuid, "MIG enabled but no MIG devices")]

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self.nvml.nvmlDeviceGetMigMode(handle)
        except self.nvml.NVMLError_NotSupported:
            return False  # a GPU without MIG
        return current == _MIG_ENABLED

    def _read_unit(self, handle: Any, index: int, mig_index: int | None, uuid: str | None,
                   parent_uuid: str | None) -> GpuReading:
        nvml, errors = self.nvml, []

        def query(what: str, fn: Callable[[Any], Any]) -> Any:
            try:
                return fn(handle)
            except self._errors as e:
                errors.append(f"{what}: {e}")
                return None

        name = query("name", nvml.nvmlDeviceGetName)
        util = query("utilization", nvml.nvmlDeviceGetUtilizationRates)
        memory = query("memory", nvml.nvmlDeviceGetMemoryInfo)
        procs = query("processes", nvml.nvmlDeviceGetComputeRunningProcesses)
        processes = None
        if procs is not None:
            try:
                processes = tuple(ProcessUse(_pid(p.pid), _memory(p.usedGpuMemory))
                                  for p in procs)
            except (TypeError, ValueError, AttributeError) as e:  # a garbled entry from a binding
                errors.append(f"processes: unreadable entry: {e}")
        return GpuReading(
            key=uuid or _index_key(index, mig_index), index=index, mig_index=mig_index, uuid=uuid,
            parent_uuid=parent_uuid,
            name=name.decode() if isinstance(name, bytes) else name,
            utilization_percent=None if util is None else float(util.gpu),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            processes=processes,
            error="; ".join(errors) or None,
        )

    def _optional(self, fn: Callable[[Any], Any], handle: Any) -> str | None:
        """A value that only names things (UUID): failing leaves it out, not the state unknown."""
        try:
            value = fn(handle)
        except self._errors:
            return None
        return value.decode() if isinstance(value, bytes) else value


def _pid(value: object) -> int:
    # Kept as reported, even out of range (4294967295): the decision names it as unresolvable.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"PID {value!r} is not an integer")
    return value


def _memory(value: int | None) -> int | None:
    # NVML reports "not available" (e.g. WDDM, some MIG setups) as None in nvidia-ml-py.
    return None if value is None else int(value)


def _index_key(index: int, mig_index: int | None) -> str:
    return f"gpu{index}" if mig_index is None else f"gpu{index}/mig{mig_index}"


def _failed(index: int, uuid: str | None, error: str, mig_index: int | None = None,
            parent_uuid: str | None = None) -> GpuReading:
    return GpuReading(key=uuid or _index_key(index, mig_index), index=index, mig_index=mig_index,
                      uuid=uuid, parent_uuid=parent_uuid, name=None, utilization_percent=None,
                      memory_used_bytes=None, memory_total_bytes=None, processes=None, error=error)
