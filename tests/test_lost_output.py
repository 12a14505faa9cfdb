"""Losing stdout/stderr (the worker that reads them died) never fails a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from local_servers import embedded_env
from mlflow import MlflowClient

pytestmark = pytest.mark.integration


def test_a_closed_output_pipe_does_not_fail_training_or_registration(tmp_path):
    """``stoker run`` with stdout and stderr on a pipe whose reader goes away mid-training, as
    when the process worker that started the flow run is SIGKILLed: the run still finishes,
    registers its model and marks the job done; the rest of the output lands in the log file."""
    work = tmp_path / "work"
    env = embedded_env(work)
    process = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", "run", f"work_dir={work}", "train.epochs=3",
         "tracking.system_metrics_interval_s=null"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[bytes] = []
    started = threading.Event()

    def read_until_training() -> None:
        for line in process.stdout:
            seen.append(line)
            if b"Task run 'attempt-1'" in line and b"[rank0]" in line:
                started.set()
                return

    reader = threading.Thread(target=read_until_training, daemon=True)
    reader.start()
    try:
        assert started.wait(timeout=300), b"".join(seen[-40:]).decode(errors="replace")
        process.stdout.close()  # the reader is gone: every later write hits a broken pipe
        code = process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    log = (work / "logs" / "output.log")
    detail = log.read_text()[-3000:] if log.exists() else "(no output.log)"
    assert code == 0, detail
    done = json.loads(next((work / "jobs").glob("*/pipeline_done.json")).read_text())
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    assert client.get_run(done["run_id"]).info.status == "FINISHED"
    assert client.get_model_version("stoker-digits", "1").run_id == done["run_id"]
    # What was written after the reader left is in the log file, the final summary included
    # (MLflow's own "Successfully registered model" no longer reaches stderr at all).
    assert f'"run_id": "{done["run_id"]}"' in log.read_text()


def test_guarded_stream_moves_to_its_file_when_the_pipe_breaks(tmp_path):
    script = ("import sys, time; from pathlib import Path; from stoker.stdio import guard_stdio;"
              f"guard_stdio(Path({str(tmp_path / 'out.log')!r}));"
              "sys.stdin.readline();"
              "[print('line', i, flush=True) for i in range(3)];"
              "print('to stderr', file=sys.stderr)")
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    process.stdout.close()
    process.stderr.close()
    process.stdin.write(b"go\n")
    process.stdin.close()
    assert process.wait(timeout=60) == 0
    assert (tmp_path / "out.log").read_text() == "line 0\nline 1\nline 2\nto stderr\n"
