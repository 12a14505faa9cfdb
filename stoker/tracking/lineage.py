"""Lineage facts recorded on every run and model version."""

from __future__ import annotations

import subprocess
from pathlib import Path


def code_version(path: Path | None = None) -> dict[str, str]:
    """Git commit and dirty flag of the code at ``path`` (default: this package's checkout).

    Returns ``{"git_commit": <sha or "unknown">, "git_dirty": "true"|"false"|"unknown"}``;
    "unknown" when the code is not in a git checkout (e.g. an installed wheel).
    """
    where = path or Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True,
                                 timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    dirty = git("status", "--porcelain", "--untracked-files=no")
    flag = "unknown" if dirty is None else str(bool(dirty)).lower()
    return {"git_commit": commit, "git_dirty": flag}
