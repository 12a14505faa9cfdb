"""What a terminal already shows: no imports beyond the standard library (the ``stoker``
entry point uses it before the CLI is imported)."""

from __future__ import annotations

import os
import signal


def after_echo(signum: int = signal.SIGINT) -> str:
    """A newline to end the ``^C`` a terminal echoes for Ctrl-C (SIGINT with stderr on a
    terminal), else nothing: a piped log or a ``kill`` got a blank line (new-user trial)."""
    try:
        return "\n" if signum == signal.SIGINT and os.isatty(2) else ""
    except OSError:
        return ""
