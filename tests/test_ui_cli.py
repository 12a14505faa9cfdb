"""``stoker ui``: the MLflow UI of a work folder's store answers, and one SIGTERM ends it all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]),
       "MLFLOW_DISABLE_TELEMETRY": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _store(work: Path) -> None:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{work / 'mlflow.db'}")
    mlflow.MlflowClient().create_experiment("ui-check")


def test_stoker_ui_answers_and_one_sigterm_ends_it_and_its_workers(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _store(work)
    port = _free_port()
    ui = subprocess.Popen([str(BIN / "stoker"), "ui", "--work-dir", "work", "--port", str(port)],
                          cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    body, tree = None, []
    try:
        deadline = time.monotonic() + 180
        while body is None and time.monotonic() < deadline:
            assert ui.poll() is None, ui.stdout.read()[-3000:]
            try:
                url = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=5"
                with urllib.request.urlopen(url, timeout=10) as response:
                    body = response.read().decode()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        tree = psutil.Process(ui.pid).children(recursive=True)
        ui.send_signal(signal.SIGTERM)
        code = ui.wait(60)
    finally:
        if ui.poll() is None:
            ui.kill()
    assert body is not None and "ui-check" in body
    said = ui.stdout.read()
    assert "DeprecationWarning" not in said, said  # MLflow's import of Starlette's WSGI
    # No MLflow job runner or huey consumers beside the UI (8 processes importing MLflow).
    jobs = [p for p in tree if "huey" in " ".join(_cmdline(p)) or "_job_runner" in
            " ".join(_cmdline(p))]
    assert jobs == [], [_cmdline(p) for p in jobs]
    assert code == 128 + signal.SIGTERM
    _gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left running after SIGTERM: {[p.pid for p in alive]}"


def test_stoker_ui_without_a_store_or_on_a_taken_port_is_one_line_exit_2(tmp_path):
    missing = subprocess.run([str(BIN / "stoker"), "ui", "--work-dir", "nowhere"], cwd=tmp_path,
                             env=ENV, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "no MLflow store at nowhere" in \
        missing.stderr
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "work").mkdir()
    _store(tmp_path / "work")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([str(BIN / "stoker"), "ui", "--port", str(port)], cwd=tmp_path,
                              env=ENV, capture_output=True, text=True, timeout=120)
    assert busy.returncode == 2 and f"--port {port}" in busy.stderr
    assert busy.stderr.strip().count("\n") == 0
