"""A job's own budget (issue 48): ``train.max_cost_usd`` stops a real job with a committed
checkpoint within one progress interval of the limit, a spent budget launches nothing, and a
higher budget resumes the job from that checkpoint (the pipeline flow on a Prefect server)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from local_servers import embedded_env
from mlflow import MlflowClient

from stoker.config import load_pipeline_config
from stoker.jobs.attempts import AttemptLog, committed_step
from stoker.jobs.budget import Spend, job_spend, over_budget
from stoker.jobs.stop_request import TrainingStopped
from stoker.runtime.progress import read_events
from stoker.runtime.spec import RunSpec
from stoker.stopping import stopped_exit_code
from stoker.tracking.pricing import PriceTable

# On CPU the `cpu` row applies (0 by default): $36 per device-hour is $0.01 per device-second,
# so with 2 CPU workers a second of the job costs $0.02.
PRICES = {"usd_per_gpu_hour": {"cpu": {"on_demand": 36.0, "spot": 12.0, "reserved": 14.4},
                               "default": {"on_demand": 2.0, "spot": 0.8, "reserved": 0.8}}}
INTERVAL_S = 5.0  # the budget watcher's progress interval (BudgetWatcher.every_s)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def _config(tmp_path, max_cost_usd: float):
    config_file = tmp_path / "budget.yaml"
    config_file.write_text(yaml.safe_dump({"cost": {"prices": PRICES}}))
    return load_pipeline_config(config_file, overrides(tmp_path, max_cost_usd))


def overrides(tmp_path, max_cost_usd: float) -> list[str]:
    return [f"work_dir={tmp_path / 'work'}", "job_id=budgeted", "train.epochs=1000",
            "train.nproc_per_node=2", "train.checkpoint_every_steps=1000000",
            f"train.max_cost_usd={max_cost_usd}", "tracking.system_metrics_interval_s=null"]


def _spent(job_dir) -> float:
    return job_spend(AttemptLog(job_dir).records(), 0.0, 2, "cpu",
                     PriceTable(**PRICES)).cost_usd


@pytest.mark.integration
def test_a_job_stops_at_its_budget_with_a_checkpoint_and_resumes_with_a_higher_one(
        harness, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline
    from stoker.jobs.job import check_job_early

    config = _config(tmp_path, 0.6)
    with pytest.raises(TrainingStopped) as stopped:
        pipeline(config)
    assert stopped_exit_code(stopped.value) == 5, stopped.value
    assert "max_cost_usd $0.6 reached" in str(stopped.value)
    job = tmp_path / "work" / "jobs" / "budgeted"
    [attempt] = AttemptLog(job).history()
    assert attempt["outcome"] == "stopped" and attempt["stopped_by"].startswith("budget: ")
    # At the budget, within one progress interval ($0.02/s x 5 s), with a committed checkpoint
    # (only the stop can have saved one: periodic checkpoints are off).
    assert 0.6 - 2 * 0.02 * INTERVAL_S <= _spent(job) <= 0.6 + 0.02 * INTERVAL_S, _spent(job)
    checkpoints = RunSpec.load(job / "spec.yaml").checkpoint_location
    first_stop = committed_step(checkpoints)
    assert first_stop > 0
    run = MlflowClient(config.tracking_uri()).get_run((job / "mlflow_run_id").read_text())
    assert run.data.tags["stoker.stopped_by"].startswith("budget: max_cost_usd")
    # Its cost so far is on the run, for `stoker cost`, and equals what the budget counted.
    assert run.data.metrics["cost_usd"] == pytest.approx(_spent(job), abs=1e-4)
    assert run.data.metrics["usd_per_hour"] == pytest.approx(2 * 36.0)
    with get_client(sync_client=True) as client:
        tasks = {t.name: t.state for t in client.read_task_runs()}
        [flow_run] = client.read_flow_runs()
    assert tasks["attempt-1"].name == "StoppedByBudget"
    assert flow_run.state.type.value == "CANCELLED" and "budget" in flow_run.state.message

    # A budget spent already: one line before anything is pulled or launched, and the real
    # `stoker run` exits 5 with it.
    with pytest.raises(TrainingStopped) as refused:
        check_job_early(_config(tmp_path, 0.3))
    assert stopped_exit_code(refused.value) == 5
    assert "nothing launched" in str(refused.value) and "\n" not in str(refused.value)
    command = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", "-c", str(tmp_path / "budget.yaml"),
         *overrides(tmp_path, 0.3)], capture_output=True, text=True, timeout=300,
        env=embedded_env(tmp_path / "work"))
    assert command.returncode == 5, command.stdout[-2000:] + command.stderr[-2000:]
    last = command.stderr.strip().splitlines()[-1]
    assert "max_cost_usd $0.3 reached" in last and "nothing launched" in last, last
    assert len(AttemptLog(job).records()) == 1  # nothing launched

    # A higher budget resumes the job from its stop checkpoint, and stops it at the new one.
    with pytest.raises(TrainingStopped):
        pipeline(_config(tmp_path, 1.2))
    starts = [e for e in read_events(job) if e["event"] == "start"]
    assert starts[-1]["step"] == first_stop
    assert committed_step(checkpoints) > first_stop
    assert 1.2 - 2 * 0.02 * INTERVAL_S <= _spent(job) <= 1.2 + 0.02 * INTERVAL_S


def test_a_limit_one_interval_away_counts_as_reached():
    spend = Spend(cost_usd=0.9, billed_s=100.0, usd_per_s=0.02)
    assert over_budget(spend, 1.0, None, lookahead_s=4.0) is None
    assert "max_cost_usd $1 reached" in over_budget(spend, 1.0, None, lookahead_s=5.0)
    assert "max_duration 104 s reached" in over_budget(spend, None, 104.0, lookahead_s=4.0)
    assert over_budget(spend, None, None, lookahead_s=1e9) is None


def test_spend_counts_closed_attempts_and_the_open_one_up_to_now():
    prices = PriceTable(**PRICES)
    records = [{"number": 1, "state": "ended", "duration_s": 100.0, "capacity_type": "spot"},
               {"number": 2, "state": "started", "started": 1000.0,
                "capacity_type": "on_demand"}]
    spend = job_spend(records, 1050.0, 2, "cpu", prices)
    assert spend.billed_s == 150.0
    assert spend.cost_usd == pytest.approx(100 * 2 * 12 / 3600 + 50 * 2 * 36 / 3600)
    assert spend.usd_per_s == pytest.approx(2 * 36 / 3600)


def test_the_budget_prices_the_job_from_the_ranks_start_before_mlflow_has_its_run(tmp_path):
    """The tracking store has not opened the run (a new-user trial: 20-28 s on a loaded
    machine, the spend read $0.0000 meanwhile and the job overshot $0.3 to $0.64): rank 0's
    start event names the device, so the spend is priced and the budget stops the job; before
    that event the line says the spend is not priced yet, not $0."""
    import json
    import time

    from stoker.jobs.budget import BudgetWatcher, read_spend

    job = tmp_path / "job"
    job.mkdir()
    AttemptLog(job).start(1, "on_demand")
    said, stops = [], []
    watcher = BudgetWatcher(job, 0.3, None, PriceTable(**PRICES), 2, gpu_model=lambda: None,
                            say=said.append, stop=lambda *a, **k: stops.append(a))
    records = AttemptLog(job).records()
    records[-1]["started"] = time.time() - 20  # 20 s of 2 priced CPUs: $0.40
    (job / "attempts.jsonl").write_text(json.dumps(records[-1]) + "\n")
    watcher.check()
    assert said[-1].startswith("budget: spent: not priced yet of $0.3"), said
    assert not stops and read_spend(job)["gpu_model"] is None
    (job / "progress.jsonl").write_text(json.dumps(
        {"event": "start", "step": 0, "time": time.time(), "gpu_model": "cpu"}) + "\n")
    watcher.check()
    assert read_spend(job)["gpu_model"] == "cpu" and read_spend(job)["cost_usd"] >= 0.39
    assert stops and "max_cost_usd $0.3 reached" in watcher.fired, said


def test_stoker_status_shows_spend_against_budget(tmp_path):
    from typer.testing import CliRunner

    from stoker.cli import app
    from stoker.jobs.budget import write_spend

    job = tmp_path / "jobs" / "budgeted"
    job.mkdir(parents=True)
    write_spend(job, Spend(0.42, 310.0, 0.02), "cpu", 2, 1.0, 3600.0)
    result = CliRunner().invoke(app, ["status", "budgeted", "--work-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.stdout.splitlines() if x.startswith("budget")]
    assert line.startswith("budget     spent $0.4200 of $1 (42%); billed 310 s of 3600 s (9%)")


@pytest.mark.parametrize("entrypoint", ["flows/pipeline.py:pipeline_local",
                                        "flows/train.py:train_local",
                                        "flows/pipeline.py:pipeline_slurm"])
def test_the_deployment_forms_take_the_budget_and_name_a_bad_one(entrypoint):
    """The Prefect forms had no budget fields (issue 48): `train.max_cost_usd` and
    `train.max_duration` (seconds or 90m / 12h / 2d) reach the config the flow runs with, and a
    bad value fails the parameters' validation naming the field, before the run starts."""
    from pathlib import Path

    from prefect.exceptions import ParameterTypeError
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(str(Path(__file__).resolve().parents[1] / entrypoint))
    extra = {"tracking": {"tracking_uri": "http://127.0.0.1:5000"}} if "slurm" in entrypoint \
        else {}
    form = flow.validate_parameters({"config": {
        **extra, "train": {"max_cost_usd": 2.5, "max_duration": "90m"}}})["config"]
    config = form.to_config()
    assert config.train.max_cost_usd == 2.5 and config.train.max_duration == 5400.0
    with pytest.raises(ParameterTypeError, match="max_cost_usd"):
        flow.validate_parameters({"config": {**extra, "train": {"max_cost_usd": -1}}})
    with pytest.raises(ParameterTypeError, match="train.max_duration: expected seconds"):
        flow.validate_parameters({"config": {**extra, "train": {"max_duration": "soon"}}})


def test_one_price_given_as_an_override_keeps_the_rest_of_the_table(tmp_path):
    """``cost.prices.usd_per_gpu_hour.cpu.on_demand=36`` prices a CPU job (trial: "usd_per_gpu_hour
    needs a 'default' entry": the override replaced the whole table); a new row comes before the
    built-in ones it contains; a new row without every capacity type is one line naming it."""
    config = load_pipeline_config(None, [f"work_dir={tmp_path}",
                                         "cost.prices.usd_per_gpu_hour.cpu.on_demand=36"])
    prices = config.cost.prices
    assert prices.price("cpu", "on_demand") == 36.0 and prices.price("cpu", "spot") == 0.0
    assert prices.price("NVIDIA H100 80GB HBM3", "spot") == 1.70
    assert prices.price("something else", "on_demand") == 2.00  # the built-in default row
    table = PriceTable(usd_per_gpu_hour={"H100 NVL": {"on_demand": 9, "spot": 3, "reserved": 4}})
    assert table.price("NVIDIA H100 NVL", "on_demand") == 9
    with pytest.raises(Exception, match=r"usd_per_gpu_hour.MI300 needs a price for spot, "
                                        r"reserved"):
        load_pipeline_config(None, [f"work_dir={tmp_path}",
                                    "cost.prices.usd_per_gpu_hour.MI300.on_demand=3"])
