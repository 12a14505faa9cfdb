"""A temporary Prefect API server that ``stoker run`` owns, and that dies with it.

Prefect's own temporary server (started when ``PREFECT_API_URL`` is unset) runs in the caller's
process group, so Ctrl-C kills it first and every later API call of the flow fails; a SIGKILLed
caller leaves it running under PID 1. This one runs in its own session (Ctrl-C at the terminal
reaches only ``stoker run``) with the parent-death signal set (it ends when ``stoker run`` ends,
however that happens), and ``stop`` ends it after the flow has recorded its final state.

No Prefect import here: the server is ``uvicorn`` on Prefect's app factory, as Prefect starts it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stoker.runtime.preemption import die_with_parent


class ServerError(RuntimeError):
    """The temporary server did not start or did not answer in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _server_child() -> None:
    """In the forked child, before exec: end with the parent (SIGTERM: uvicorn shuts down)."""
    die_with_parent(signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


class EmbeddedServer:
    """``uvicorn prefect.server.api.server:create_app`` on a free loopback port.

    Args:
        log_path: file for the server's output (its own errors; the flow logs through the API).
        startup_timeout_s: seconds to wait for ``/api/health`` (first start migrates sqlite).
    """

    def __init__(self, log_path: Path, startup_timeout_s: float = 120.0):
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> EmbeddedServer:
        """Start the server and wait until it answers.

        Raises:
            ServerError: it exited or did not answer within ``startup_timeout_s``.
        """
        # Found, not imported: Prefect reads PREFECT_API_URL once, when it is first imported.
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env |= {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1"}
        command = [sys.executable, "-m", "uvicorn", "--app-dir",
                   str(prefect_dir.parent), "--factory",
                   "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                   "--port", str(self.port), "--log-level", "error", "--lifespan", "on",
                   # Open websockets (Prefect's event client) would hold a graceful stop open.
                   "--timeout-graceful-shutdown", "1"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_server_child)
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServerError(f"Prefect server exited with {self.process.returncode}; "
                                      f"see {self.log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return self
                time.sleep(0.2)
        self.stop()
        raise ServerError(f"Prefect server on {self.api_url} did not answer within "
                          f"{self.startup_timeout_s:g} s; see {self.log_path}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the server, SIGKILL it after ``grace_s`` seconds (safe to call twice)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
