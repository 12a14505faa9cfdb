"""Stoker's own record files, written so a crash leaves them readable and read so a torn one
does not stop a job.

Writers: ``append_jsonl`` appends one whole line per call (one ``write`` on an ``O_APPEND``
descriptor) and first ends a torn last line, so a record written after a crash is never glued
onto half a record; ``write_json`` writes a temporary file and renames it. Readers:
``read_jsonl`` skips a torn or foreign line with a warning; ``read_json`` returns a default,
with a warning, for a missing, truncated or unparsable file. No Prefect, no torch: used by the
runtime, the launchers, the tasks and the cost guard.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoker.runtime import private

log = logging.getLogger(__name__)

Warn = Callable[[str], None]


def real_number(value: object) -> float | None:
    """``value`` as a float when it is a finite real number, else None: a bool, NaN,
    ±Infinity (Python's JSON reader takes both), a string or an int beyond a float's range.

    The fields of our records are untrusted input: a damaged or forged one must not read as a
    time, a rate or a deadline (``"expires": Infinity`` held a lease forever)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def integer(value: object) -> int | None:
    """``value`` when it is an int and not a bool (a step, a pid, a number of steps), else
    None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ends_torn(fd: int) -> bool:
    """Whether the file behind ``fd`` is non-empty and does not end with a newline."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def line_of(record: dict[str, Any]) -> bytes:
    """One record as a JSON line (bytes, newline-terminated)."""
    return (json.dumps(record, default=str) + "\n").encode()


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append ``record`` to ``path`` as one JSON line with a single write call.

    A file that ends in a torn line (a crash mid-write) first gets a newline, so the torn line
    stays one unreadable line and this record stays whole.
    """
    fd = private.open_fd(path, os.O_RDWR | os.O_APPEND)
    try:
        os.write(fd, (b"\n" if _ends_torn(fd) else b"") + line_of(record))
    finally:
        os.close(fd)


class JsonlAppender:
    """An open JSON-lines file for a writer that appends often (progress events).

    Same guarantees as ``append_jsonl``: one write per record, a torn tail ended first.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = private.open_fd(self.path, os.O_RDWR | os.O_APPEND)
        self._prefix = b"\n" if _ends_torn(self._fd) else b""

    def append(self, record: dict[str, Any]) -> None:
        os.write(self._fd, self._prefix + line_of(record))
        self._prefix = b""

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _record(line: bytes) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None (torn, not JSON, or not an object)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: str | Path, warn: Warn = log.warning) -> list[dict[str, Any]]:
    """Every JSON object in ``path``, oldest first ([] when the file does not exist).

    A line that is not a JSON object (torn by a crash, or foreign) is skipped with a warning
    naming the file and the line number.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records = []
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            where = "last line" if number >= len(lines) - 1 else f"line {number}"
            warn(f"{path}: {where} is not a whole JSON record ({len(line)} bytes, e.g. torn by a "
                 "crash); skipped")
            continue
        records.append(record)
    return records


class JsonlTail:
    """Reads a JSON-lines file that another process appends to, a little at a time.

    Each :meth:`read` returns only the records completed since the last one: it keeps the byte
    offset of the first unread line, so polling a growing file costs what was added, not its
    whole size. A last line without its newline (being written, or torn by a crash) is left for
    the next read; a line that ends but is not a JSON object is skipped with a warning. A file
    that shrank (replaced) is read again from the start.
    """

    def __init__(self, path: str | Path, warn: Warn = log.warning):
        self.path, self.warn = Path(path), warn
        self.offset = 0       # bytes consumed: the start of the first unread line
        self.bytes_read = 0   # total bytes read from the file (what polling has cost)
        self.restarts = 0     # times the file shrank and was read again from the start
        self._line = 0

    def read(self) -> list[dict[str, Any]]:
        """The records whose lines were completed since the last call, oldest first."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:
                    self.offset, self._line = 0, 0
                    self.restarts += 1
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except FileNotFoundError:
            return []
        self.bytes_read += len(data)
        end = data.rfind(b"\n") + 1  # an unfinished last line waits for the next read
        self.offset += end
        records = []
        for line in data[:end].split(b"\n")[:-1]:
            self._line += 1
            if not line.strip():
                continue
            record = _record(line)
            if record is None:
                self.warn(f"{self.path}: line {self._line} is not a whole JSON record "
                          f"({len(line)} bytes, e.g. torn by a crash); skipped")
                continue
            records.append(record)
        return records


def read_json(path: str | Path, default: Any = None, warn: Warn = log.warning) -> Any:
    """The JSON value in ``path``; ``default`` when it is missing, or (with a warning) when it
    is empty, truncated or not JSON."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return default
    except (OSError, UnicodeDecodeError) as e:
        warn(f"{path}: unreadable ({e}); ignored")
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        warn(f"{path}: not valid JSON ({e}; {len(text)} bytes, e.g. truncated by a crash); "
             "ignored")
        return default


def write_json(path: str | Path, value: Any) -> None:
    """Write ``value`` as JSON atomically (temporary file, fsync, rename); a write that fails
    (``OSError``, raised) leaves no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with private.open_file(tmp, "w") as f:
            json.dump(value, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_text(path: str | Path, warn: Warn = log.warning) -> str | None:
    """A one-value text record (e.g. ``mlflow_run_id``), stripped; None when missing or empty."""
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        warn(f"{path}: unreadable ({e}); ignored")
        return None
    if not text:
        warn(f"{path}: empty (e.g. truncated by a crash); ignored")
    return text or None
