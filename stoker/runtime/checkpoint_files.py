"""How one checkpoint file is written durably: under a temporary name, hashed as it goes out
(:mod:`stoker.runtime.digest`), flushed and fsynced, then renamed; a failed write deletes its
temporary file. Used by :class:`stoker.runtime.checkpoint.Checkpointer` on any fsspec file
system. No Prefect."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
from collections.abc import Iterator
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
    digest: str  # hex, of digest.WRITTEN


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


def write_bytes(fs: Any, path: str, payload: bytes) -> None:
    """Write bytes to ``path`` on ``fs`` under a temporary name, flush + fsync, rename. A write
    that fails (a full disk) deletes its temporary file before it raises."""
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


_ZIP_CRC = threading.Lock()


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 its zip writer computes over every record: the file's
    own digest already covers every byte, and the CRC cost 0.035 CPU-s of a 0.078 s save of a
    151 MB state here (``benchmarks/bench_checkpoint_e2e.py``). ``torch.load`` reads such files
    as it reads any other. The option is torch's, process-wide: a ``torch.save`` another thread
    makes meanwhile writes no CRC either (it loads the same). A torch without the option
    (< 2.6) keeps its CRC."""
    options = torch.serialization
    if not hasattr(options, "set_crc32_options"):  # pragma: no cover - torch < 2.6
        yield
        return
    with _ZIP_CRC:
        before = options.get_crc32_options()
        options.set_crc32_options(False)
        try:
            yield
        finally:
            options.set_crc32_options(before)


def serialize(fs: Any, path: str, obj: Any, spare: str | None = None) -> Written:
    """``torch.save`` ``obj`` into an open temporary file beside ``path``, hashing the bytes as
    they go out (no in-memory copy of the serialized state, no second read; no zip CRC-32
    either: the digest covers every byte). The bytes leave ``obj``: it may change afterwards.
    Not yet durable nor renamed: :func:`seal` does that.

    Args:
        spare: a file :func:`retire` kept (local disk only): when it is there, it becomes the
            temporary file and is overwritten in place (see :func:`retire` for why), then cut
            to the bytes written. A new file otherwise.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    f = _reuse(fs, spare, tmp) if spare else None
    if f is None and spare and (local := private.local_path(fs, tmp)) and os.path.lexists(local):
        # what a racing swap of the spare left under that name (a folder: not deleted here);
        # the step's folder, uncommitted until this rank's files are in, is purged with it
        tmp = f"{path}.new.tmp-{os.getpid()}"
    if f is None:
        f = private.fs_open(fs, tmp, "wb")
    try:
        writer = HashingWriter(f)
        with _without_zip_crc32():
            torch.save(obj, writer)
        if isinstance(f, io.BufferedRandom):  # a reused file: drop its old tail
            f.truncate()
    except BaseException:
        discard(fs, [Written(f, tmp, path, "")])
        raise
    return Written(f, tmp, path, writer.hexdigest)


def _plain_own_file(st: os.stat_result) -> bool:
    """A regular file of this user with one link: the only kind the spare may be (a link or a
    second name planted in a shared folder would be written through)."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1


def retire(fs: Any, path: str, spare: str) -> bool:
    """Keep the file ``path`` of a checkpoint being purged as ``spare``, for the next save to
    overwrite (:func:`serialize`), instead of deleting it; True when it was kept. Only on the
    local disk, only a regular file of this user with one link, and only when no spare is
    there yet.

    Why: a save writes ``keep_latest_k`` x its size of new files and a purge frees as much. A
    new file takes new page-cache pages (allocated, charged and, on a VM that hands free memory
    back to its host, faulted in again by the host); overwriting the cached pages of a purged
    file takes none, as databases recycle their log segments. On this project's 2-core VM,
    writing 151 MB (38 writes of 4 MB) into a new file cost 0.25-0.40 CPU-s, into the cached
    pages of an existing one 0.03 (measured 2026-12-07); a save of that state held the training
    thread 0.144 s before and 0.028 s after (``benchmarks/bench_checkpoint_e2e.py`` in
    ``benchmarks/RESULTS.md``, which counts the saves that overwrote a spare). The price: one
    more file of that size on the disk while the job trains."""
    local, local_spare = private.local_path(fs, path), private.local_path(fs, spare)
    if local is None or local_spare is None or os.path.lexists(local_spare):
        return False
    try:
        if not _plain_own_file(os.lstat(local)):
            return False
        os.rename(local, local_spare)
    except OSError:
        return False
    return True


def drop_spare(fs: Any, spare: str) -> None:
    """Delete the spare (a job that completed saves no more): a plain file, or a link or
    other non-folder entry (deleting a link leaves what it points to as it is). A folder
    planted there is left alone."""
    local = private.local_path(fs, spare)
    if local is None:
        return
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(local).st_mode):
            os.unlink(local)


def _reuse(fs: Any, spare: str, tmp: str) -> io.BufferedRandom | None:
    """The spare file renamed to ``tmp`` and open for overwriting from its first byte, or None
    (no spare, another process took it, or it is not a plain file of this user with one link:
    the folder may be shared, so a planted link must never be written through; a link, a FIFO
    or another non-folder entry there is deleted, a folder left alone, never moved)."""
    local_spare, local_tmp = private.local_path(fs, spare), private.local_path(fs, tmp)
    if local_spare is None or local_tmp is None:
        return None
    try:
        if not _plain_own_file(os.lstat(local_spare)):
            drop_spare(fs, spare)
            return None
        os.rename(local_spare, local_tmp)  # atomic: of two takers, one gets FileNotFoundError
    except OSError:
        return None
    try:
        fd = os.open(local_tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # a symbolic link (ELOOP), or gone
        with contextlib.suppress(OSError):
            os.unlink(local_tmp)
        return None
    if not _plain_own_file(os.fstat(fd)):  # swapped since the lstat above
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(local_tmp)
        return None
    private.narrow_file(fd)
    return os.fdopen(fd, "r+b")


def seal(fs: Any, written: Written) -> str:
    """Flush + fsync, close and rename a :func:`serialize` d file. Returns its digest (hex, of
    ``digest.WRITTEN``)."""
    with written.file as f:
        sync(f)
    fs.mv(written.tmp, written.path)
    return written.digest


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
