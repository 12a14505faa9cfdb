"""A local Prefect server killed (``kill -9``) while a command uses it is started again, and the
command says so in one line of its own on stderr, whatever the main thread is doing then: on a
real server, with the real keeper (stoker.server_cli.prefect_api)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from local_servers import stop_local_servers
from prefect_server import seed_prefect_home

from stoker.local_server import PORT_FILE, free_port

pytestmark = pytest.mark.integration

# What the main thread does while the server dies (issue 45 trial: the line was missing when
# the server died during the dataset pull).
MAIN_THREAD = {
    # MLflow's store creation and model registration run under quiet_mlflow, which points
    # sys.stderr at a StringIO: the keeper's line went there and was dropped.
    "quiet_mlflow": "from stoker.runtime.tracking import quiet_mlflow\nbusy = quiet_mlflow()",
    # Prefect's API log handler writes its error without ending the line: the keeper's line
    # was glued to `All connection attempts failed`.
    "unended_line": ("import contextlib\nsys.stderr.write('--- Error logging to API ---\\n"
                     "All connection attempts failed')\nbusy = contextlib.nullcontext()"),
}

SCRIPT = """
import json, sys, time
from pathlib import Path
import psutil
from stoker.local_server import LocalServer
from stoker.server_cli import prefect_api
from stoker.stdio import guard_stdio

guard_stdio(Path(sys.argv[1]))  # as stoker run does
home = Path(sys.argv[2])
with prefect_api(Path(sys.argv[1])):  # as stoker run does
    dead = json.loads((home / "server.json").read_text())["pid"]
{busy}
    with busy:
        psutil.Process(dead).kill()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            record = LocalServer(home).running()
            if record is not None and record["pid"] != dead:
                break
            time.sleep(0.2)
        time.sleep(2)  # the keeper speaks once its health check passed
"""


@pytest.mark.parametrize("doing", sorted(MAIN_THREAD))
def test_a_server_restart_is_said_in_a_line_of_its_own(tmp_path, doing):
    home = seed_prefect_home(tmp_path / "prefect")
    (home / PORT_FILE).write_text(str(free_port()))  # not 4200: other tests' servers use it
    busy = "\n".join(f"    {line}" for line in MAIN_THREAD[doing].splitlines())
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(busy=busy), str(tmp_path / "output.log"),
             str(home)], env=env | {"PREFECT_HOME": str(home),
                                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"},
            capture_output=True, text=True, timeout=400)
    finally:
        stop_local_servers(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.findall(r"^\d\d:\d\d:\d\d\.\d{3} \| WARNING \| stoker - the local Prefect server "
                      r"died: (?:starting it again|started again at http://127\.0\.0\.1:\d+)$",
                      done.stderr, re.M)
    # the death as soon as it is found (the trial saw it 11-16 s late), then the restart's end
    assert len(said) == 2 and said[0].endswith("starting it again"), done.stderr[-3000:]
    # and in the work folder's log (the fallback of the guarded output: the reader was there)
    assert [line.split(" | ", 1)[1] for line in (tmp_path / "output.log").read_text().splitlines()
            ] == [line.split(" | ", 1)[1] for line in said]
