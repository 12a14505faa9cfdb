"""``stoker server start|status|stop``: the long-lived local Prefect server of a work folder.

Its state lives in ``<work_dir>/.prefect`` (or ``PREFECT_HOME`` when set): the sqlite database,
``server.log``, and ``server.json`` (pid, port, API URL). See stoker.local_server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

server_app = typer.Typer(no_args_is_help=True, help="The local Prefect server that `stoker run` "
                         "starts on first use and reuses (its UI shows every run).")

WORK_DIR = typer.Option("--work-dir", "-w", help="The work folder; the server's state is in "
                        "<work-dir>/.prefect unless PREFECT_HOME is set")


def _server(work_dir: Path):
    from stoker.cli import quiet_telemetry
    from stoker.local_server import LocalServer

    quiet_telemetry(work_dir)
    return LocalServer(Path(os.environ["PREFECT_HOME"]),
                       float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))


@server_app.command()
def start(work_dir: Annotated[Path, WORK_DIR] = Path("work")) -> None:
    """Start the local server in the background (nothing to do if it runs); print its UI address.

    Exit codes: 0 running, 1 it did not start (its log is named)."""
    from stoker.local_server import ServerError

    server = _server(work_dir)
    try:
        api_url, started = server.ensure()
    except ServerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{'started' if started else 'already running'}: {api_url.removesuffix('/api')} "
               f"(log {server.log_path})")


@server_app.command()
def status(work_dir: Annotated[Path, WORK_DIR] = Path("work")) -> None:
    """Say whether the local server runs: pid, UI address, log. Exit codes: 0 running, 1 not."""
    server = _server(work_dir)
    record = server.running()
    if record is None:
        stale = server.record() is not None
        typer.echo("not running" + (" (its process lives but does not answer; `stoker server "
                                    "stop` ends it)" if stale else "") + f"; home {server.home}")
        raise typer.Exit(1)
    typer.echo(f"running: pid {record['pid']}, {record['api_url'].removesuffix('/api')}, "
               f"log {server.log_path}")


@server_app.command()
def stop(work_dir: Annotated[Path, WORK_DIR] = Path("work")) -> None:
    """End the local server (SIGTERM, then SIGKILL after 10 s). Exit code 0 also when none ran."""
    pid = _server(work_dir).stop()
    typer.echo("no local server running" if pid is None else f"stopped (pid {pid})")
