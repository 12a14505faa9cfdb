"""``stoker cost`` (issue 48): spend per job and per model over a period, read back from the
real MLflow store that three finished jobs logged to (the pipeline flow on a Prefect server)."""

from __future__ import annotations

import csv
import io
import json
import time

import pytest
import yaml
from mlflow import MlflowClient
from typer.testing import CliRunner

from stoker.cli import app
from stoker.config import load_pipeline_config
from stoker.cost_cli import parse_when

# On CPU the price table's `cpu` row applies (0 by default): priced here so that the jobs cost.
PRICES = {"usd_per_gpu_hour": {"cpu": {"on_demand": 36.0, "spot": 12.0, "reserved": 14.4},
                               "default": {"on_demand": 2.0, "spot": 0.8, "reserved": 0.8}}}


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.integration
def test_stoker_cost_totals_are_the_sum_of_three_finished_jobs_mlflow_metrics(harness, tmp_path):
    from flows.pipeline import pipeline

    work = tmp_path / "work"
    since = time.time() - 1
    for job, capacity in (("cost-a", "on_demand"), ("cost-b", "spot"), ("cost-c", "on_demand")):
        config_file = tmp_path / f"{job}.yaml"
        config_file.write_text(yaml.safe_dump({"cost": {"capacity_type": capacity,
                                                        "prices": PRICES}}))
        config = load_pipeline_config(config_file, [
            f"work_dir={work}", f"job_id={job}", "train.epochs=1",
            "tracking.system_metrics_interval_s=null"])
        pipeline(config)

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
            if "stoker.job" in r.data.tags]
    assert len(runs) == 3
    expected = sum(r.data.metrics["cost_usd"] for r in runs)
    hours = sum(r.data.metrics["gpu_hours"] for r in runs)
    assert expected > 0

    result = CliRunner().invoke(app, ["cost", "--work-dir", str(work), "--since",
                                      str(since_iso := _iso(since)), "--format", "json",
                                      "--plot", str(tmp_path / "spend.png")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {j["job"] for j in report["jobs"]} == {"cost-a", "cost-b", "cost-c"}
    assert report["totals"]["cost_usd"] == pytest.approx(expected, abs=1e-5)
    assert report["totals"]["gpu_hours"] == pytest.approx(hours, abs=1e-5)
    by_type = report["totals"]["gpu_hours_spot"] + report["totals"]["gpu_hours_on_demand"]
    assert by_type == pytest.approx(hours, abs=1e-5)
    spot = next(j for j in report["jobs"] if j["job"] == "cost-b")
    assert spot["gpu_hours_spot"] > 0 and spot["gpu_hours_on_demand"] == 0
    # Per registered model: every job registered a version of the same model.
    [(model, sums)] = report["by_model"].items()
    assert model and sums["cost_usd"] == pytest.approx(expected, abs=1e-5)
    assert report["advice"]["assumptions"] and report["advice"]["reserved_gpus"] >= 0
    assert (tmp_path / "spend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = CliRunner().invoke(app, ["cost", "--work-dir", str(work), "--since", since_iso,
                                     "--format", "csv"])
    lines = list(csv.DictReader(io.StringIO(table.stdout)))
    assert [x["job"] for x in lines][-1] == "TOTAL" and len(lines) == 4
    assert float(lines[-1]["cost_usd"]) == pytest.approx(expected, abs=1e-5)
    # The scheduled flow publishes the same report as the `stoker-cost` markdown artifact.
    from prefect.client.orchestration import get_client

    from flows.cost_report import CostReportForm, cost_report_flow

    flowed = cost_report_flow(CostReportForm(tracking_uri=f"sqlite:///{work / 'mlflow.db'}",
                                             days=1))
    assert flowed["totals"]["cost_usd"] == pytest.approx(expected, abs=1e-5)
    with get_client(sync_client=True) as prefect:
        [artifact] = [a for a in prefect.read_artifacts() if a.key == "stoker-cost"]
    assert "cost-a" in artifact.data and "Reserve " in artifact.data
    # A period before the jobs holds none of them.
    empty = CliRunner().invoke(app, ["cost", "--work-dir", str(work), "--since", "2020-01-01",
                                     "--until", "2020-02-01", "--format", "json"])
    assert json.loads(empty.stdout)["jobs"] == []


def _iso(unix_s: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat()


def test_a_period_that_cannot_be_read_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["cost", "--work-dir", str(tmp_path), "--since", "lately"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --since: 'lately' is neither an age (30d, 12h, 2w) nor an ISO 8601 date "
        "(2026-11-01)"]
    missing = CliRunner().invoke(app, ["cost", "--work-dir", str(tmp_path)])
    assert missing.exit_code == 2 and "no MLflow store" in missing.stderr


def test_ages_and_dates_read_as_unix_seconds():
    assert parse_when("2d", 1_000_000.0, "--since") == 1_000_000.0 - 2 * 86400
    assert parse_when("2026-01-01", 0, "--since") == 1767225600.0


def test_a_guard_stop_is_counted_with_the_money_it_saved_over_the_period(tmp_path):
    from stoker.tracking.spend import job_rows, totals

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("guarded", artifact_location=str(tmp_path / "a"))
    for job, stopped_by, outcome in (("idle-job", "cost-guard: idle for 900 s", "stopped"),
                                     ("user-job", "user: x", "stopped"),
                                     # stopped by the guard, then resumed and completed (trial:
                                     # counted as a guard stop that saved $72/h until now)
                                     ("resumed-job", "cost-guard: idle for 900 s", "completed")):
        run = client.create_run(experiment, tags={"stoker.job": job,
                                                  "stoker.stopped_by": stopped_by,
                                                  "stoker.last_outcome": outcome})
        for key, value in (("cost_usd", 1.5), ("gpu_hours", 0.5), ("usd_per_hour", 72.0)):
            client.log_metric(run.info.run_id, key, value, step=10)
        client.set_terminated(run.info.run_id, "KILLED")
    rows = {r.job: r for r in job_rows(client, 0, int(time.time() * 1000) + 1000)}
    assert rows["idle-job"].guard_stopped and rows["idle-job"].guard_saved_usd_per_hour == 72.0
    assert not rows["user-job"].guard_stopped and rows["user-job"].guard_saved_usd_per_hour == 0
    assert not rows["resumed-job"].guard_stopped and rows["resumed-job"].guard_saved_usd == 0
    assert totals(rows.values())["cost_usd"] == 4.5
    # The money saved over the period (issue 48: only a rate was given): $72/h for the hour
    # from the stop to the period's end, not the 2 h to "now" past it; nothing for a user stop.
    end_ms = client.get_run(rows["idle-job"].run_id).info.end_time
    rows = {r.job: r for r in job_rows(client, 0, end_ms + 3_600_000, now_ms=end_ms + 7_200_000)}
    assert rows["idle-job"].guard_saved_usd == 72.0 and rows["user-job"].guard_saved_usd == 0
    assert totals(rows.values())["guard_saved_usd"] == 72.0


def test_a_later_attempt_that_was_not_stopped_clears_the_stop_tag(tmp_path):
    """``stoker.stopped_by`` says who stopped the LAST attempt: a job stopped, then resumed and
    completed, no longer carries it on its MLflow run (trial: it did)."""
    from stoker.launch.supervisor import tag_outcome

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("tags", artifact_location=str(tmp_path / "a"))
    run_id = client.create_run(experiment).info.run_id
    tag_outcome(client, run_id, {"outcome": "stopped", "stopped_by": "cost-guard: idle"})
    assert client.get_run(run_id).data.tags["stoker.stopped_by"] == "cost-guard: idle"
    tag_outcome(client, run_id, {"outcome": "completed"})
    tags = client.get_run(run_id).data.tags
    assert tags["stoker.last_outcome"] == "completed" and "stoker.stopped_by" not in tags
    tag_outcome(client, run_id, {"outcome": "completed"})  # no tag to clear: fine


def test_a_price_table_that_cannot_be_read_is_one_line_and_exit_2(tmp_path):
    from stoker.tracking.spend import job_rows  # noqa: F401 - the store below is real

    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()  # creates it
    bad = tmp_path / "prices.yaml"
    bad.write_text("usd_per_gpu_hour: {H100: {on_demand: -1}}\n")
    result = CliRunner().invoke(app, ["cost", "--work-dir", str(tmp_path), "--prices", str(bad)])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --prices {bad}: ")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(PRICES))
    ok = CliRunner().invoke(app, ["cost", "--work-dir", str(tmp_path), "--prices", str(good),
                                  "--format", "json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["jobs"] == []


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], 1), (["launcher.kind=slurm", "launcher.slurm.nodes=2"], 2),
    (["launcher.kind=docker", "launcher.docker.nnodes=3"], 3)])
def test_a_job_is_billed_for_every_nodes_devices(tmp_path, overrides, expected):
    """Devices billed = processes per node x nodes (trial: a 2-node Slurm job logged devices 1
    and half its GPU-hours, and its budget counted half its spend)."""
    from stoker.config import load_pipeline_config
    from stoker.launch.supervisor import nodes

    config = load_pipeline_config(None, [f"work_dir={tmp_path}", *overrides,
                                         "tracking.tracking_uri=http://127.0.0.1:5999"])
    assert nodes(config) == expected
