"""How one checkpoint file is written durably: under a temporary name, hashed as it goes out,
flushed and fsynced, then renamed; a failed write deletes its temporary file. Used by
:class:`stoker.runtime.checkpoint.Checkpointer` on any fsspec file system. No Prefect."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
from dataclasses import dataclass
from typing import Any

import torch

from stoker.runtime import CheckpointWriteError, private
from stoker.runtime.lease import LeaseLost
from stoker.runtime.staging import HashingWriter


@dataclass(frozen=True)
class Written:
    """A serialized file still open under its temporary name (see :func:`seal`)."""

    file: Any
    tmp: str
    path: str
    sha256: str


def sync(f: Any) -> None:
    """Flush ``f`` and fsync it when it is a local file (an object store commits on close).

    Raises:
        OSError: the fsync failed (a full disk, an I/O error).
    """
    f.flush()
    if not hasattr(f, "fileno"):
        return
    try:
        fd = f.fileno()
    except (OSError, io.UnsupportedOperation):  # no OS file behind it (an in-memory one)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        # A file that cannot be synced (EINVAL: a special file; some FUSE mounts) is as
        # durable as it gets; any other failure (ENOSPC, EIO) means the bytes may not be
        # on the disk: the step must not be committed.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def write_bytes(fs: Any, path: str, payload: bytes) -> str:
    """Write bytes to ``path`` on ``fs`` under a temporary name, flush + fsync, rename; return
    their sha256 (hex). A write that fails (a full disk) deletes its temporary file before it
    raises."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with private.fs_open(fs, tmp, "wb") as f:
            f.write(payload)
            sync(f)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise
    fs.mv(tmp, path)
    return hashlib.sha256(payload).hexdigest()


def serialize(fs: Any, path: str, obj: Any) -> Written:
    """``torch.save`` ``obj`` into an open temporary file beside ``path``, hashing the bytes as
    they go out (no in-memory copy of the serialized state, no second read). The bytes leave
    ``obj``: it may change afterwards. Not yet durable nor renamed: :func:`seal` does that."""
    tmp = f"{path}.tmp-{os.getpid()}"
    f = private.fs_open(fs, tmp, "wb")
    try:
        writer = HashingWriter(f)
        torch.save(obj, writer)
    except BaseException:
        discard(fs, [Written(f, tmp, path, "")])
        raise
    return Written(f, tmp, path, writer.sha256)


def seal(fs: Any, written: Written) -> str:
    """Flush + fsync, close and rename a :func:`serialize` d file. Returns its sha256 (hex)."""
    with written.file as f:
        sync(f)
    fs.mv(written.tmp, written.path)
    return written.sha256


def discard(fs: Any, written: list[Written]) -> None:
    """Close and delete files a failed save left under their temporary names (a full disk
    must not keep up to a whole checkpoint of them)."""
    for w in written:
        with contextlib.suppress(Exception):
            w.file.close()
        with contextlib.suppress(Exception):
            fs.rm(w.tmp)


def unwritable(step_dir: str, rank: int, error: BaseException) -> CheckpointWriteError | None:
    """The one-line error for a save into ``step_dir`` that the file system refused (an
    ``OSError`` anywhere in ``error``'s chain: a full disk, a read-only folder), naming the
    folder and what to do; None for any other error. (torch's zip writer raises its own
    ``RuntimeError`` with the ``OSError`` as its context.)"""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen and not isinstance(cause, OSError):
        if isinstance(cause, LeaseLost):  # fencing, not the file system
            return None
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, OSError):
        return None
    why = cause.strerror or str(cause) or type(cause).__name__
    hint = ("free space there, lower train.keep_latest_k, or point checkpoint_dir at a "
            "larger disk" if cause.errno == errno.ENOSPC
            else "check that checkpoint_dir is a folder this user can write")
    return CheckpointWriteError(f"checkpoint {step_dir}: rank {rank} could not write it "
                                f"({why}): {hint}; the step stays uncommitted")
