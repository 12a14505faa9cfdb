"""The local Prefect server's database, prepared once before its first start.

A Prefect server on a new sqlite database first runs the schema migrations and registers the
block types (about 7 CPU-s; 20 s to a healthy server on 2 loaded cores, against 7 s on a
prepared one), all inside the start timeout. Stoker does that work once, beforehand, in a
process of its own with the server's own settings (so the server finds nothing to migrate and
its block-registration memo matches), under the server's file lock (two commands never migrate
one sqlite file at once), and says so: ``preparing the Prefect database (once)``.

``database.prepared`` in the Prefect home records the Prefect version that prepared it (and a
hash of ``PREFECT_API_DATABASE_CONNECTION_URL`` when set, never the URL: it may hold a
password); another version prepares it again (its new migrations).

No Prefect import here: the work runs in a child process (Prefect's server modules take
seconds to import).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from stoker.server_report import log_tail

STAMP = "database.prepared"  # what prepared the database: Prefect's version (+ URL hash)
PREPARE_TIMEOUT_S = 600.0  # a loaded 2-core machine took 17 s; a hung one is ended

# What the server's lifespan does before it serves (prefect.server.api.server.create_app:
# run_migrations, then add_block_types with its memo), and nothing else.
_PREPARE = """
# Held for the whole preparation, by this process itself, from before Prefect's imports (seconds:
# `stoker server status` says "starting" from the first one): one whose command was killed
# (kill -9) goes on, and the next command's preparation waits for it instead of migrating the
# same new database beside it (trial).
import sys
from filelock import FileLock

_held = FileLock(sys.argv[1])
_held.acquire()

import asyncio
from prefect.server.api.server import _memoize_block_auto_registration
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration

async def prepare():
    db = provide_database_interface()
    await db.create_db()

    @_memoize_block_auto_registration
    async def register_blocks():
        async with await db.session() as session:
            await run_block_auto_registration(session=session)

    await register_blocks()

asyncio.run(prepare())
_held.release()
print("prepared", flush=True)
"""
PREPARE_LOCK = "database.lock"


class DatabaseError(RuntimeError):
    """The Prefect database could not be prepared."""


def stamp(environ: Mapping[str, str] | None = None) -> str:
    """What a prepared database must have been prepared with.

    Args:
        environ: the server's environment (default: this process's).

    Returns:
        ``prefect==VERSION``, plus `` url-sha256=HEX`` when the database URL is set.
    """
    environ = os.environ if environ is None else environ
    text = f"prefect=={importlib.metadata.version('prefect')}"
    url = environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
    if url:
        text += f" url-sha256={hashlib.sha256(url.encode()).hexdigest()}"
    return text


def is_prepared(home: Path, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the database of Prefect home ``home`` was prepared by this Prefect version (and,
    with the default URL, whether its ``prefect.db`` is still there).

    Args:
        home: the Prefect home (``PREFECT_HOME`` of the server).
        environ: the server's environment (default: this process's).
    """
    environ = os.environ if environ is None else environ
    try:
        recorded = (home / STAMP).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    if not environ.get("PREFECT_API_DATABASE_CONNECTION_URL") and \
            not (home / "prefect.db").is_file():
        return False  # deleted by hand: a new one is made
    return recorded == stamp(environ)


def prepare_database(home: Path, env: Mapping[str, str], log_path: Path,
                     say: Callable[[str], None] = lambda line: None,
                     timeout_s: float = PREPARE_TIMEOUT_S) -> bool:
    """Migrate the database of ``home`` and register Prefect's block types, unless done already.

    The caller holds the server's lock (no server of ``home`` runs, no other command prepares).

    Args:
        home: the Prefect home.
        env: the environment the server will run with (its ``PREFECT_HOME`` is ``home``).
        log_path: where the preparation's output goes (the server's log).
        say: told one line before the work and one after it.
        timeout_s: seconds before a preparation is ended as hung.

    Returns:
        True when it prepared the database now, False when it was prepared already.

    Raises:
        DatabaseError: the preparation failed or took longer than ``timeout_s``; the message
            carries the last lines it wrote.
    """
    if is_prepared(home, env):
        return False
    database = ("the database of PREFECT_API_DATABASE_CONNECTION_URL"
                if env.get("PREFECT_API_DATABASE_CONNECTION_URL") else str(home / "prefect.db"))
    if preparing(home):  # an earlier preparation goes on (its command was killed): this waits
        say("waiting for an earlier preparation of the Prefect database to end (its command "
            "was stopped; it goes on)")
    say(f"preparing the Prefect database (once): {database}")
    started = time.monotonic()
    offset = log_path.stat().st_size if log_path.exists() else 0
    try:
        with open(log_path, "ab") as log:
            done = subprocess.run([sys.executable, "-c", _PREPARE, str(home / PREPARE_LOCK)],
                                  env=dict(env), cwd=home,
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise DatabaseError(f"preparing the Prefect database took over {timeout_s:g} s; "
                            f"see {log_path}") from e
    except OSError as e:
        raise DatabaseError(f"could not prepare the Prefect database ({e})") from e
    if done.returncode != 0:
        tail = " | ".join(log_tail(log_path, offset)) or f"nothing written to {log_path.name}"
        raise DatabaseError(f"preparing the Prefect database failed (exit {done.returncode}); "
                            f"its last log lines: {tail}; see {log_path}")
    tmp = home / f"{STAMP}.tmp"
    tmp.write_text(stamp(env) + "\n")
    tmp.replace(home / STAMP)
    say(f"Prefect database ready in {time.monotonic() - started:.1f} s")
    return True


def preparing(home: Path) -> bool:
    """Whether a process prepares the database of ``home`` now (it holds ``database.lock``);
    creates no file (``stoker server status`` of a home without one says no)."""
    return lock_held(Path(home) / PREPARE_LOCK)


def lock_held(lock_path: Path) -> bool:
    """Whether another process holds the file lock ``lock_path`` now; creates no file."""
    from filelock import FileLock, Timeout

    if not Path(lock_path).exists():
        return False
    lock = FileLock(lock_path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return True
    lock.release()
    return False
