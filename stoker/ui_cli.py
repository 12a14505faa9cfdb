"""``stoker ui``: the MLflow UI on a work folder's store, in the foreground, ended by Ctrl-C.

It runs ``mlflow server`` with one worker in its own process group and ends that whole group on
Ctrl-C or SIGTERM. The plain ``mlflow ui`` starts several workers by default; on a loaded
machine a worker died without a word while its parent kept the port, answered nothing and
ignored SIGTERM. Bad input (no store, a port in use) is one line with exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from stoker.predict_cli import fail

STOP_GRACE_S = 10.0


def ui(
    work_dir: Annotated[Path, typer.Option(
        "--work-dir", "-w", help="The work folder whose MLflow store (`<work-dir>/mlflow.db`) "
        "is shown when --tracking-uri is not given")] = Path("work"),
    tracking_uri: Annotated[str | None, typer.Option(
        help="MLflow tracking URI [default: `sqlite:///<work-dir>/mlflow.db`]",
        show_default=False)] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the UI")] = 5050,
) -> None:
    """Serve the MLflow UI of a work folder's store until Ctrl-C (http://127.0.0.1:5050)."""
    from stoker.environment import TELEMETRY_OFF, sqlite_path

    tracking_uri = tracking_uri or f"sqlite:///{work_dir / 'mlflow.db'}"
    store = sqlite_path(tracking_uri)
    if store is not None and not store.is_file():
        fail(f"no MLflow store at {store} (tracking URI {tracking_uri}, from {Path.cwd()}); "
             "run `stoker run` first, or point --work-dir or --tracking-uri at your store")
    if not 0 < port < 65536:
        fail(f"--port must be between 1 and 65535, got {port}")
    if not port_free(host, port):
        fail(f"--port {port}: another process listens on {host}:{port}; choose another port")
    defaults = {**TELEMETRY_OFF, **NO_SERVER_JOBS, **QUIET_WARNINGS}
    env = {**os.environ, **{k: v for k, v in defaults.items() if k not in os.environ}}
    command = mlflow_server_command(tracking_uri, host, port)
    typer.echo(f"MLflow UI of {tracking_uri} on http://{host}:{port} (Ctrl-C ends it)", err=True)
    raise typer.Exit(run_in_group(command, env))


# MLflow's server job execution (a job runner and seven huey consumers, each importing MLflow:
# online scoring, trace archival) is nothing the UI of a Stoker store uses. Measured here while
# a test suite ran: 10 processes and 53 CPU-s until /health answered, against 2 and 23.5 CPU-s
# without it. A user who sets the variable keeps their value.
NO_SERVER_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
# MLflow's own import of Starlette's WSGI middleware warns (StarletteDeprecationWarning, a
# UserWarning: "starlette.middleware.wsgi is deprecated ..."), nothing a user of the UI can act
# on: that one message is ignored. A user's PYTHONWARNINGS is kept.
QUIET_WARNINGS = {"PYTHONWARNINGS": "ignore:starlette.middleware.wsgi is deprecated"}


def mlflow_server_command(tracking_uri: str, host: str, port: int) -> list[str]:
    """The ``mlflow server`` command line of the UI: one worker, the store given.

    Args:
        tracking_uri: the MLflow backend store URI.
        host: the interface to bind.
        port: the TCP port.

    Returns:
        The argv, run with this Python (the venv's MLflow).
    """
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
            "--host", host, "--port", str(port), "--workers", "1"]


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (nothing listens there)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def run_in_group(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` in its own process group until it exits; SIGINT/SIGTERM end the group.

    The signal goes to every process of the group (the server and its workers); those still
    alive after ``STOP_GRACE_S`` seconds are killed.

    Args:
        command: the argv.
        env: its environment.

    Returns:
        The exit code: the child's own, or 128 + the signal that ended it here.
    """
    child = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        _signal_group(child.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = None
    try:
        while (code := child.poll()) is None:
            if received and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:  # it ignored SIGTERM
                _signal_group(child.pid, signal.SIGKILL)
            time.sleep(0.2)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _signal_group(child.pid, signal.SIGKILL)  # workers left behind by the server
    return 128 + received[0] if received else code


def _signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to process group ``pgid``; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
