"""Run git for the data stage: one helper with a fixed identity and errors that name the command."""

from __future__ import annotations

import subprocess
from pathlib import Path

_GIT_IDENTITY = ["-c", "user.name=Stoker", "-c", "user.email=stoker@localhost"]


class GitError(RuntimeError):
    """A git command failed; ``reason`` is git's own last message (``fatal: ...``)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def git(cwd: Path, *args: str) -> str:
    """Run a git command in ``cwd`` and return its stripped stdout.

    Raises:
        GitError: git exited non-zero; the message holds the command and git's stderr, its
            ``reason`` git's last stderr line.
    """
    result = subprocess.run(
        ["git", *_GIT_IDENTITY, *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        stderr = result.stderr.strip()
        raise GitError(f"git {' '.join(args)} (in {cwd}) failed: {stderr}",
                       stderr.splitlines()[-1] if stderr else f"exit {result.returncode}")
    return result.stdout.strip()
