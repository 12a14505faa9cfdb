"""Run git for the data stage: one helper with a fixed identity and errors that name the command."""

from __future__ import annotations

import subprocess
from pathlib import Path

_GIT_IDENTITY = ["-c", "user.name=Stoker", "-c", "user.email=stoker@localhost"]


def git(cwd: Path, *args: str) -> str:
    """Run a git command in ``cwd`` and return its stripped stdout.

    Raises:
        RuntimeError: git exited non-zero; the message holds the command and git's stderr.
    """
    result = subprocess.run(
        ["git", *_GIT_IDENTITY, *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} (in {cwd}) failed: {result.stderr.strip()}")
    return result.stdout.strip()
