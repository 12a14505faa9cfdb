"""A real Prefect server on 127.0.0.1 for tests, with its own home and sqlite database."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import httpx
from filelock import FileLock
from mlflow_server import free_port

from stoker.launch.local import terminate_tree
from stoker.server_database import STAMP, stamp

# A fresh sqlite database costs a starting server about 7 s and 6 CPU-s of migrations (and the
# block types' registration): 11.6 s to a healthy server here, 4.5 s with both done. Tests start
# some twenty-five servers (PrefectServer's, and the local ones `stoker run` starts in a new work
# folder: tests/local_servers.embedded_env), so each starts from a copy of one migrated database,
# made once per Prefect version and user and shared by the xdist workers. What a server does at
# start is unchanged: it checks the schema and finds nothing to migrate. (A user's first
# `stoker run` prepares the database once, stoker.server_database; prefect_test_harness still
# makes its own database.)
TEMPLATE = (Path(tempfile.gettempdir()) / f"stoker-tests-prefect-{os.getuid()}"
            / importlib.metadata.version("prefect"))  # (importing prefect here costs ~1 s)
MEMO = "memo_store.toml"  # Prefect's record that the block types are registered in the database


def migrated_template() -> Path:
    """The folder of the migrated template: ``prefect.db`` and ``memo_store.toml``."""
    if (TEMPLATE / "prefect.db").exists():
        return TEMPLATE
    TEMPLATE.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{TEMPLATE}.lock"):
        if not (TEMPLATE / "prefect.db").exists():
            staging = Path(tempfile.mkdtemp(prefix="making-", dir=TEMPLATE.parent))
            with PrefectServer(staging / "server", seeded=False):
                pass
            made = staging / "template"
            made.mkdir()
            # sqlite's backup: one self-contained file, whatever the WAL still held
            with closing(sqlite3.connect(staging / "server" / "prefect.db")) as source, \
                    closing(sqlite3.connect(made / "prefect.db")) as copy:
                source.backup(copy)
            shutil.copy2(staging / "server" / "home" / MEMO, made / MEMO)
            made.rename(TEMPLATE)
            shutil.rmtree(staging, ignore_errors=True)
    return TEMPLATE


def seed_prefect_home(home: Path, database: Path | None = None) -> Path:
    """Put a copy of the migrated database in a Prefect home that has none (a server started
    there then skips the migrations); ``database``: where the server's database is, when not
    ``home/prefect.db``. Returns ``home``."""
    database = database or home / "prefect.db"
    if database.exists():
        return home
    template = migrated_template()
    home.mkdir(parents=True, exist_ok=True)
    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(template / "prefect.db", database)
    shutil.copy2(template / MEMO, home / MEMO)
    # Prepared by this Prefect version: a local server started there skips the preparation.
    (home / STAMP).write_text(stamp({}) + "\n")
    return home


class PrefectServer:
    """``prefect server start`` on a free loopback port; ``env`` points clients at it.
    ``seeded``: start from a copy of the migrated database (:func:`seed_prefect_home`);
    ``env``: more variables for the server and its clients (PREFECT_SERVER_API_AUTH_STRING)."""

    def __init__(self, root: Path, seeded: bool = True, env: dict[str, str] | None = None):
        self.root = root
        self.seeded = seeded
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ, "PREFECT_HOME": str(root / "home"), "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'prefect.db'}",
            "PREFECT_UI_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
            # No scheduler: scheduled runs (cost-guard every 5 min) must not reach test workers.
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "DVC_NO_ANALYTICS": "1", **(env or {}),
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
        if self.seeded:
            seed_prefect_home(self.root / "home", self.root / "prefect.db")
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

