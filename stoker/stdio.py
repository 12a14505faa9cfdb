"""Output that cannot fail a run: stdout/stderr that survive the reader going away.

A flow run started by a Prefect worker writes to pipes the worker reads. When the worker dies,
the next write (MLflow's "Successfully registered model", a print, a log line) raises
``BrokenPipeError`` in whatever call made it, and a finished training ends FAILED. After
:func:`guard_stdio`, a write that finds its reader gone points the descriptor at a file instead
(``os.dup2``, so C code, child processes and the interpreter's final flush are covered too) and
writes there: nothing is lost and nothing raises.

Log handlers made before the guard (Prefect's console handler is made when Prefect is first
imported) hold the raw stream: the guard re-points them too. Prefect's handler prints through a
rich ``Console``, which answers a broken pipe with ``SystemExit(1)`` in the logging thread (a
progress thread died silently that way after a worker was killed, trial).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from stoker.runtime import private

_LOST_READER = (errno.EPIPE, errno.ECONNRESET, errno.EBADF)


class GuardedStream:
    """A text stream that, when its reader is gone, moves its descriptor to ``fallback``."""

    def __init__(self, stream, fallback: Path):
        self._stream = stream
        self._fallback = Path(fallback)
        self._lock = threading.Lock()
        self.redirected = False
        self.line_open = False  # the last text written did not end a line
        self._opened_by: int | None = None  # the thread that left it open
        self._write_lock = threading.Lock()

    def _redirect(self) -> None:
        with self._lock:
            if self.redirected:
                return
            private.make_dir(self._fallback.parent)
            target = private.open_fd(self._fallback, os.O_WRONLY | os.O_APPEND)
            with contextlib.suppress(OSError, ValueError):
                os.dup2(target, self._stream.fileno())
            os.close(target)
            self.redirected = True

    def _call(self, name: str, *args):
        try:
            return getattr(self._stream, name)(*args)
        except OSError as e:
            if e.errno not in _LOST_READER:
                raise
            self._redirect()
            with contextlib.suppress(OSError):
                return getattr(self._stream, name)(*args)
            return len(args[0]) if name == "write" else None

    def write(self, text: str) -> int:
        """Write ``text``; a line another thread left unended is ended first.

        Prefect's API log handler writes ``--- Error logging to API ---`` and then the error
        without a newline, from its own thread: the next log line, from another thread, was
        glued to it (trial). One thread's pieces of a line (``print(a, end="")``) stay
        together."""
        if not text:
            return self._call("write", text)
        me = threading.get_ident()
        with self._write_lock:
            end_first = self.line_open and self._opened_by != me
            self.line_open, self._opened_by = not text.endswith("\n"), me
        if end_first:
            self._call("write", "\n")
        return self._call("write", text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._call("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_stdio(fallback: Path) -> None:
    """Make ``sys.stdout`` and ``sys.stderr``, and the log handlers already writing to them,
    survive a dead reader (idempotent).

    Args:
        fallback: file that receives the output once the reader is gone (appended to).
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, GuardedStream):
            continue
        guarded = GuardedStream(stream, fallback)
        setattr(sys, name, guarded)
        _rebind_handlers(stream, guarded)


def _rebind_handlers(raw, guarded: GuardedStream) -> None:
    """Point every logging ``StreamHandler`` that writes to ``raw`` at ``guarded``, and the rich
    ``Console`` of a handler that prints through one (Prefect's ``PrefectConsoleHandler``)."""
    known = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(lg for lg in known if isinstance(lg, logging.Logger))]
    for handler in {h for logger in loggers for h in logger.handlers}:
        if not isinstance(handler, logging.StreamHandler) or handler.stream is not raw:
            continue
        handler.setStream(guarded)
        console = getattr(handler, "console", None)
        if console is not None and getattr(console, "file", None) is raw:
            console.file = guarded


def line_writer(stream=None, copy_to: Path | None = None) -> Callable[[str], None]:
    """A function that writes one whole line to ``stream``, for a thread that speaks while the
    main thread may have redirected ``sys.stderr`` (``contextlib.redirect_stderr``: MLflow's
    store creation and model registration) or left a line unended (Prefect's ``--- Error
    logging to API ---`` ends without a newline).

    Args:
        stream: where the lines go (default: ``sys.stderr`` now, the guarded one after
            :func:`guard_stdio`), kept whatever ``sys.stderr`` becomes later.
        copy_to: a file that gets each line too (appended; 0600), unless ``stream`` already
            writes there (a :class:`GuardedStream` whose reader is gone, with it as fallback).

    Returns:
        ``write(line)``: writes ``line`` and a newline (a newline first when a
        :class:`GuardedStream` knows its last line is unended), then flushes.
    """
    stream = sys.stderr if stream is None else stream

    def write(line: str) -> None:
        if stream is not None:
            stream.write(("\n" if getattr(stream, "line_open", False) else "") + f"{line}\n")
            stream.flush()
        there = getattr(stream, "redirected", False) and \
            getattr(stream, "_fallback", None) == (Path(copy_to) if copy_to else None)
        if copy_to is not None and not there:
            # A full disk or a removed folder loses the copy, not the thread that speaks.
            with contextlib.suppress(OSError):
                private.make_dir(Path(copy_to).parent)
                fd = private.open_fd(copy_to, os.O_WRONLY | os.O_APPEND)
                with os.fdopen(fd, "a") as log:
                    log.write(f"{line}\n")

    return write
