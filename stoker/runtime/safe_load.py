"""Data-only loading of checkpoint files: nothing in a shared folder or bucket is executed.

A checkpoint file is a pickle, and a pickle can name any Python callable to build an object
(``os.system`` included). Stoker loads every checkpoint file with ``torch.load(...,
weights_only=True)``: tensors, plain Python types and the few numpy types the per-rank RNG
state holds (allowed here by name). A file naming any other type is refused before it is
unpickled, with the file and the types it tried to build, and the job stops (exit 2) instead
of restarting from step 0: a planted payload is something to look at, not to skip.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
import torch

from stoker.runtime import CheckpointError

# The only non-torch globals a Stoker checkpoint holds: numpy's RNG state (np.random.get_state).
_NUMPY_GLOBALS: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
try:  # numpy >= 2 moved the reconstructor to numpy._core
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct
_NUMPY_GLOBALS.append(_reconstruct)
ALLOWED = frozenset({
    f"{g.__module__}.{g.__qualname__}" for g in _NUMPY_GLOBALS
} | {"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
     "numpy.dtypes.UInt32DType"})


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names a type outside the data-only allow-list: refused, never run."""


def load_data_only(blob: bytes, name: str, map_location: str | torch.device = "cpu") -> Any:
    """Unpickle one checkpoint file with ``weights_only=True`` (tensors and plain types only).

    Args:
        blob: the file's bytes (already verified against its recorded digest by the caller).
        name: the file's path, for the message.
        map_location: where tensors go (``torch.load``'s argument).

    Returns:
        The loaded object (dicts, lists, tensors, numbers, strings, numpy RNG arrays).

    Raises:
        UnsafeCheckpointError: the file names a type that is not allowed (nothing is built).
    """
    try:
        unsafe = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(
            io.BytesIO(blob)) if g not in ALLOWED]
    except Exception:  # not a torch zip file: the weights-only load below names why
        unsafe = []
    if unsafe:
        raise UnsafeCheckpointError(
            f"{name}: refused, it tries to build {', '.join(sorted(unsafe))} (a checkpoint holds "
            "tensors and plain types only; nothing in it is run)")
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(io.BytesIO(blob), map_location=map_location, weights_only=True)
    except Exception as e:
        # A type outside the allow-list: "Unsupported global" (the zip format), "unsupported
        # GLOBAL posix.system whose module posix is blocked" (the legacy format, which a trial
        # planted: it was moved aside as corrupt and the job fell back to an older step).
        # Garbage bytes stay "unusable", not "refused".
        text = str(e)
        if blocked := LEGACY_GLOBAL.search(text):
            raise UnsafeCheckpointError(
                f"{name}: refused, it tries to build {blocked.group(1)} (a checkpoint holds "
                "tensors and plain types only; nothing in it is run)") from e
        if "Unsupported global" in text:
            line = next((x for x in text.splitlines() if "Unsupported global" in x), "")
            raise UnsafeCheckpointError(f"{name}: refused by the weights-only loader "
                                        f"({line.strip()[:200]})") from e
        raise


LEGACY_GLOBAL = re.compile(r"unsupported GLOBAL (\S+) whose module \S+ is blocked")
