"""The local Prefect servers (stoker.local_server) of tests: the environment that starts one,
and stopping those that tests started."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil
from prefect_server import seed_prefect_home

from stoker.local_server import LocalServer


def embedded_env(work: Path) -> dict[str, str]:
    """The environment of a ``stoker`` command in its default embedded mode (no PREFECT_API_URL)
    on a local Prefect server of the test's own: PREFECT_HOME is ``work/.prefect`` (users get one
    server per machine, in their state folder: tests/test_local_server.py tests that), whose home
    starts with the migrated database (:func:`prefect_server.seed_prefect_home`)."""
    seed_prefect_home(work / ".prefect")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env | {"PREFECT_HOME": str(work / ".prefect")}


def stop_local_servers(root: Path) -> list[int]:
    """Stop every local Prefect server (stoker.local_server) whose PREFECT_HOME lies under
    ``root``, by its record, and kill any left without one; returns their pids."""
    found: dict[int, str] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "uvicorn" in " ".join(proc.info["cmdline"] or []):
                home = proc.environ().get("PREFECT_HOME", "")
                if home.startswith(str(root)):
                    found[proc.pid] = home
        except psutil.Error:
            continue
    for home in set(found.values()):
        LocalServer(Path(home)).stop(grace_s=5)
    for pid in found:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    return list(found)


TEST_MARK = "STOKER_TEST_MARK"  # set in a command's env: every process it starts inherits it


def marked_processes(mark: str) -> list[list[str]]:
    """The command lines of live processes whose environment has ``TEST_MARK`` = ``mark``,
    but for the long-lived local Prefect server (uvicorn)."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(TEST_MARK) == mark and \
                    "uvicorn" not in " ".join(proc.info["cmdline"] or []):
                left.append(proc.info["cmdline"])
    return left
