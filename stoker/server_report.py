"""Why a local Prefect server did not start: its own log lines of this start, and what its
process did meanwhile (no Prefect import: read by the command that waited for it)."""

from __future__ import annotations

from pathlib import Path

import psutil

TAIL_LINES = 5
LINE_CHARS = 200


def log_tail(log_path: Path, offset: int, lines: int = TAIL_LINES) -> list[str]:
    """The last non-empty lines the server wrote to its log after ``offset``.

    Args:
        log_path: the server's log file.
        offset: the log's size in bytes before this start (earlier starts are not this one's).
        lines: how many lines at most.

    Returns:
        Up to ``lines`` lines, each cut to ``LINE_CHARS`` characters; none for no log.
    """
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return []
    found = [line.strip() for line in text.splitlines()
             if line.strip() and not set(line.strip()) <= set("^~ ")]  # not tracebacks' marks
    return [line[:LINE_CHARS] for line in found[-lines:]]


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) the process and its children used so far; None when gone."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        return times.user + times.system + times.children_user + times.children_system
    except psutil.Error:
        return None


def why_not_started(log_path: Path, offset: int, pid_cpu_s: float | None,
                    waited_s: float) -> str:
    """One line for a start that failed: the log lines of this start, else what is known.

    Args:
        log_path: the server's log file.
        offset: the log's size in bytes before this start.
        pid_cpu_s: CPU seconds the server used before it was ended (None: it had exited).
        waited_s: seconds waited for it to answer.

    Returns:
        e.g. ``its log: Waiting for application startup. (it used 3.1 CPU-s in 120 s: ...)``.
    """
    tail = log_tail(log_path, offset)
    said = ("its last log lines: " + " | ".join(tail)) if tail else \
        f"it wrote nothing to {log_path.name}"
    if pid_cpu_s is None:
        return said
    busy = pid_cpu_s / waited_s if waited_s > 0 else 0.0
    hint = ("the machine is busy: it got little CPU, try again or raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" if busy < 0.5 else
            "it was working all along (a first start migrates the database): raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    return f"{said} (it used {pid_cpu_s:.1f} CPU-s in {waited_s:g} s: {hint})"


def not_answering(record: dict | None, startup_timeout_s: float,
                  now_s: float | None = None, preparing: bool = False,
                  locked: bool = False) -> str:
    """What ``stoker server status`` says of a local server that does not answer.

    Args:
        record: the server's record when its process lives (``started``: epoch seconds of its
            start, read from a file: untrusted), else None.
        startup_timeout_s: seconds a start may take before it counts as failed.
        now_s: the time now, epoch seconds (default: ``time.time()``).
        preparing: whether a start prepares the database now (before any record exists).
        locked: whether another command holds the server's lock now (it checks, starts or
            stops it: between the database's preparation and the server's record, no file
            says more).

    Returns:
        ``not running``; ``starting (for N s of its T s start timeout)`` while a live server is
        within its start timeout (ending it would undo the start); else ``not running`` with the
        advice to end its process.
    """
    import math
    import time

    if record is None:
        if preparing:
            return "starting (preparing the Prefect database, once)"
        return "starting or stopping (another command holds its lock)" if locked \
            else "not running"
    try:
        since_s = (time.time() if now_s is None else now_s) - float(record.get("started"))
    except (TypeError, ValueError):
        since_s = math.inf  # a record without a start time: not one of ours starting
    if 0 <= since_s <= startup_timeout_s:
        return (f"starting (for {since_s:.0f} s of its {startup_timeout_s:g} s start timeout;"
                f" pid {record.get('pid')})")
    return "not running (its process lives but does not answer; `stoker server stop` ends it)"
