"""Flow run heartbeats on the local Prefect server: off unless the user sets them (their only
reader is an automation the local server does not have, and the flow's end waited up to 1 s
for the heartbeat thread's sleep); a real server is asked which events a flow run sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from local_servers import stop_local_servers
from prefect_server import seed_prefect_home

from stoker.local_server import PORT_FILE, free_port

pytestmark = pytest.mark.integration

SCRIPT = """
import json, sys, time
from pathlib import Path
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from stoker.server_cli import prefect_api

@flow
def tiny() -> str:
    return flow_run.get_id()

with prefect_api(Path(sys.argv[1])):  # as stoker run does
    run_id = tiny()
    deadline, names = time.monotonic() + 60, set()
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            names = {e["event"] for e in client.request("POST", "/events/filter", json={
                "filter": {"event": {"prefix": ["prefect.flow-run."]},
                           "any_resource": {"id": [f"prefect.flow-run.{run_id}"]}},
                "limit": 50}).json()["events"]}
        # events are stored asynchronously: the run's end and any heartbeat sent before it
        if "prefect.flow-run.Completed" in names and (
                "prefect.flow-run.heartbeat" in names or time.monotonic() > deadline - 50):
            break
        time.sleep(0.5)
print(json.dumps(sorted(names)))
"""


@pytest.mark.parametrize("user_setting", [None, "30"])
def test_the_local_server_gets_no_flow_heartbeats_unless_the_user_sets_them(tmp_path,
                                                                            user_setting):
    home = seed_prefect_home(tmp_path / "prefect")
    (home / PORT_FILE).write_text(str(free_port()))  # not 4200: other tests' servers use it
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY",
                        "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")}
    if user_setting is not None:
        env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = user_setting
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path / "output.log")],
            env=env | {"PREFECT_HOME": str(home),
                       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"},
            capture_output=True, text=True, timeout=400)
    finally:
        stop_local_servers(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    names = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "prefect.flow-run.Completed" in names, names
    assert ("prefect.flow-run.heartbeat" in names) == (user_setting is not None), names
