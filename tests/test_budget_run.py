"""A job's budget through ``stoker run`` as a user runs it (issue 48.2): a subprocess on a real
Prefect server, torchrun, MLflow sqlite. A tiny ``train.max_cost_usd`` stops the job with exit
code 5, one line, and a committed checkpoint; the same command with a higher budget resumes
from that checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import events
from mlflow import MlflowClient
from prefect_server import PrefectServer

from stoker.jobs.attempts import AttemptLog, committed_step
from stoker.launch.local import terminate_tree
from stoker.runtime.spec import RunSpec

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
# On CPU the price table's `cpu` row applies (0 by default): $36 per device-hour is $0.01 per
# second for the one worker, so $0.15 is some 15 s of billed time.
PRICES = {"usd_per_gpu_hour": {"cpu": {"on_demand": 36.0, "spot": 12.0, "reserved": 14.4},
                               "default": {"on_demand": 2.0, "spot": 0.8, "reserved": 0.8}}}
RESUME = "raise train.max_cost_usd / train.max_duration and run the same command to resume it"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-budget")) as running:
        yield running


def stoker_run(server: PrefectServer, tmp_path: Path, max_cost_usd: float) -> tuple[int, str]:
    """``stoker run`` of the job ``budget-cli`` with budget ``max_cost_usd``: its exit code and
    output (stdout + stderr)."""
    config = tmp_path / "prices.yaml"
    config.write_text(yaml.safe_dump({"cost": {"prices": PRICES}}))
    # Periodic checkpoints off: only the budget's stop can commit one. 1000 epochs: the
    # budget, not the end of training, stops it.
    command = [sys.executable, "-m", "stoker.cli", "run", "--config", str(config),
               f"work_dir={tmp_path / 'work'}", "job_id=budget-cli", "train.epochs=1000",
               "train.nproc_per_node=1", "train.checkpoint_every_steps=1000000",
               "tracking.system_metrics_interval_s=null", f"train.max_cost_usd={max_cost_usd}"]
    process = subprocess.Popen(command, env={**server.env, "PYTHONPATH": str(REPO)}, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            terminate_tree(process.pid, grace_s=5)
    return process.returncode, out + err


def _seconds_between(output: str, first: str, then: str) -> float:
    """Seconds from the log line holding ``first`` to the next one holding ``then`` (Prefect's
    ``HH:MM:SS.mmm | LEVEL | ...`` console lines)."""
    def stamp(text: str) -> float:
        line = next(x for x in output.splitlines() if text in x and re.match(r"\d\d:", x))
        hours, minutes, seconds = line.split(" | ", 1)[0].split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)

    return (stamp(then) - stamp(first)) % 86400


def test_stoker_run_exits_5_at_its_budget_and_resumes_with_a_higher_one(server, tmp_path):
    code, output = stoker_run(server, tmp_path, 0.15)
    assert code == 5, output[-3000:]
    last = output.rstrip().splitlines()[-1]  # the command's own last line says it, once
    assert last.startswith("stoker run: job budget-cli stopped by budget: max_cost_usd $0.15 "
                           "reached: spent $"), output[-3000:]
    assert last.endswith(RESUME), output[-3000:]
    assert [x for x in output.splitlines() if x.startswith("stoker run:")] == [last]
    assert "Traceback" not in output, output[-3000:]
    # The flow ends as soon as the attempt has (trial: 10 s later, the budget watcher's join
    # waiting out stoker stop's wait for a job whose lease this very flow held).
    assert _seconds_between(output, "attempt 1 ended: stopped", "Finished in state Cancelled(") \
        < 5, output[-3000:]
    job = tmp_path / "work" / "jobs" / "budget-cli"
    [attempt] = AttemptLog(job).history()
    assert attempt["outcome"] == "stopped" and attempt["stopped_by"].startswith("budget: ")
    first_stop = committed_step(RunSpec.load(job / "spec.yaml").checkpoint_location)
    assert first_stop > 0  # the stop checkpoint (periodic ones are off)
    client = MlflowClient(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    run = client.get_run((job / "mlflow_run_id").read_text().strip())
    assert run.info.status == "KILLED"
    assert run.data.tags["stoker.stopped_by"].startswith("budget: max_cost_usd $0.15 reached")

    # The same command with a higher budget resumes from the stop checkpoint (and stops at it).
    code, output = stoker_run(server, tmp_path, 0.3)
    assert code == 5, output[-3000:]
    assert "max_cost_usd $0.3 reached" in output.rstrip().splitlines()[-1], output[-3000:]
    # Said in words that it resumes the stopped job, and from where (trial: "attempt 2" only).
    assert (f"job budget-cli: resuming a stopped job as attempt 2 from its checkpoint of step "
            f"{first_stop}/") in output, output[-3000:]
    starts = [e for e in events(job) if e["event"] == "start"]
    assert len(starts) == 2 and starts[-1]["resumed"] and starts[-1]["step"] == first_stop
    assert committed_step(RunSpec.load(job / "spec.yaml").checkpoint_location) > first_stop
