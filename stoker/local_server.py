"""The long-lived local Prefect server: started on first use, reused by every later command.

Without ``PREFECT_API_URL``, ``stoker run`` and ``stoker cost-guard`` use one Prefect server per
Prefect home: one per user and machine (stoker.environment.prefect_home: its sqlite database,
log and the record of the server), whatever the work folder. The first command starts it in the
background, on a database prepared once beforehand (stoker.server_database); later ones find it
through the record and reuse it, so no command pays a server start (about 8 CPU-s) and the UI
stays up after the run.

* The server runs detached: in its own session (Ctrl-C at the terminal does not reach it) and
  not as a child of the command that started it (a command's second Ctrl-C, which kills its own
  process tree, spares it); its output goes to ``server.log``.
* ``server.json`` records its pid, the pid's start time (so a recycled pid is not mistaken for
  it), its port and API URL; ``server.pid`` is Prefect's own pid file, so ``prefect server
  stop`` with the same ``PREFECT_HOME`` ends it too.
* A file lock (``server.lock``) makes concurrent commands start one server between them.
* A record whose process is gone, or whose process does not answer ``/api/health``, is stale:
  the next command replaces it. Without a readable record (a torn or garbled file), a live
  server of this home (uvicorn with this ``PREFECT_HOME``) that answers is adopted, not doubled.

No Prefect import here: the server is ``uvicorn`` on Prefect's app factory, as
``prefect server start`` runs it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from filelock import FileLock, Timeout

from stoker.server_database import PREPARE_TIMEOUT_S, DatabaseError, prepare_database
from stoker.server_report import cpu_seconds, why_not_started

PORT_FILE = "server.port"  # the port of this home's server: kept when it stops, reused
DEFAULT_PORT = 4200  # Prefect's own default: the UI address users know; another if taken
RECORD = "server.json"
SERVER_LOCK = "server.lock"  # held while a command checks, prepares, starts or stops it
PREFECT_PID_FILE = "server.pid"  # prefect.cli._server_utils.SERVER_PID_FILE_NAME
LOG = "server.log"
PREFECT_APP = "prefect.server.api.server:create_app"  # the app factory uvicorn serves
START_TRIES = 3  # a port taken by another server between the check and the bind: try another

# Starts the server as a grandchild and prints its pid: the command that asked is not its parent.
# The server runs niced: while ranks train on every core, its service loops and the UI take the
# cycles the ranks leave (waits in allreduce, data loading), and a rank that wakes up preempts it
# at once; on an idle machine it is as fast as before.
SERVER_NICE = 10
_DETACH = (f"import os, subprocess, sys; os.nice({SERVER_NICE}); "
           "p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=sys.stderr, "
           "stderr=subprocess.STDOUT); print(p.pid)")


class ServerError(RuntimeError):
    """The local server did not start or did not answer in time."""


def ports_taken(ports: list[int]) -> str:
    """Why the server is not on its usual port: ``port 4200 is taken by another process``."""
    return (f"port {' and '.join(map(str, ports))} {'is' if len(ports) == 1 else 'are'} taken "
            "by another process")


def free_port(host: str = "127.0.0.1", preferred: int | None = None) -> int:
    """``preferred`` when nothing listens on it on ``host``, else a port that is free now."""
    for port in ([preferred] if preferred else []) + [0]:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            # As uvicorn binds: a port left in TIME_WAIT by a killed server is free for it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise ServerError(f"no free port on {host}")


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect API at ``api_url`` answers ``/health`` with 200."""
    try:
        return httpx.get(f"{api_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _listens(record: dict[str, Any]) -> bool:
    """Whether the recorded server's process (or a process it started) listens on the recorded
    port (``port``, else the API URL's), so the server answering there is this one, not another
    home's that took the port first."""
    from urllib.parse import urlsplit

    pid, port = record.get("pid"), record.get("port")
    with contextlib.suppress(ValueError, TypeError):
        port = port if isinstance(port, int) else urlsplit(record["api_url"]).port
    if not isinstance(pid, int) or not 0 < pid < 2**31 or not isinstance(port, int):
        return False
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for proc in procs:
        try:
            connections = (proc.net_connections if hasattr(proc, "net_connections")
                           else proc.connections)(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in connections):
            return True
    return False


def _started_at(pid: Any) -> float | None:
    """The start time of live process ``pid`` (None when gone, a zombie, or not a pid)."""
    if not isinstance(pid, int) or not 0 < pid < 2**31:
        return None
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


class LocalServer:
    """The Prefect server of one Prefect home (``PREFECT_HOME``).

    Args:
        home: the Prefect home; holds ``prefect.db``, ``server.log``, ``server.json``.
        startup_timeout_s: seconds to wait for ``/api/health`` (the database is prepared before).
        say: told what takes long before a start (preparing the database).
    """

    def __init__(self, home: Path, startup_timeout_s: float = 120.0,
                 say: Callable[[str], None] = lambda line: None):
        self.home = Path(home)
        self.startup_timeout_s = startup_timeout_s
        self.log_path = self.home / LOG
        self.say = say
        self.prepare_s = 0.0  # seconds the last start spent preparing the database first
        self._port_taken: list[int] = []  # the usual ports found taken by the last _port()
        # held while a command checks, prepares, starts or stops the server
        self.lock_timeout_s = startup_timeout_s + PREPARE_TIMEOUT_S + 60

    def record(self) -> dict[str, Any] | None:
        """The recorded server, if its process still lives (not whether it answers)."""
        try:
            record = json.loads((self.home / RECORD).read_text())
        except (OSError, ValueError):  # none yet, or torn
            return None
        if not isinstance(record, dict) or not isinstance(record.get("api_url"), str):
            return None
        started = _started_at(record.get("pid"))
        if started is None or abs(started - float(record.get("create_time") or 0)) > 1:
            return None  # gone, or its pid now belongs to another process
        return record

    def running(self) -> dict[str, Any] | None:
        """The recorded server when its process lives and answers, else None."""
        record = self.record()
        return record if record is not None and _listens(record) \
            and healthy(record["api_url"]) else None

    def ensure(self, only_if_recorded: bool = False) -> tuple[str | None, bool]:
        """The API URL of a running server of this home, started now if there is none.

        Args:
            only_if_recorded: start one only while a record is there (the keeper: a server
                ``stoker server stop`` ended has none, and is not started again).

        Returns:
            (api_url, started): ``started`` is True when this call started it; (None, False)
            when ``only_if_recorded`` and there is no record.

        Raises:
            ServerError: it exited or did not answer within ``startup_timeout_s``.
        """
        self.home.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if only_if_recorded and not (self.home / RECORD).exists():
                return None, False  # stopped on purpose while we waited for the lock
            record = self.record() or self._prefect_background_server()
            if record is not None:
                # One still starting (its starter was killed mid-start) gets its whole start-up.
                left = float(record.get("started", 0)) + self.startup_timeout_s - time.time()
                if self._wait_healthy(record, max(10.0, left)):
                    return record["api_url"], False
            self._end(record)  # stale: dead, or alive but not answering
            for pid in server_pids(self.home):  # unrecorded and not answering: same database
                self._end({"pid": pid})
            return self._start(), True

    @contextlib.contextmanager
    def _locked(self):
        """Hold ``server.lock``; a wait for another command that holds it is said first (trial:
        the second of two first runs was silent for 38 s while the first one started it)."""
        lock = FileLock(self.home / SERVER_LOCK, timeout=self.lock_timeout_s)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            self.say("waiting for another command that is starting or stopping the local "
                     f"Prefect server (up to {self.lock_timeout_s:g} s)")
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def _prefect_background_server(self) -> dict[str, Any] | None:
        """A live server of this home without a readable record: one that ``prefect server
        start --background`` started with this home (its pid file), or ours whose record is
        torn or garbled. Found among the processes (uvicorn with this ``PREFECT_HOME``, so the
        pid files are not trusted), on its ``--port`` on 127.0.0.1; adopted, and recorded."""
        for pid in server_pids(self.home):
            started = _started_at(pid)
            try:
                command = psutil.Process(pid).cmdline()
                port = int(command[command.index("--port") + 1]) if "--port" in command \
                    else DEFAULT_PORT
            except (psutil.Error, ValueError, IndexError):
                continue
            record = {"pid": pid, "create_time": started, "port": port,
                      "api_url": f"http://127.0.0.1:{port}/api", "started": started}
            if started is not None and _listens(record) and healthy(record["api_url"]):
                self._write(record)
                return record
        return None

    def _write(self, record: dict[str, Any]) -> None:
        (self.home / PREFECT_PID_FILE).write_text(str(record["pid"]))
        tmp = self.home / f"{RECORD}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.home / RECORD)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """End the recorded server (SIGTERM, SIGKILL after ``grace_s``); returns its pid, or None
        when none was running. Safe to call when nothing runs."""
        self.home.mkdir(parents=True, exist_ok=True)
        with self._locked():
            record = self.record() or self._prefect_background_server()
            self._end(record, grace_s)
            return None if record is None else record["pid"]

    def _end(self, record: dict[str, Any] | None, grace_s: float = 10.0) -> None:
        # The record goes first: a keeper that saw it with a dead pid while the server was
        # being ended started it again (trial: `stoker server stop` during a run was undone).
        for name in (RECORD, PREFECT_PID_FILE):
            (self.home / name).unlink(missing_ok=True)
        if record is not None:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(record["pid"])
                proc.terminate()
                _gone, alive = psutil.wait_procs([proc], timeout=grace_s)
                for left in alive:
                    left.kill()
                psutil.wait_procs(alive, timeout=5)
        for name in (RECORD, PREFECT_PID_FILE):
            (self.home / name).unlink(missing_ok=True)

    def _command(self, port: int) -> list[str]:
        # Found, not imported: importing Prefect here would cost the command seconds.
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
        return [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent),
                "--factory", PREFECT_APP, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", "--lifespan", "on",
                # Open websockets (Prefect's event clients) would hold a graceful stop open.
                "--timeout-graceful-shutdown", "2"]

    def prefer_port(self, port: int) -> None:
        """Start this home's server on ``port`` from now on (``stoker server start --port``),
        when it is free at the start (else as :meth:`_port` says)."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / PORT_FILE).write_text(f"{port}\n")

    def _port(self) -> int:
        """The port this home's server had before (so that links recorded elsewhere, such as
        MLflow's ``prefect.flow_run_url`` tags, keep reaching this home's server), else
        ``DEFAULT_PORT``; another free port when that one is taken now."""
        try:
            sticky = int((self.home / PORT_FILE).read_text().strip())
        except (OSError, ValueError):
            sticky = None
        taken = []
        for preferred in ([sticky] if sticky and 0 < sticky < 65536 else []) + [DEFAULT_PORT]:
            if free_port(preferred=preferred) == preferred:
                break
            if preferred not in taken:
                taken.append(preferred)
        else:
            preferred = free_port()
        # Said in the start line: a user who bookmarked the UI on the usual port learns why
        # the server is elsewhere this time.
        self._port_taken = [p for p in taken if p != preferred]
        return preferred

    def _start(self) -> str:
        """Start this home's server; a start whose port another process took meanwhile (two
        homes starting at once) exits, and is tried again on a port that is free then."""
        began = time.monotonic()
        try:
            prepared = prepare_database(self.home, self._env(), self.log_path, self.say)
        except DatabaseError as e:
            raise ServerError(str(e)) from e
        self.prepare_s = time.monotonic() - began if prepared else 0.0
        for _ in range(START_TRIES - 1):
            port = self._port()
            logged = self._log_size()
            try:
                return self._start_on(port, logged)
            except ServerError:
                # The port is free now and the server did not say it was taken: it failed for
                # another reason. (The other process may have let the port go again already.)
                if free_port(preferred=port) == port and not self._bind_failed(logged):
                    raise
        return self._start_on(self._port(), self._log_size())

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _bind_failed(self, offset: int) -> bool:
        """Whether the server log, after ``offset`` bytes, says its port was in use."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return b"address already in use" in log.read()
        except OSError:
            return False

    def _start_on(self, port: int, logged: int) -> str:
        (self.home / PORT_FILE).write_text(f"{port}\n")
        api_url = f"http://127.0.0.1:{port}/api"
        env = self._env() | {"PREFECT__SERVER_FINAL": "1",
                             # What the UI's settings and links are built from.
                             "PREFECT_SERVER_API_HOST": "127.0.0.1",
                             "PREFECT_SERVER_API_PORT": str(port)}
        try:
            with open(self.log_path, "ab") as log:
                detach = subprocess.run([sys.executable, "-c", _DETACH, *self._command(port)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=log, env=env, cwd=self.home,
                                        start_new_session=True, check=True, timeout=60)
            pid = int(detach.stdout.decode().strip())
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            raise ServerError(f"could not start the Prefect server ({e}); see "
                              f"{self.log_path}") from e
        record = {"pid": pid, "create_time": _started_at(pid) or 0.0, "port": port,
                  "api_url": api_url, "started": time.time()}
        self._write(record)
        why_port = f"{ports_taken(self._port_taken)}; " if self._port_taken else ""
        self.say(f"starting the local Prefect server on 127.0.0.1:{port} ({why_port}pid {pid}; "
                 f"up to {self.startup_timeout_s:g} s; log {self.log_path})")
        if not self._wait_healthy(record, self.startup_timeout_s):
            alive = self.record() is not None
            used_s = cpu_seconds(pid) if alive else None  # before it is ended
            self._end(record)
            why = why_not_started(self.log_path, logged, used_s, self.startup_timeout_s)
            raise ServerError(f"Prefect server on {api_url} "
                              + ("did not answer within " f"{self.startup_timeout_s:g} s"
                                 if alive else "exited") + f"; {why}; see {self.log_path}")
        return api_url

    def _env(self) -> dict[str, str]:
        """The environment of this home's server (and of its database's preparation)."""
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        return env | {"PREFECT_HOME": str(self.home.resolve())}

    def _wait_healthy(self, record: dict[str, Any], timeout_s: float) -> bool:
        """Whether the recorded server answers within ``timeout_s``: its own process listening
        on its port, and the API there healthy. Another home's server that won a race for the
        same port answers too, but it is not this one (its runs would be unknown here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if _listens(record) and healthy(record["api_url"]):
                return True
            if _started_at(record["pid"]) is None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def server_pids(home: Path) -> list[int]:
    """Pids of live Prefect servers whose ``PREFECT_HOME`` is ``home``: uvicorn serving
    Prefect's app (``PREFECT_APP``), as Stoker and ``prefect server start`` run it (tests,
    ``stoker server status``: a server without a record).

    Any uvicorn was taken before, and ``stoker run`` stopped it as a stale server of this home:
    an ``mlflow server`` or ``stoker ui`` started from a shell that exports ``PREFECT_HOME``
    (trial: the run then failed, "no MLflow server answers").
    """
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or []
            if any("uvicorn" in part for part in cmdline) and PREFECT_APP in cmdline and \
                    proc.environ().get("PREFECT_HOME") == str(Path(home).resolve()):
                found.append(proc.pid)
    return found



PROCESS_TAG = "stoker:process="  # flow-run tag: the host, pid and start time of its command


def process_tag(pid: int | None = None) -> str:
    """The flow-run tag naming this process (``stoker:process=HOST:PID:START``): a later command
    that finds the run still Running while the process is gone marks it Crashed."""
    pid = os.getpid() if pid is None else pid
    return f"{PROCESS_TAG}{socket.gethostname()}:{pid}:{_started_at(pid) or 0:.2f}"


def process_gone(tags: list[str]) -> int | None:
    """The pid of a ``process_tag`` in ``tags`` whose process is gone from this host (dead, or
    its pid now belongs to a process started later), else None (alive, another host, no tag,
    or a garbled one)."""
    for tag in tags:
        if not tag.startswith(PROCESS_TAG):
            continue
        host, _, rest = tag.removeprefix(PROCESS_TAG).rpartition(":")[0].partition(":")
        try:
            pid = int(rest)
            start = float(tag.rsplit(":", 1)[1])
        except ValueError:
            return None
        if host != socket.gethostname():
            return None
        started = _started_at(pid)
        return pid if started is None or abs(started - start) > 1 else None
    return None


class ServerKeeper(threading.Thread):
    """While a command uses the local server: if its process dies (OOM killer, ``kill -9``),
    start it again on the same port with the same database, so the command's flow run goes on
    (Prefect's client retries its calls meanwhile) instead of failing after training. A server
    ended by ``stoker server stop`` (its record removed) is not restarted.

    Args:
        server: the local server the command uses.
        on_restart: told a line when a death is found, then one when it is started again (or
            failed to start).
        interval_s: seconds between checks (a record read and a process lookup).
    """

    def __init__(self, server: LocalServer, on_restart: Callable[[str], None],
                 interval_s: float = 1.0):
        super().__init__(name="prefect-server-keeper", daemon=True)
        self.server, self.on_restart, self.interval_s = server, on_restart, interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            if not (self.server.home / RECORD).exists() or self.server.record() is not None:
                continue  # stopped on purpose, or alive
            # Said now, not after the start's seconds (trial: the line came 11-16 s late).
            self.on_restart("the local Prefect server died: starting it again")
            try:
                api_url, started = self.server.ensure(only_if_recorded=True)
            except ServerError as e:
                self.on_restart(f"the local Prefect server died and did not start again: {e}")
                continue
            if started and api_url is not None:
                self.on_restart(f"the local Prefect server died: started again at "
                                f"{api_url.removesuffix('/api')}")

    def stop(self) -> None:
        self.stopped.set()
