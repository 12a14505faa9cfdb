"""Stop the local Prefect servers (stoker.local_server) that tests started."""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil

from stoker.local_server import LocalServer


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
