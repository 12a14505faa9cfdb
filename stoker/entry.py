"""The ``stoker`` command's entry point (``[project.scripts]``): the Typer app of
:mod:`stoker.cli`, imported here so that a Ctrl-C while it is imported (its first ~0.4 s, before
any handler of Stoker's is installed) ends the command with one line and exit 130 (as a Ctrl-C
does later) instead of Python's ``KeyboardInterrupt`` traceback. Nothing has started then."""

from __future__ import annotations

import os
import sys

STARTING_LINE = "stoker: interrupted while starting (Ctrl-C); nothing was started"


def main() -> None:
    """Import the CLI and run it; a ``KeyboardInterrupt`` during the import exits 130."""
    try:
        from stoker.cli import app
    except KeyboardInterrupt:
        try:
            echo = "\n" if os.isatty(2) else ""  # end the ^C the terminal echoed
        except OSError:
            echo = ""
        print(f"{echo}{STARTING_LINE}", file=sys.stderr)
        raise SystemExit(130) from None
    app()
