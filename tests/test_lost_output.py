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


def run_with_its_reader_gone(script: str) -> int:
    """Run ``python -c script`` with stdout and stderr on pipes that are closed before it reads
    a line from stdin (its cue to write): its exit code."""
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    process.stdout.close()
    process.stderr.close()
    process.stdin.write(b"go\n")
    process.stdin.close()
    return process.wait(timeout=120)

def test_guarded_stream_moves_to_its_file_when_the_pipe_breaks(tmp_path):
    script = ("import sys, time; from pathlib import Path; from stoker.stdio import guard_stdio;"
              f"guard_stdio(Path({str(tmp_path / 'out.log')!r}));"
              "sys.stdin.readline();"
              "[print('line', i, flush=True) for i in range(3)];"
              "print('to stderr', file=sys.stderr)")
    assert run_with_its_reader_gone(script) == 0
    assert (tmp_path / "out.log").read_text() == "line 0\nline 1\nline 2\nto stderr\n"


def test_prefect_log_lines_after_the_pipe_broke_go_to_the_file_and_stop_no_thread(tmp_path):
    """Prefect's console handler is made at import, on the raw stderr, and prints through rich,
    which answers a broken pipe with ``SystemExit(1)``: after a worker was SIGKILLed, the first
    Prefect log line of the ``train`` task's progress thread ended that thread and its lines
    stopped (trial). After ``guard_stdio`` the handler writes through the guard: a line logged
    from a thread and from the main thread after the reader left lands in the file, and the
    process goes on."""
    script = "\n".join([
        "import logging, sys, threading",
        "from pathlib import Path",
        "import prefect.main  # noqa: F401 - configures Prefect's console handler",
        "from stoker.stdio import guard_stdio",
        f"guard_stdio(Path({str(tmp_path / 'out.log')!r}))",
        "log = logging.getLogger('probe')  # printed by the root logger's Prefect handler",
        "sys.stdin.readline()",
        "done = []",
        "thread = threading.Thread(target=lambda: (log.warning('from a thread'), done.append(1)))",
        "thread.start(); thread.join()",
        "log.warning('from the main thread')",
        "print('thread done' if done else 'thread died', flush=True)",
    ])
    code = run_with_its_reader_gone(script)
    out = (tmp_path / "out.log").read_text() if (tmp_path / "out.log").exists() else ""
    assert code == 0, out
    assert "from a thread" in out and "from the main thread" in out, out
    assert out.endswith("thread done\n"), out


def test_a_line_another_thread_left_unended_is_ended_before_the_next_write(tmp_path):
    """Prefect's API log handler writes its error without a newline, from its own thread; the
    next log line (another thread) started on the same line. Pieces of one thread's line stay
    together."""
    import io

    from stoker.stdio import GuardedStream

    raw = io.StringIO()
    stream = GuardedStream(raw, tmp_path / "out.log")

    def api_log_worker() -> None:
        stream.write("--- Error logging to API ---\n")
        stream.write("All connection attempts failed")

    worker = threading.Thread(target=api_log_worker)
    worker.start()
    worker.join()
    stream.write("00:10:38.181 | INFO    | Flow run 'x' - next line\n")
    stream.write("partial ")
    stream.write("and its end\n")
    assert raw.getvalue().splitlines() == [
        "--- Error logging to API ---", "All connection attempts failed",
        "00:10:38.181 | INFO    | Flow run 'x' - next line", "partial and its end"]
