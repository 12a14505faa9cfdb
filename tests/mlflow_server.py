"""A real ``mlflow server`` on 127.0.0.1 for tests (HTTP tracking + registry + artifacts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stoker.launch.local import terminate_tree
from stoker.ui_cli import NO_SERVER_JOBS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """Starts ``mlflow server`` with a sqlite backend and served artifacts under ``root`` (or at
    ``artifacts_destination``, e.g. ``s3://bucket/mlartifacts`` with ``env`` holding AWS_*);
    ``args``: more options of ``mlflow server``."""

    def __init__(self, root: Path, artifacts_destination: str | None = None,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        self.root = root
        self.args = args  # more `mlflow server` options, e.g. ("--app-name", "basic-auth")
        self.artifacts_destination = artifacts_destination or str(root / "artifacts")
        self.env = env or {}
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "w")  # noqa: SIM115 - closed with the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", self.artifacts_destination, *self.args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # No job runner and huey consumers (8 more processes importing MLflow, as
            # `stoker ui` runs it): on 2 busy cores a server took over 120 s to answer (CI).
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **NO_SERVER_JOBS,
                 **self.env},
        )
        try:
            self._wait_until_it_answers()
        except BaseException:  # __exit__ will not run: the server must not outlive the test
            self.__exit__()
            raise
        return self

    def _wait_until_it_answers(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log_text = (self.root / 'server.log').read_text()
                raise RuntimeError(f"mlflow server exited: {log_text}")
            try:
                if httpx.get(f"{self.uri}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"mlflow server did not answer on {self.uri} within 180 s: "
                           f"{(self.root / 'server.log').read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            terminate_tree(self.process.pid, grace_s=5)
