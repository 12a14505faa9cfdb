"""``stoker server start|status|stop``, and the Prefect API of ``stoker run`` and ``stoker
cost-guard``: the one long-lived local Prefect server of this user and machine, or
PREFECT_API_URL.

Its state lives in Prefect's home (``PREFECT_HOME`` when set, else ``prefect`` in the user's
state folder: stoker.environment.prefect_home): the sqlite database, ``server.log``, and
``server.json`` (pid, port, API URL). See stoker.local_server.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

server_app = typer.Typer(no_args_is_help=True, help="The local Prefect server that `stoker run` "
                         "starts on first use and every work folder reuses (one per user and "
                         "machine; its UI shows every run).")

WORK_DIR = typer.Option("--work-dir", "-w", help="Accepted for older scripts; no effect: the "
                        "server is the same for every work folder (its state is in "
                        "PREFECT_HOME when set, else in the user's state folder)")


def _server(work_dir: Path, create: bool = True):
    """The local server of this user and machine (``status`` and ``stop`` create no folder)."""
    from stoker.environment import TELEMETRY_OFF, prefect_home, quiet_telemetry
    from stoker.local_server import LocalServer

    if create:
        quiet_telemetry(work_dir)
    else:
        for name, value in TELEMETRY_OFF.items():
            os.environ.setdefault(name, value)
    return LocalServer(prefect_home(), float(os.environ.get(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")),
        say=lambda line: typer.echo(line, err=True))


@server_app.command()
def start(work_dir: Annotated[Path, WORK_DIR] = Path("work"),
          port: Annotated[int | None, typer.Option(
              "--port", min=1, max=65535, help="Listen on this port (127.0.0.1); kept for "
              "later starts of the local server. Default: the port it had before, "
              "else 4200, else a free one")] = None) -> None:
    """Start the local server in the background (nothing to do if it runs); print its UI address.

    Exit codes: 0 running, 1 it did not start (its log is named), 2 ``--port`` cannot be had
    (another process listens there, or this server runs on another port)."""
    from stoker.local_server import ServerError, free_port

    server = _server(work_dir)
    if port is not None:
        running = server.running()
        if running is not None and running.get("port") != port:
            typer.echo(f"error: --port {port}: the local server already runs on port "
                       f"{running.get('port')}; `stoker server stop` it first", err=True)
            raise typer.Exit(2)
        if running is None:
            if free_port(preferred=port) != port:
                typer.echo(f"error: --port {port}: another process listens on 127.0.0.1:{port}",
                           err=True)
                raise typer.Exit(2)
            server.prefer_port(port)
    try:
        api_url, started = server.ensure()
    except ServerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{'started' if started else 'already running'}: {api_url.removesuffix('/api')} "
               f"(log {server.log_path})")


@server_app.command()
def status(work_dir: Annotated[Path, WORK_DIR] = Path("work")) -> None:
    """Say whether the local server runs: pid, UI address, log; or that it is still starting.
    Exit codes: 0 running, 1 not (yet) answering."""
    from stoker.local_server import SERVER_LOCK
    from stoker.server_database import lock_held, preparing
    from stoker.server_report import not_answering

    server = _server(work_dir, create=False)
    record = server.running()
    if record is None:
        said = not_answering(server.record(), server.startup_timeout_s,
                             preparing=preparing(server.home),
                             locked=lock_held(server.home / SERVER_LOCK))
        typer.echo(f"{said}; home {server.home}")
        raise typer.Exit(1)
    typer.echo(f"running: pid {record['pid']}, {record['api_url'].removesuffix('/api')}, "
               f"log {server.log_path}")


@server_app.command()
def env(work_dir: Annotated[Path, WORK_DIR] = Path("work")) -> None:
    """Print the shell line that points Prefect's own CLI and clients at the local server
    (``export PREFECT_API_URL=...``), for ``eval "$(stoker server env)"``; then ``prefect
    flow-run ls`` lists the runs of every work folder. Exit codes: 0 running, 1 not (nothing
    printed on stdout)."""
    import shlex

    server = _server(work_dir, create=False)
    record = server.running()
    if record is None:
        typer.echo(f"error: no local server running in {server.home} (`stoker server start` "
                   "starts it)", err=True)
        raise typer.Exit(1)
    typer.echo(f"export PREFECT_API_URL={shlex.quote(record['api_url'])}")


@server_app.command()
def stop(work_dir: Annotated[Path, WORK_DIR] = Path("work")) -> None:
    """End the local server (SIGTERM, then SIGKILL after 10 s). Exit code 0 also when none ran."""
    server = _server(work_dir, create=False)
    pid = server.stop() if server.home.is_dir() else None
    typer.echo("no local server running" if pid is None else f"stopped (pid {pid})")


def start_line(api_url: str, took_s: float | None, prepare_s: float = 0.0) -> str:
    """The line that says where the local Prefect server is and whether this command started it.

    Args:
        api_url: the server's API URL (``.../api``).
        took_s: seconds this command waited for the server, its database's preparation
            included; None when it reused a running one.
        prepare_s: of those, the seconds it spent preparing the database (once per machine and
            Prefect version; said in its own line before), not counted as the start's.
    """
    if took_s is None:
        how = "reused"
    else:
        how = f"started in {max(0.0, took_s - prepare_s):.1f} s"
        if prepare_s:
            how += f" (after preparing its database, {prepare_s:.1f} s)"
    return (f"Local Prefect server {how}: UI at {api_url.removesuffix('/api')} "
            "(`stoker server stop` ends it)")


@contextlib.contextmanager
def prefect_api(log_path: Path | None = None):
    """The Prefect API for this command: PREFECT_API_URL when set, else the long-lived local
    server of PREFECT_HOME, started in the background on first use (stoker.local_server).
    A restart of that server is said on stderr, and appended to ``log_path`` when given (the
    work folder's ``logs/output.log``).

    Flow runs started inside carry this process's tag; runs that an earlier command left Running
    when its process died (SIGKILL) are marked Crashed first.

    Raises:
        ServerError: the local server did not start.
        stoker.server_auth.CredentialError: PREFECT_API_URL refuses this user's credential.
    """
    from stoker.server_auth import check_prefect_api

    check_prefect_api()  # PREFECT_API_URL only: the local server asks for no credential
    keeper = None
    if not os.environ.get("PREFECT_API_URL"):
        from stoker.local_server import LocalServer, ServerKeeper

        started_at = time.monotonic()
        server = LocalServer(Path(os.environ["PREFECT_HOME"]),
                             float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]),
                             say=_log_line)
        api_url, started = server.ensure()
        # Prefect's log format: benchmarks/bench_pipeline_overhead.py times the phases from it.
        _log_line(start_line(api_url, time.monotonic() - started_at if started else None,
                             server.prepare_s))
        # Before Prefect is imported: its global settings (seen by every thread) read the env.
        os.environ["PREFECT_API_URL"] = api_url
        from stoker.stdio import line_writer

        # To this stderr, not to what sys.stderr is when the keeper speaks (trial: its line went
        # to the StringIO of MLflow's quiet store creation, or onto Prefect's unended line).
        write = line_writer(copy_to=log_path)
        keeper = ServerKeeper(server, on_restart=lambda line: write(_log_text(line, "WARNING")))
        keeper.start()
    from prefect import tags

    from stoker.local_server import process_tag
    from stoker.orchestration.flow_runs import crash_runs_of_gone_processes

    try:
        try:
            crash_runs_of_gone_processes()
        except Exception as e:  # noqa: BLE001 - bookkeeping of earlier runs never fails this one
            typer.echo(f"warning: could not mark the runs of dead commands Crashed: {e}",
                       err=True)
        with tags(process_tag()), _no_flow_heartbeats(local=keeper is not None):
            yield
    finally:
        if keeper is not None:
            keeper.stop()
        drain_prefect_workers()


# Prefect's settings for flow run heartbeats; one set by the user is kept.
HEARTBEAT_SETTINGS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


def _no_flow_heartbeats(local: bool):
    """On the local server, and unless the user set ``HEARTBEAT_SETTINGS``: no flow run
    heartbeats. They exist for an automation that marks a silent run Crashed; the local
    server has none (Stoker marks the runs of dead commands Crashed itself, above), and the
    heartbeat thread sleeps in 1 s steps that the flow's end joins: every run waited up to
    1 s more (0.9 s measured) after its last task. A ``PREFECT_API_URL`` server (a team's)
    keeps Prefect's default (180 s)."""
    if not local or any(os.environ.get(name) for name in HEARTBEAT_SETTINGS):
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def _log_text(line: str, level: str = "INFO") -> str:
    """``line`` in Prefect's log format: ``HH:MM:SS.mmm | LEVEL   | stoker - line``."""
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:12]
    return f"{stamp} | {level:<7} | stoker - {line}"


def _log_line(line: str, level: str = "INFO") -> None:
    """One line on stderr in Prefect's log format (benchmarks/bench_pipeline_overhead.py times
    the phases from it)."""
    typer.echo(_log_text(line, level), err=True)


def drain_prefect_workers() -> None:
    """Send Prefect's queued logs and events (before the server they go to stops)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)
