"""Host staging of a checkpoint and a writer that hashes what it writes.

A save copies the state (nested dicts/lists of tensors) into host buffers that are allocated once
and reused by every later save of the same tensors, so the training loop can go on while the copy
is serialized and written. The copy itself can overlap the next forward/backward: the weights only
change at the next ``optimizer.step``, so the loop waits for the copy there (``wait``), and only if
it has not finished.

The buffers come from ``torch.distributed.checkpoint.staging.StateDictStager`` (the stager that
DCP's ``async_save`` uses): it keys its host copy on the source storage, so the same parameter is
staged into the same buffer every time (a new tensor, e.g. after a shape change, gets a new one),
deep-copies the Python objects around the tensors, keeps shared storages shared, and pins the
buffers when CUDA is available. On a GPU the copy is issued ``non_blocking`` on a side stream that
first waits for the compute stream (so it sees the weights after the step), and the next
``optimizer.step`` waits for the copy on the GPU, without blocking the host.
"""

from __future__ import annotations

import threading
import time
from typing import IO, Any

import torch

from stoker.runtime import digest


def _state_dict_stager(pin_memory: bool):
    """DCP's ``StateDictStager``, or None on a torch without it (fresh copies, nothing reused).
    Imported here, not at module level: it pulls in ``torch.distributed.tensor`` and sympy
    (~0.5 CPU-s per rank at every attempt's start), needed only once checkpoints are staged."""
    try:  # torch >= 2.8
        from torch.distributed.checkpoint.staging import StateDictStager
    except ImportError:  # pragma: no cover
        return None
    return StateDictStager(pin_memory=pin_memory, share_memory=False)


def to_cpu(obj: Any) -> Any:
    """Deep-copy tensors to fresh host memory (the fallback when torch has no stager)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class HashingWriter:
    """A write-only file object that passes every chunk to ``file`` and to a digest
    (:mod:`stoker.runtime.digest`), so a file is hashed while it is written (``torch.save``
    writes its zip sequentially, never seeking back).

    Attributes:
        hexdigest: hex digest of the bytes written so far.
        size_bytes: how many bytes were written.
    """

    def __init__(self, file: IO[bytes], algorithm: str = digest.WRITTEN):
        self._file = file
        self._hash = digest.new(algorithm)
        self.size_bytes = 0

    def write(self, data: bytes | memoryview) -> int:
        self._hash.update(data)
        self.size_bytes += len(data)
        self._file.write(data)
        return len(data)

    def flush(self) -> None:
        self._file.flush()

    @property
    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class HostStaging:
    """Copies states into reused host buffers, one copy in flight at a time.

    Use: ``ready = begin()`` in the training thread when the state is final (right after
    ``optimizer.step``); ``copy(state, ready)`` in any thread; ``wait()`` in the training thread
    before the tensors change (the next ``optimizer.step``); ``settle()`` in the thread that
    serializes the copy, before reading it.
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self._stager = _state_dict_stager(pin_memory=self.cuda)
        # Created here, in the training thread, so it is not the compute stream.
        self._stream = torch.cuda.Stream() if self.cuda else None
        self._copied = threading.Event()
        self._copied.set()
        self._done: Any = None  # torch.cuda.Event recorded on the side stream after the copy
        self.staged: Any = None  # the last staged state (its tensors are the reused buffers)
        # The source until its device-to-host copies have landed: a freed source block (a cloned
        # buffer) could be reused by the compute stream while the side stream still reads it.
        self._source: Any = None

    def begin(self) -> Any:
        """Mark a copy as started; returns the CUDA event the copy must wait for (None on CPU)."""
        self._copied.clear()
        self._done = None
        if not self.cuda:
            return None
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: after the optimizer step's kernels
        return ready

    def copy(self, state: Any, ready: Any = None) -> Any:
        """Stage ``state``: the same structure with every tensor copied to host buffers."""
        try:
            if self._stager is None:
                self.staged = to_cpu(state)
            elif ready is None:
                self.staged = self._stager.stage(state)
            else:
                self._source = state
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    self.staged = self._stager.stage(state, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._stream)
                self._done = done
            return self.staged
        finally:
            self._copied.set()  # also on error, or the training thread would wait forever

    def cancel(self) -> None:
        """Forget a copy that ``begin`` announced but nothing will run (its thread did not
        start), so ``wait`` does not block forever."""
        self._source = None
        self._copied.set()

    def settle(self) -> None:
        """Block until the device-to-host copies have landed (before serializing)."""
        if self._done is not None:
            self._done.synchronize()
        self._source = None

    def wait(self) -> float:
        """Block the training thread until the copy no longer reads the live tensors; returns
        the seconds waited. On a GPU only the compute stream waits (no host block)."""
        started = time.perf_counter()
        self._copied.wait()
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        return time.perf_counter() - started
