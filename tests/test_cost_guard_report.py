# ruff: noqa: F811 - the fixtures imported from test_cost_guard_actions are parameters here
"""Operator clarity (issue 16, input 7): full names, thresholds as given, foreign processes in
"held by", a stop timeout worded as such, no trailing blanks."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from fake_nvml import Gpu
from test_cost_guard_actions import busybox_image, docker_client  # noqa: F401 - fixtures
from test_cost_guard_decide import Clock, container, make_config, write_heartbeat
from test_cost_guard_inputs import sweep_many

from stoker.costguard.actions import DockerActor
from stoker.costguard.inventory import Resource
from stoker.costguard.report import log_line, render_markdown
from stoker.ownership import DOCKER_OWNER_LABEL

LONG = "stoker-a-rather-long-job-name-from-the-config-n1-3f2a9c"  # node suffix past 40 chars


def named_container(name: str, **kwargs):
    def make(call, clock):
        from dataclasses import replace

        return replace(container(**kwargs)(call, clock), name=name)
    return make


def test_report_names_in_full_and_thresholds_as_configured(tmp_path):
    config = make_config(tmp_path, idle_timeout_s=0.001, idle_utilization_percent=0.5,
                         min_idle_s=120.5)
    clock = Clock()
    write_heartbeat(tmp_path / "jobs" / "j", clock.now - 60)
    report, _ = sweep_many(tmp_path, [[Gpu()]], [named_container(
        LONG, job_dir=tmp_path / "jobs" / "j")], config=config, clock=clock)
    markdown = render_markdown(report)
    assert f"container `{LONG}`" in markdown
    (row,) = report.resources
    reasons = " ".join(row.decision.reasons)
    assert "idle_timeout_s 0.001" in reasons and "utilization <= 0.5%" in reasons
    assert "waiting for min_idle_s 120.5" in reasons
    assert row.action == "idle, not yet for min_idle_s 120.5"


def test_held_by_names_foreign_processes_and_log_lines_have_no_trailing_blank(tmp_path):
    frames = [[Gpu(index=0, utilization=40, memory_used_mib=2000,
                   processes=[(os.getpid(), 2000)]), Gpu(index=1)]]
    report, _ = sweep_many(tmp_path, frames, [named_container(LONG, devices=("1",))])
    gpu0, gpu1 = report.gpus
    assert gpu0.action.startswith("held by process ") and f"{os.getpid()} (" in gpu0.action
    assert gpu1.action == f"held by container {LONG}"
    busy = log_line(gpu0)
    assert busy == busy.rstrip() and busy.endswith(gpu0.action)
    for row in (*report.gpus, *report.resources):
        assert log_line(row) == log_line(row).rstrip()
    (row,) = report.resources
    assert log_line(row).startswith(f"container {LONG}: idle (")


def test_stop_timeout_kill_is_worded_as_such(docker_client, busybox_image):
    """A container that ignores SIGTERM is killed after stop_timeout_s: exit 137, but not OOM."""
    name = f"costguard-stubborn-{uuid.uuid4().hex[:8]}"
    stubborn = docker_client.containers.run(
        busybox_image, ["sh", "-c", "trap '' TERM; echo ready; while true; do sleep 0.1; done"],
        name=name, labels={DOCKER_OWNER_LABEL: "true"}, network_mode="none", detach=True)
    try:
        deadline = time.monotonic() + 30
        while b"ready" not in stubborn.logs():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        result = DockerActor(docker_client, stop_timeout_s=1).act(Resource(
            kind="container", id=stubborn.id, name=name, devices=None, pids=frozenset(),
            started_at=None))
        assert result.status == "stopped"
        assert "did not exit within stop_timeout_s 1 after SIGTERM" in result.detail
        assert "SIGKILL (exit 137 after stop timeout)" in result.detail
    finally:
        stubborn.remove(force=True)


@pytest.mark.parametrize("state", [{"ExitCode": 0}, {"ExitCode": 137, "OOMKilled": True}])
def test_stop_outcome_wording(state):
    from stoker.costguard.actions import stop_outcome

    text = stop_outcome("c", state, 60)
    assert ("SIGTERM (exit 0)" in text) if state["ExitCode"] == 0 else ("memory" in text)


def test_plain_cli_sweep_prints_the_report_without_prefect(tmp_path, monkeypatch):
    import sys

    from fake_nvml import FakeNvml
    from typer.testing import CliRunner

    from stoker.cli import app

    monkeypatch.setitem(sys.modules, "fake_nvml_cli", FakeNvml([[Gpu(index=0)]]))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9")  # would fail if Prefect ran
    result = CliRunner().invoke(app, [
        "cost-guard", "--plain", f"work_dir={tmp_path}", "nvml_module=fake_nvml_cli",
        "docker.enabled=false", "policy.window_s=0.2", "policy.sample_interval_s=0.1"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("# Stoker cost guard")
    assert "**dry run**" in result.output and "`GPU-fake-0000`" in result.output
    assert all(line == line.rstrip() for line in result.output.splitlines())



def test_guard_without_prefect_sweeps_without_a_server(tmp_path):
    """Issue 46: ``prefect.enabled=false`` still started a long-lived local Prefect server.
    The real ``stoker cost-guard`` process, with an API URL on a closed port standing for "no
    server" (any Prefect call would fail on it) and a fake NVML module (no GPU here)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    (tmp_path / "fake_nvml_cli.py").write_text(
        "import sys\nfrom fake_nvml import FakeNvml, Gpu\n"
        "sys.modules[__name__] = FakeNvml([[Gpu(index=0)]])\n")
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), str(tmp_path)])}
    started = time.monotonic()
    result = subprocess.run(
        [str(Path(sys.executable).parent / "stoker"), "cost-guard", f"work_dir={tmp_path}",
         "nvml_module=fake_nvml_cli", "prefect.enabled=false", "docker.enabled=false",
         "policy.window_s=0.2", "policy.sample_interval_s=0.1"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    assert answer["dry_run"] is True and [g["gpu"] for g in answer["gpus"]] == ["GPU-fake-0000"]
    assert "127.0.0.1:9" not in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - started < 120  # generous: a 2-core machine shared by many
