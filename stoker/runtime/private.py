"""A job's files for its owner only: every file Stoker writes in a job or work folder is
created 0600 and every folder 0700, whatever the umask (a umask only narrows a mode given to
``open`` or ``mkdir``; a default ``open`` under umask 0 makes a file anyone can read).

Each create passes the mode and sets it again right after (``fchmod``/``chmod``), so the mode
is exact under any umask, and a file or folder an older Stoker left wider is narrowed when it
is written again. A file owned by another user keeps its mode (narrowing it is not ours to do).
On an object store (an fsspec file system that is not local) there are no modes: the bucket's
policy decides. The writers of ``stoker/runtime``, ``stoker/jobs`` and ``stoker/launch`` all
come here. No Prefect, no torch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any

FILE_MODE = 0o600  # read and write for the owner only
DIR_MODE = 0o700  # list, enter and create for the owner only

_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
          "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "r+": os.O_RDWR | os.O_CREAT}


def _narrow(path_or_fd: str | Path | int, mode: int) -> None:
    """Set ``mode`` exactly; a file another user owns (EPERM) keeps its own."""
    with contextlib.suppress(PermissionError):
        if isinstance(path_or_fd, int):
            os.fchmod(path_or_fd, mode)
        else:
            os.chmod(path_or_fd, mode)


def open_fd(path: str | Path, flags: int) -> int:
    """``os.open`` that creates ``path`` 0600 (and narrows an existing file of ours to 0600).

    Args:
        path: the file.
        flags: ``os.O_*`` flags; ``os.O_CREAT`` is added.

    Returns:
        The open descriptor (the caller closes it).

    Raises:
        OSError: the file cannot be opened.
    """
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    _narrow(fd, FILE_MODE)
    return fd


def open_file(path: str | Path, mode: str = "w", buffering: int = -1) -> IO[Any]:
    """``open(path, mode)`` for writing, creating the file 0600.

    Args:
        path: the file.
        mode: ``"w"``, ``"a"`` or ``"r+"``, each with an optional ``"b"`` (binary).
        buffering: as for ``open`` (1: line-buffered text).

    Returns:
        The open file object.

    Raises:
        ValueError: ``mode`` is not one of those.
        OSError: the file cannot be opened.
    """
    flags = _FLAGS.get(mode.replace("b", ""))
    if flags is None:
        raise ValueError(f"open_file: mode must be w, a or r+ (with b), got {mode!r}")
    fd = open_fd(path, flags)
    try:
        return os.fdopen(fd, mode, buffering)
    except BaseException:
        os.close(fd)
        raise


def narrow_file(path: str | Path | int) -> None:
    """Set a file another library wrote (a profiler trace), or an open descriptor's file, to
    0600.

    Raises:
        OSError: ``path`` does not exist.
    """
    _narrow(path, FILE_MODE)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (created 0600, truncated), not atomically: callers that
    need atomicity write a temporary name with this and rename it (a rename keeps the mode)."""
    with open_file(path, "w") as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created 0600, truncated); see :func:`write_text`."""
    with open_file(path, "wb") as f:
        f.write(data)


def make_dir(path: str | Path, narrow_existing: bool = True) -> Path:
    """Create folder ``path`` and every missing parent 0700; an existing ``path`` of ours is
    narrowed to 0700 (parents that already exist are left as they are: a user's own folder).

    Args:
        path: the folder.
        narrow_existing: False for a folder that may be shared on purpose (a store's root,
            a Prefect home the user chose): created 0700 when missing, else left as it is.

    Returns:
        ``path`` as a Path.

    Raises:
        OSError: a folder cannot be created (a file in the way, no permission).
    """
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:  # made by another process meanwhile: it narrows its own
            if not folder.is_dir():
                raise
            continue
        _narrow(folder, DIR_MODE)
    if not missing and narrow_existing and _is_own(path):
        _narrow(path, DIR_MODE)
    return path


def _is_own(path: Path) -> bool:
    """Whether ``path`` exists, belongs to this process's user and is wider than 0700."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and st.st_mode & 0o077 != 0


def local_path(fs: Any, path: str) -> str | None:
    """The local path of ``path`` on fsspec file system ``fs``, None when ``fs`` is not the
    local disk (an object store has no modes)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return fs._strip_protocol(path) if protocol in ("file", "local") else None


def fs_make_dir(fs: Any, path: str, narrow_existing: bool = True) -> None:
    """``fs.makedirs(path, exist_ok=True)``, 0700 on the local disk (:func:`make_dir`)."""
    local = local_path(fs, path)
    if local is None:
        fs.makedirs(path, exist_ok=True)
    else:
        make_dir(local, narrow_existing)


def fs_open(fs: Any, path: str, mode: str = "wb") -> Any:
    """``fs.open(path, mode)`` for writing; on the local disk the new file is 0600 before a
    byte goes into it.

    Args:
        fs: an fsspec file system.
        path: the file on it.
        mode: ``"wb"`` (or another writing mode ``fs`` takes).

    Returns:
        The open fsspec file.

    Raises:
        OSError: the file cannot be opened.
    """
    f = fs.open(path, mode)
    local = local_path(fs, path)
    if local is not None:
        _narrow(local, FILE_MODE)
    return f
