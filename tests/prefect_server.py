"""A real Prefect server on 127.0.0.1 for tests, with its own home and sqlite database."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from mlflow_server import free_port

from stoker.launch.local import terminate_tree


class PrefectServer:
    """``prefect server start`` on a free loopback port; ``env`` points clients at it."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ, "PREFECT_HOME": str(root / "home"), "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'prefect.db'}",
            "PREFECT_UI_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
            # No scheduler: scheduled runs (cost-guard every 5 min) must not reach test workers.
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "DVC_NO_ANALYTICS": "1",
        }
        self.process: subprocess.Popen | None = None

    def prefect(self, *args: str, cwd: Path | None = None, timeout: float = 300,
                **env: str) -> subprocess.CompletedProcess:
        """Run the prefect CLI against this server; raises with its output on failure."""
        result = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=cwd,
                                env={**self.env, **env}, capture_output=True, text=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed:\n{result.stdout}\n"
                               f"{result.stderr}")
        return result

    def __enter__(self) -> PrefectServer:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "w")  # noqa: SIM115 - closed with the process
        env = {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError((self.root / "server.log").read_text())
            try:
                if httpx.get(f"{self.api_url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prefect server did not answer on {self.api_url}")

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            terminate_tree(self.process.pid, grace_s=10)
