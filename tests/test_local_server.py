"""The long-lived local Prefect server on real processes: ``stoker server start|status|stop``, a
killed server replaced, concurrent starts, reuse by ``stoker run`` and ``stoker cost-guard``.

Each test has its own work folder and its own stand-in for the user's state folder
(XDG_STATE_HOME), so its own server home; the fixture stops the server."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from local_servers import stop_local_servers
from mlflow import MlflowClient
from prefect_server import seed_prefect_home

from stoker.local_server import PORT_FILE, SERVER_NICE, LocalServer, ServerError, server_pids
from stoker.server_cli import start_line
from stoker.server_database import STAMP, stamp

pytestmark = pytest.mark.integration


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}


def stoker(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout)


def home(work: Path) -> Path:
    """The Prefect home of the test user's one local server (in the state folder the ``work``
    fixture gives the test as XDG_STATE_HOME), whatever the work folder."""
    return work.parent / "state" / "stoker" / "prefect"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A work folder whose local server (the user's, in ``home(work)``) is always stopped after
    the test."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    work = tmp_path / "work"
    seed_prefect_home(home(work))
    yield work
    stop_local_servers(tmp_path)
    assert server_pids(home(work)) == []


def own_port(prefect_home: Path) -> int:
    """Give the server of ``prefect_home`` a free port of its own instead of the default 4200
    (the port a home's server had before is kept: ``PORT_FILE``): the tests on the other xdist
    worker start servers on 4200, and one that takes it between a stop and a restart here
    would move this server (correctly) to another port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefect_home.mkdir(parents=True, exist_ok=True)
    (prefect_home / PORT_FILE).write_text(str(port))
    return port


def record(work: Path) -> dict:
    return json.loads((home(work) / "server.json").read_text())


def test_server_start_status_stop(work):
    own_port(home(work))
    first = stoker("server", "start", "-w", str(work))
    assert first.returncode == 0 and first.stdout.startswith("started: http://127.0.0.1:"), \
        first.stdout + first.stderr
    pid = record(work)["pid"]
    assert httpx.get(f"{record(work)['api_url']}/health", timeout=5).status_code == 200
    assert psutil.Process(pid).ppid() != os.getpid()  # detached: not a child of the command
    assert os.getsid(pid) != os.getsid(0)  # its own session: Ctrl-C at the terminal misses it
    # Niced, every thread: ranks training on all cores preempt it (the nice of this test's own
    # process plus SERVER_NICE, capped at 19).
    assert {psutil.Process(t.id).nice() for t in psutil.Process(pid).threads()} == \
        {min(19, os.nice(0) + SERVER_NICE)}
    again = stoker("server", "start", "-w", str(work))
    assert again.stdout.startswith("already running") and record(work)["pid"] == pid
    status = stoker("server", "status", "-w", str(work))
    assert status.returncode == 0 and f"pid {pid}" in status.stdout
    assert (home(work) / "server.pid").read_text() == str(pid)  # `prefect server stop`
    # Prefect's own CLI, pointed at it (new-user trial: `prefect flow-run ls` started a
    # temporary server of ~/.prefect and said "No flow runs found").
    shell = stoker("server", "env", "-w", str(work))
    assert shell.returncode == 0 and shell.stdout == \
        f"export PREFECT_API_URL={record(work)['api_url']}\n", shell.stdout + shell.stderr
    pointed = {**os.environ, "PREFECT_HOME": str(work / "cli-home"),
               "PREFECT_API_URL": shell.stdout.strip().split("=", 1)[1]}
    made = subprocess.run([str(Path(sys.executable).parent / "prefect"), "work-pool", "create",
                           "env-probe", "--type", "process"], env=pointed, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    pools = httpx.post(f"{record(work)['api_url']}/work_pools/filter", json={}, timeout=10)
    assert "env-probe" in {p["name"] for p in pools.json()}, pools.text
    stopped = stoker("server", "stop", "-w", str(work))
    assert stopped.returncode == 0 and f"stopped (pid {pid})" in stopped.stdout
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert stoker("server", "status", "-w", str(work)).returncode == 1
    gone = stoker("server", "env", "-w", str(work))
    assert gone.returncode == 1 and gone.stdout == "" and "no local server running" in gone.stderr
    assert "no local server running" in stoker("server", "stop", "-w", str(work)).stdout
    port = re.search(r"127\.0\.0\.1:(\d+)", first.stdout).group(1)
    again = stoker("server", "start", "-w", str(work))  # a restart keeps its address
    assert again.stdout.startswith(f"started: http://127.0.0.1:{port}"), again.stdout


def test_server_start_on_a_chosen_port(work):
    """``--port`` (new-user trial: the only way was the undocumented ``server.port`` file):
    the server listens there, later starts keep it, and a port it cannot have is refused
    with one line and exit 2, before anything starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = stoker("server", "start", "-w", str(work), "--port", str(port))
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.startswith(f"started: http://127.0.0.1:{port} ")
    assert record(work)["port"] == port
    other = stoker("server", "start", "-w", str(work), "--port", str(port + 1))
    assert other.returncode == 2 and other.stderr.strip().splitlines() == [
        f"error: --port {port + 1}: the local server already runs on port {port}; "
        "`stoker server stop` it first"]
    assert stoker("server", "stop", "-w", str(work)).returncode == 0
    assert stoker("server", "start", "-w", str(work)).stdout.startswith(  # kept
        f"started: http://127.0.0.1:{port} ")
    assert stoker("server", "stop", "-w", str(work)).returncode == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        refused = stoker("server", "start", "-w", str(work), "--port", str(busy))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: --port {busy}: another process listens on 127.0.0.1:{busy}"]
    assert stoker("server", "status", "-w", str(work)).returncode == 1  # nothing started


def test_a_killed_server_is_replaced(work):
    own_port(home(work))
    assert stoker("server", "start", "-w", str(work)).returncode == 0
    dead, port = record(work)["pid"], record(work)["port"]
    psutil.Process(dead).kill()  # kill -9: its record and Prefect's pid file stay behind
    psutil.Process(dead).wait(timeout=10)
    assert stoker("server", "status", "-w", str(work)).returncode == 1
    again = stoker("server", "start", "-w", str(work))
    assert again.stdout.startswith("started"), again.stdout + again.stderr
    assert record(work)["pid"] != dead
    # the same address: links to its flow runs recorded elsewhere (MLflow tags) still work
    assert record(work)["port"] == port
    assert server_pids(home(work)) == [record(work)["pid"]]
    assert LocalServer(home(work)).running() is not None


def test_a_server_stopped_while_a_run_keeps_it_is_not_started_again(work):
    """`stoker server stop` while a run's keeper watches the server (every 0.05 s here): it
    stays stopped (trial: the keeper saw the record with a dead pid mid-stop and started a new
    server, "the local Prefect server died: started again")."""
    from stoker.local_server import ServerKeeper

    own_port(home(work))
    assert stoker("server", "start", "-w", str(work)).returncode == 0
    said: list[str] = []
    keeper = ServerKeeper(LocalServer(home(work)), said.append, interval_s=0.05)
    keeper.start()
    try:
        stopped = stoker("server", "stop", "-w", str(work))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        time.sleep(3)
    finally:
        keeper.stop()
        keeper.join(timeout=60)
    assert said == [] and server_pids(home(work)) == []


def test_two_concurrent_starts_make_one_server(work):
    starts = [subprocess.Popen([sys.executable, "-m", "stoker.cli", "server", "start", "-w",
                                str(work)], env=env(), stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    outputs = sorted(p.communicate(timeout=400)[0] for p in starts)
    assert [p.returncode for p in starts] == [0, 0]
    assert outputs[0].startswith("already running") and outputs[1].startswith("started"), outputs
    assert server_pids(home(work)) == [record(work)["pid"]]


def test_runs_start_the_server_once_and_reuse_it(work):
    """``stoker run`` starts the local server and leaves it up, with the MLflow run's flow-run
    link answering; ``stoker cost-guard`` then reuses it (same pid, no start, no temporary
    server) and its flow run is recorded there too."""
    run = stoker("run", f"work_dir={work}", "train.epochs=1",
                 "tracking.system_metrics_interval_s=null")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Local Prefect server started" in run.stderr
    server = record(work)
    assert LocalServer(home(work)).running()["pid"] == server["pid"]  # outlived the run
    done = json.loads(next((work / "jobs").glob("*/pipeline_done.json")).read_text())
    mlflow_run = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(done["run_id"])
    url = mlflow_run.data.tags["prefect.flow_run_url"]
    base = server["api_url"].removesuffix("/api")
    assert url.startswith(f"{base}/runs/flow-run/"), url  # as Prefect's "View at" line
    flow_run = httpx.get(f"{server['api_url']}/flow_runs/{url.rsplit('/', 1)[1]}", timeout=10)
    assert flow_run.json()["state"]["type"] == "COMPLETED"
    # The process tag names the flow run only: a tagged task run is checked against the tag
    # concurrency limits by a write to the server's database (2 s lost to a retry after a
    # "database is locked" at registration).
    assert any(t.startswith("stoker:process=") for t in flow_run.json()["tags"])
    task_runs = httpx.post(f"{server['api_url']}/task_runs/filter", json={
        "flow_runs": {"id": {"any_": [flow_run.json()["id"]]}}}, timeout=10).json()
    assert {t["name"].rsplit("-", 1)[0] for t in task_runs} >= {
        "pull-dataset", "train", "attempt", "register-model", "report"}
    assert [t["tags"] for t in task_runs] == [[]] * len(task_runs)

    guard = stoker("cost-guard", f"work_dir={work}", "policy.window_s=10",
                   "policy.sample_interval_s=5")
    assert guard.returncode == 0, guard.stderr[-3000:]
    assert "Local Prefect server reused" in guard.stderr
    assert "Starting temporary server" not in guard.stderr
    assert record(work) == server and server_pids(home(work)) == [server["pid"]]
    runs = httpx.post(f"{server['api_url']}/flow_runs/filter", json={}, timeout=10).json()
    assert [r["state"]["type"] for r in runs] == ["COMPLETED"] * 2


def test_another_uvicorn_of_the_same_home_is_no_prefect_server_and_is_left_alone(work,
                                                                                 tmp_path):
    """Trial: an `mlflow server` (its uvicorn) started from a shell that exports PREFECT_HOME
    was taken for a stale Prefect server of that home: `stoker run` stopped it, then failed
    ("no MLflow server answers")."""
    from mlflow_server import MlflowServer

    own_port(home(work))
    with MlflowServer(tmp_path / "mlflow",
                      env={"PREFECT_HOME": str(home(work).resolve())}) as mlflow:
        started = stoker("server", "start", "-w", str(work))
        assert started.returncode == 0, started.stdout + started.stderr
        assert mlflow.process.poll() is None
        assert httpx.get(f"{mlflow.uri}/health", timeout=10).status_code == 200
        assert server_pids(home(work)) == [record(work)["pid"]]


def test_a_prefect_background_server_of_the_same_home_is_adopted(work):
    """``prefect server start --background`` with this home's PREFECT_HOME: Stoker reuses it
    (and ``stoker server stop`` ends it) instead of starting a second server."""
    from mlflow_server import free_port

    prefect_home = home(work)
    port = free_port()
    subprocess.run([sys.executable, "-m", "prefect", "server", "start", "--background",
                    "--host", "127.0.0.1", "--port", str(port)], check=True, timeout=300,
                   env={**env(), "PREFECT_HOME": str(prefect_home.resolve())},
                   capture_output=True)
    prefect_pid = int((prefect_home / "server.pid").read_text())
    assert LocalServer(prefect_home)._wait_healthy({"pid": prefect_pid,
                                            "api_url": f"http://127.0.0.1:{port}/api"}, 300)
    start = stoker("server", "start", "-w", str(work))
    assert start.stdout.startswith(f"already running: http://127.0.0.1:{port}"), start.stdout
    assert record(work)["pid"] == prefect_pid
    assert server_pids(prefect_home) == [prefect_pid]
    assert f"stopped (pid {prefect_pid})" in stoker("server", "stop", "-w", str(work)).stdout


def test_the_start_line_leaves_out_the_database_preparation():
    """New-user trial: "started in 55 s" right after "Prefect database ready in 40 s" counted
    the one-time preparation twice; the start is the rest."""
    url = "http://127.0.0.1:4200/api"
    assert start_line(url, 55.04, 40.0) == (
        "Local Prefect server started in 15.0 s (after preparing its database, 40.0 s): UI at "
        "http://127.0.0.1:4200 (`stoker server stop` ends it)")
    assert start_line(url, 9.96).startswith("Local Prefect server started in 10.0 s: UI at ")
    assert start_line(url, None).startswith("Local Prefect server reused: UI at ")


def test_process_tags_name_dead_commands_only():
    """A flow run's ``stoker:process=`` tag is judged on this host only; a recycled pid (same
    number, later start) counts as gone; a garbled tag is left alone."""
    import socket

    from stoker.local_server import PROCESS_TAG, process_gone, process_tag

    assert process_gone([process_tag(), "other"]) is None  # this process lives
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    tag = process_tag(child.pid)
    child.wait()
    assert process_gone(["x", tag]) == child.pid
    host, pid, start = tag.removeprefix(PROCESS_TAG).split(":")
    recycled = f"{PROCESS_TAG}{host}:{os.getpid()}:{float(start) - 1000:.2f}"
    assert process_gone([recycled]) == os.getpid()
    assert process_gone([f"{PROCESS_TAG}elsewhere-{socket.gethostname()}:{pid}:{start}"]) is None
    assert process_gone([f"{PROCESS_TAG}{host}:notapid:{start}", f"{PROCESS_TAG}"]) is None
    assert process_gone([]) is None


def test_a_port_taken_at_the_bind_and_free_again_at_the_check_is_tried_again(tmp_path):
    """Parallel-suite finding: two homes started at once on port 4200; the loser's uvicorn
    could not bind, and by the time it looked, the winner had let the port go again (its test
    had stopped its server). A free port was read as "failed for another reason": the run
    failed. The log's bind error now says what happened, and the start is tried again."""
    import socket
    import threading

    from stoker.local_server import LOG, PORT_FILE, free_port

    home = seed_prefect_home(tmp_path / ".prefect")
    port = free_port()
    (home / PORT_FILE).write_text(f"{port}\n")
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    released = threading.Event()

    def release_once_refused() -> None:  # the other process lets the port go at once
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            log = home / LOG
            if log.exists() and b"address already in use" in log.read_bytes():
                holder.close()
                released.set()
                return
            time.sleep(0.01)

    threading.Thread(target=release_once_refused, daemon=True).start()
    try:
        # First start on the held port: _port() picks the sticky port only when it is free,
        # so point the first try at it.
        server = LocalServer(home, startup_timeout_s=180)
        server._port = lambda: port  # the port both homes saw free
        api_url, started = server.ensure()
        assert released.is_set(), "the first start never met the taken port"
        assert started and api_url == f"http://127.0.0.1:{port}/api"
    finally:
        holder.close()
        stop_local_servers(tmp_path)


def test_two_homes_racing_for_one_port_get_a_server_each(tmp_path):
    """Benchmark finding: two work folders starting their servers at once both saw the same
    port free; the loser's process failed to bind, but the winner answered on that port, so
    the loser's runs went to the other home's server and ended with ObjectNotFound once it was
    restarted on its own database. Each home now waits for a server of its own."""
    import threading

    from stoker.local_server import PORT_FILE, free_port

    homes = [tmp_path / f"home-{i}" / ".prefect" for i in range(2)]
    port = free_port()
    for home in homes:
        seed_prefect_home(home)
        (home / PORT_FILE).write_text(f"{port}\n")  # both prefer it, and it is free
    urls: dict[int, str] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: urls.__setitem__(
            i, LocalServer(homes[i], startup_timeout_s=180).ensure()[0])) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(400)
        assert len(urls) == 2 and urls[0] != urls[1], urls
        for home in homes:
            rec = json.loads((home / "server.json").read_text())
            assert rec["api_url"] in urls.values()
            listening = [c.laddr.port for c in psutil.Process(rec["pid"]).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN]
            assert rec["port"] in listening, (rec, listening)
    finally:
        stop_local_servers(tmp_path)


def test_a_start_that_does_not_answer_in_time_says_why(tmp_path):
    """New-user finding: a run failed with `did not answer within 120 s` and an empty
    server.log. The error now carries the last lines the server wrote in this start, or says
    it wrote nothing, and how much CPU it got while it was waited for (a loaded machine, or a
    start still at work)."""
    home = tmp_path / ".prefect"
    seed_prefect_home(home)
    own_port(home)
    server = LocalServer(home, startup_timeout_s=0.5)  # Prefect's app takes seconds to import
    try:
        with pytest.raises(ServerError) as caught:
            server.ensure()
    finally:
        stop_local_servers(tmp_path)
    message = str(caught.value)
    assert "did not answer within 0.5 s" in message and "\n" not in message
    assert re.search(r"(its last log lines: |it wrote nothing to server\.log)", message), message
    assert re.search(r"it used [\d.]+ CPU-s in 0\.5 s: ", message), message
    # The same home, given its time, starts: the failed start left nothing in the way.
    server = LocalServer(home, startup_timeout_s=180)
    try:
        assert server.ensure()[1]
    finally:
        stop_local_servers(tmp_path)


def test_a_server_that_exits_at_start_names_its_own_error(tmp_path):
    """A server that exits at start (here: a database path it cannot open) ends the start at
    once with the last lines of its own log, not only `exited; see server.log`."""
    home = tmp_path / ".prefect"
    home.mkdir()
    own_port(home)
    os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = \
        f"sqlite+aiosqlite:///{tmp_path / 'no-such-folder' / 'prefect.db'}"
    (home / STAMP).write_text(stamp())  # said to be prepared: the server meets the bad path
    try:
        with pytest.raises(ServerError) as caught:
            LocalServer(home, startup_timeout_s=180).ensure()
    finally:
        del os.environ["PREFECT_API_DATABASE_CONNECTION_URL"]
        stop_local_servers(tmp_path)
    message = str(caught.value)
    assert "exited; its last log lines: " in message and "\n" not in message, message


def test_a_database_that_cannot_be_prepared_fails_before_any_server_starts(tmp_path):
    """The same bad database path, not prepared yet: the preparation fails with its own last
    log lines, in one line, and no server process was started."""
    home = tmp_path / ".prefect"
    home.mkdir()
    os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = \
        f"sqlite+aiosqlite:///{tmp_path / 'no-such-folder' / 'prefect.db'}"
    try:
        with pytest.raises(ServerError) as caught:
            LocalServer(home, startup_timeout_s=180).ensure()
    finally:
        del os.environ["PREFECT_API_DATABASE_CONNECTION_URL"]
    message = str(caught.value)
    assert message.startswith("preparing the Prefect database failed (exit 1); its last log "
                              "lines: ") and "\n" not in message, message
    assert "unable to open database file" in message, message
    assert not (home / "server.json").exists() and server_pids(home) == []
    assert not (home / STAMP).exists()
