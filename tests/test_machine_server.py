"""One local Prefect server per user and machine, on a database prepared once (issue 45): every
work folder reuses it, two commands starting at once make one server and one database, a torn
record of a live server does not double it, and PREFECT_HOME moves it.

Each test gives its commands a state folder of its own (XDG_STATE_HOME, where platformdirs puts
the user's state on Linux), so "the machine" is the test's; the fixture stops its server."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from local_servers import stop_local_servers

from stoker.local_server import PORT_FILE, free_port, server_pids
from stoker.server_database import STAMP, is_prepared, stamp

pytestmark = pytest.mark.integration

PREPARING = "preparing the Prefect database (once): "


@pytest.fixture
def machine(tmp_path):
    """The test's stand-in for the user's state folder; the server started there is stopped."""
    state = tmp_path / "state"
    yield state
    stop_local_servers(tmp_path)


def home_of(state: Path) -> Path:
    return state / "stoker" / "prefect"


def env(state: Path, **extra: str) -> dict[str, str]:
    """A user's environment: no PREFECT_API_URL nor PREFECT_HOME, the state folder ``state``."""
    plain = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    return plain | {"XDG_STATE_HOME": str(state)} | extra


def stoker(state: Path, *args: str, **extra: str) -> subprocess.Popen:
    """``stoker ARGS`` started in the test's folder (the parent of ``state``)."""
    return subprocess.Popen([sys.executable, "-m", "stoker.cli", *args], env=env(state, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=state.parent)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def own_port(state: Path) -> None:
    """A free port for this machine's server, not the 4200 that the other xdist worker's
    servers take (tests/test_local_server.own_port)."""
    home_of(state).mkdir(parents=True, exist_ok=True)
    (home_of(state) / PORT_FILE).write_text(f"{free_port()}\n")


def test_two_work_folders_reuse_one_server(machine, tmp_path):
    """Issue 45: each new work_dir started another server. Two runs in two work folders: one
    server process, and both flow runs read back from it."""
    own_port(machine)
    runs = {}
    for name in ("a", "b"):
        work = tmp_path / name
        runs[name] = finish(stoker(machine, "run", f"work_dir={work}", "train.epochs=1",
                                   "tracking.system_metrics_interval_s=null"))
        assert runs[name][0] == 0, runs[name][2][-3000:]
    assert "Local Prefect server started" in runs["a"][2]
    assert "Local Prefect server reused" in runs["b"][2]
    record = json.loads((home_of(machine) / "server.json").read_text())
    assert server_pids(home_of(machine)) == [record["pid"]]
    assert not (tmp_path / "a" / ".prefect").exists() and not (tmp_path / "b" / ".prefect").exists()
    flow_runs = httpx.post(f"{record['api_url']}/flow_runs/filter", json={}, timeout=30).json()
    assert sorted((r["state"]["type"], Path(r["parameters"]["config"]["work_dir"]).name)
                  for r in flow_runs) == [("COMPLETED", "a"), ("COMPLETED", "b")]


def alembic_head() -> str:
    import prefect.server.database
    from alembic.script import ScriptDirectory

    migrations = Path(prefect.server.database.__file__).parent / "_migrations"
    return ScriptDirectory(str(migrations), version_locations=[
        str(migrations / "versions" / "sqlite")]).get_current_head()


def test_the_first_start_prepares_the_database_once(machine):
    """The first start migrates the new database and registers the block types before the
    server starts (not under its start timeout), saying so; later starts do not, until
    another Prefect version (or a deleted database) asks for it again."""
    own_port(machine)
    code, out, err = finish(stoker(machine, "server", "start"))
    assert code == 0 and out.startswith("started: "), err
    home = home_of(machine)
    lines = err.splitlines()
    assert f"{PREPARING}{home / 'prefect.db'}" in lines, err
    assert lines[lines.index(f"{PREPARING}{home / 'prefect.db'}") + 1].startswith(
        "Prefect database ready in "), err
    with sqlite3.connect(home / "prefect.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == \
            [(alembic_head(),)]
    assert "block_auto_registration" in (home / "memo_store.toml").read_text()
    assert is_prepared(home, env(machine)) and (home / STAMP).read_text().strip() == stamp({})
    assert finish(stoker(machine, "server", "stop"))[0] == 0
    code, out, err = finish(stoker(machine, "server", "start"))
    assert code == 0 and out.startswith("started: ") and PREPARING not in err, err
    assert finish(stoker(machine, "server", "stop"))[0] == 0
    (home / STAMP).write_text("prefect==3.0.0\n")  # prepared by an older Prefect
    code, out, err = finish(stoker(machine, "server", "start"))
    assert code == 0 and PREPARING in err and (home / STAMP).read_text().strip() == stamp({})


def test_two_commands_at_once_on_a_new_machine_make_one_database_and_one_server(machine):
    """Two commands starting at once on a machine without a server or database: one prepares
    the sqlite database (two processes creating it at once race), one starts the server, the
    other reuses it."""
    own_port(machine)
    starts = [finish(p) for p in [stoker(machine, "server", "start") for _ in range(2)]]
    assert [code for code, _, _ in starts] == [0, 0], starts
    assert sorted(out.split(":")[0] for _, out, _ in starts) == ["already running", "started"]
    assert sum(err.count(PREPARING) for _, _, err in starts) == 1, starts
    record = json.loads((home_of(machine) / "server.json").read_text())
    assert server_pids(home_of(machine)) == [record["pid"]]


def test_a_torn_record_of_a_live_server_is_not_a_second_server(machine):
    """The record and Prefect's pid file are outside values: torn (a crash mid-write) or
    garbled, the live server of this home is found among the processes and reused, and
    ``stoker server stop`` still ends it."""
    own_port(machine)
    assert finish(stoker(machine, "server", "start"))[0] == 0
    home = home_of(machine)
    pid = json.loads((home / "server.json").read_text())["pid"]
    for torn in ('{"pid": 1', "", "[]", '{"pid": 4294967295, "api_url": "http://x/api"}'):
        (home / "server.json").write_text(torn)
        (home / "server.pid").write_text(str(pid)[:-1])
        code, out, err = finish(stoker(machine, "server", "start"))
        assert code == 0 and out.startswith("already running"), (torn, out, err)
        assert server_pids(home) == [pid]
        assert json.loads((home / "server.json").read_text())["pid"] == pid
    (home / "server.json").write_text('{"pid": ')
    code, out, _ = finish(stoker(machine, "server", "stop"))
    assert code == 0 and f"stopped (pid {pid})" in out
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_servers_home_is_the_users_state_folder_or_prefect_home(machine, tmp_path):
    """Without PREFECT_HOME the server's home is in the user's state folder, whatever
    ``--work-dir``; an explicit PREFECT_HOME wins (and nothing is created by ``status``)."""
    code, out, _ = finish(stoker(machine, "server", "status", "-w", str(tmp_path / "w")))
    assert code == 1 and out.strip() == f"not running; home {home_of(machine)}"
    own = tmp_path / "own-home"
    code, out, _ = finish(stoker(machine, "server", "status", PREFECT_HOME=str(own)))
    assert code == 1 and out.strip() == f"not running; home {own}"
    assert not own.exists() and not (tmp_path / "w").exists()


def test_a_database_without_its_stamp_is_prepared_again(tmp_path):
    """A preparation killed midway writes no stamp: the next start prepares again (alembic
    goes on from the revision the database records) instead of trusting a half-made
    database; a prepared one is left alone."""
    from stoker.server_database import prepare_database

    home = tmp_path / "prefect"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"")  # what a preparation killed at its start leaves
    server_env = env(tmp_path / "state", PREFECT_HOME=str(home))
    said: list[str] = []
    assert not is_prepared(home, server_env)
    assert prepare_database(home, server_env, home / "server.log", said.append)
    assert said[0] == f"{PREPARING}{home / 'prefect.db'}" and is_prepared(home, server_env)
    assert not prepare_database(home, server_env, home / "server.log", said.append)
    assert len(said) == 2
    (home / "prefect.db").unlink()  # deleted by hand: made again
    assert not is_prepared(home, server_env)


def test_a_preparation_waits_for_one_whose_command_was_killed(tmp_path):
    """kill -9 of `stoker run` while it prepared the database leaves its preparation running;
    the next command's preparation waits for that one (its lock, held by the preparing
    process itself) instead of migrating the same new database beside it (trial: both ran)."""
    from filelock import FileLock

    from stoker.server_database import PREPARE_LOCK, DatabaseError, prepare_database

    home = tmp_path / "prefect"
    home.mkdir()
    server_env = env(tmp_path / "state", PREFECT_HOME=str(home))
    with FileLock(home / PREPARE_LOCK):  # the orphaned preparation, still at work
        with pytest.raises(DatabaseError, match="took over 5 s"):
            prepare_database(home, server_env, home / "server.log", timeout_s=5)
        assert not is_prepared(home, server_env)
        assert not (home / "prefect.db").exists()  # it waited: nothing migrated beside it
    assert prepare_database(home, server_env, home / "server.log")  # once it is done
    assert is_prepared(home, server_env)
