"""MLflow tracking against a real `mlflow server` over HTTP (and the sqlite default)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from conftest import Preemptor, metric_steps
from mlflow import MlflowClient

from stoker.config import RetryConfig, TrainConfig
from stoker.launch.local import LocalLauncher
from stoker.launch.retry import Outcome, run_with_retries
from stoker.runtime.spec import RunSpec
from stoker.runtime.tracking import flatten
from stoker.tracking.cost import cost_report, steps_lost
from stoker.tracking.pricing import PriceTable

pytestmark = pytest.mark.integration


@pytest.fixture
def server(mlflow_http):
    return mlflow_http


def test_secrets_are_masked_in_params():
    flat = flatten({"train": {"lr": 0.1}, "api_token": "abc", "store": {"password": "x"},
                    "tracking_uri": "http://alice:s3cret@mlflow.example:5000"})
    assert flat["train.lr"] == "0.1" and flat["api_token"] == "***"
    assert flat["store.password"] == "***"
    assert flat["tracking_uri"] == "http://alice:***@mlflow.example:5000"


def spec_for(tmp_path: Path, dataset, uri: str, name: str, **train) -> Path:
    job = tmp_path / name
    job.mkdir()
    spec = RunSpec(train=TrainConfig(epochs=2, checkpoint_every_steps=10, **train),
                   data_dir=dataset.local_path, job_dir=str(job), tracking_uri=uri,
                   experiment="http-tests", run_name=name, system_metrics_interval_s=0.5,
                   tags={"dvc.md5": dataset.md5})
    spec.dump(job / "spec.yaml")
    return job / "spec.yaml"


def test_resumed_job_keeps_one_run_over_http(server, dataset, tmp_path):
    spec = spec_for(tmp_path, dataset, server.uri, "resumed")
    launcher = LocalLauncher(2, shutdown_grace_s=20, python=sys.executable)
    lines: list[str] = []

    def attempt(number: int) -> int:
        if number == 1:
            Preemptor(launcher, spec.parent, at_step=15).start()
        return launcher.run(spec, on_line=lines.append)

    attempts = run_with_retries(attempt, RetryConfig(backoff_s=0), sleep=lambda s: None)
    assert [a.outcome for a in attempts] == [Outcome.PREEMPTED, Outcome.COMPLETED], lines
    client = MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name("http-tests").experiment_id],
                              "attributes.run_name = 'resumed'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(steps) == metric_steps(44)
    assert run.data.tags["stoker.gpu_model"] == "cpu" and run.data.tags["dvc.md5"] == dataset.md5
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), run.data.metrics


def test_concurrent_runs_lose_no_metrics(server, dataset, tmp_path):
    specs = [spec_for(tmp_path, dataset, server.uri, f"concurrent-{i}", seed=i) for i in range(3)]
    codes: dict[int, int] = {}

    def run(i: int) -> None:
        codes[i] = LocalLauncher(1, python=sys.executable).run(specs[i], on_line=lambda x: None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == {0: 0, 1: 0, 2: 0}
    client = MlflowClient(server.uri)
    for spec in specs:
        run_id = (spec.parent / "mlflow_run_id").read_text()
        steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
        assert sorted(steps) == metric_steps(44), spec.parent.name
        assert len(client.get_metric_history(run_id, "val_accuracy")) == 2


def test_cost_and_goodput():
    events = [{"event": "start", "step": 0, "time": 100.0}, {"event": "step", "step": 30,
                                                             "time": 150.0},
              {"event": "start", "step": 20, "time": 200.0}, {"event": "step", "step": 50,
                                                              "time": 250.0},
              {"event": "end", "step": 50, "time": 260.0}]
    attempts = [{"duration_s": 1800, "outcome": "infrastructure_failure",
                 "capacity_type": "spot", "started": 99.0, "steps_lost": 10},
                {"duration_s": 1800, "outcome": "completed", "capacity_type": "on_demand",
                 "started": 199.0, "steps_lost": 0}]
    assert steps_lost(attempts, events) == 10
    report = cost_report(attempts, events, useful_train_s=2700, devices=8,
                         gpu_model="NVIDIA H100 80GB HBM3", prices=PriceTable())
    assert report.gpu_hours == 8.0
    assert report.cost_usd == pytest.approx(8 * 0.5 * 1.70 + 8 * 0.5 * 4.00)
    assert report.goodput == 0.75 and report.steps_lost == 10 and report.preemptions == 0
    # The run's JSON summary keeps counts as integers (it printed "attempts": 2.0).
    summary = report.summary()
    assert summary["attempts"] == 2 and isinstance(summary["attempts"], int)
    assert isinstance(summary["devices"], int) and summary["capacity_types"] == ["spot",
                                                                                 "on_demand"]


def test_steps_lost_is_one_figure_from_the_records_with_events_for_older_records(tmp_path):
    """New-user trial: on a job whose attempt records predate ``steps_lost`` (before 2620b4f),
    ``stoker status`` said 0 steps lost (it summed the records) while the job summary and MLflow
    said 81 (they read the progress events). Both now take the records' figure, and the events
    only for a record without one."""
    from stoker.jobs.status import job_summary

    job = tmp_path / "jobs" / "old-job"
    job.mkdir(parents=True)
    records = [  # attempt 1 reached 131 with step 50 committed, attempt 2 completed
        {"number": 1, "exit_code": 137, "outcome": "infrastructure_failure", "started": 1000.0,
         "duration_s": 60.0, "capacity_type": "spot"},
        {"number": 2, "exit_code": 0, "outcome": "completed", "started": 1100.0,
         "duration_s": 90.0, "capacity_type": "spot"}]
    events = [{"event": "start", "step": 0, "time": 1005.0, "total_steps": 300},
              {"event": "checkpoint", "step": 50, "time": 1020.0},
              {"event": "step", "step": 131, "time": 1050.0},
              {"event": "start", "step": 50, "time": 1105.0, "total_steps": 300},
              {"event": "end", "step": 300, "time": 1180.0, "outcome": "completed"}]
    (job / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (job / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events)
                                        + '{"event": "st')  # a torn last line
    assert steps_lost(records, events) == 81
    assert job_summary(job).steps_lost == 81  # stoker status: 0 before
    report = cost_report(records, events, useful_train_s=100, devices=1, gpu_model="cpu",
                         prices=PriceTable())
    assert report.steps_lost == 81

    # Newer records carry their own figure (from the heartbeat, which can be past the last
    # step event): it wins over the events, and a last attempt that lost steps counts too.
    records[0]["steps_lost"] = 83
    records.append({"number": 3, "exit_code": 75, "outcome": "preempted", "started": 1200.0,
                    "duration_s": 5.0, "capacity_type": "spot", "steps_lost": 4})
    assert steps_lost(records, events) == 87
    # Damaged values count 0, and a negative one is not subtracted.
    assert steps_lost([{"steps_lost": True}, {"steps_lost": -5}, {"started": "x"}], events) == 0


def test_capacity_types_are_distinct_in_first_seen_order():
    """New-user trial: the job summary's capacity_types (and the stoker.capacity_types tag,
    joined from it) said "on_demand" once per attempt."""
    def attempt(capacity: str) -> dict:
        return {"duration_s": 60, "outcome": "preempted", "capacity_type": capacity}

    for kinds, expected in ((["on_demand"] * 3, ("on_demand",)),
                            (["spot", "spot", "on_demand", "spot"], ("spot", "on_demand"))):
        report = cost_report([attempt(k) for k in kinds], [], useful_train_s=60, devices=1,
                             gpu_model="cpu", prices=PriceTable())
        assert report.capacity_types == expected
        assert report.summary()["capacity_types"] == list(expected)
        assert report.attempts == len(kinds)


def test_an_attempt_shorter_than_one_interval_still_logs_system_metrics(dataset, tmp_path):
    """MLflow's monitor publishes only after a whole interval: a short attempt logged none."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "short"
    job.mkdir()
    RunSpec(train=TrainConfig(epochs=1, checkpoint_every_steps=10), data_dir=dataset.local_path,
            job_dir=str(job), tracking_uri=uri, experiment="short", run_name="short",
            system_metrics_interval_s=300).dump(job / "spec.yaml")
    lines: list[str] = []
    assert LocalLauncher(1, python=sys.executable).run(job / "spec.yaml",
                                                       on_line=lines.append) == 0, lines
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("short")
    # the MLflow UI shows it as model training, not in its GenAI layout
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system

def test_the_first_system_cpu_sample_of_an_attempt_is_measured_not_zero(dataset, tmp_path):
    """MLflow samples CPU with psutil.cpu_percent(), which keeps its previous reading per thread:
    every attempt's first system/cpu point read 0, and so did a short attempt's only point."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "sampled"
    job.mkdir()
    RunSpec(train=TrainConfig(epochs=2, checkpoint_every_steps=1000),
            data_dir=dataset.local_path, job_dir=str(job), tracking_uri=uri,
            experiment="sampled", run_name="sampled",
            system_metrics_interval_s=0.5).dump(job / "spec.yaml")
    lines: list[str] = []
    assert LocalLauncher(1, python=sys.executable).run(job / "spec.yaml",
                                                       on_line=lines.append) == 0, lines
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sampled").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id,
                                               "system/cpu_utilization_percentage"),
                     key=lambda m: m.step)
    # a training attempt keeps a core busy: no point (the first included) reads 0
    assert history and all(point.value > 0 for point in history), history


def test_training_run_logs_the_dataset_as_an_mlflow_input(dataset, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "with-input"
    job.mkdir()
    tags = {"dvc.repo": dataset.repo_url, "dvc.path": dataset.path, "dvc.rev": dataset.rev,
            "dvc.commit": dataset.commit, "dvc.md5": dataset.md5}
    RunSpec(train=TrainConfig(epochs=1, checkpoint_every_steps=10), data_dir=dataset.local_path,
            job_dir=str(job), tracking_uri=uri, experiment="inputs", run_name="with-input",
            artifact_location=(tmp_path / "artifacts").as_uri(), system_metrics_interval_s=None,
            tags=tags).dump(job / "spec.yaml")
    assert LocalLauncher(1, python=sys.executable).run(job / "spec.yaml",
                                                      on_line=lambda x: None) == 0
    run = MlflowClient(uri).get_run((job / "mlflow_run_id").read_text())
    [logged] = run.inputs.dataset_inputs
    assert logged.dataset.name == "repo/data/digits"
    assert logged.dataset.digest == dataset.md5.removesuffix(".dir")
    source = json.loads(logged.dataset.source)
    assert source["uri"] == f"{dataset.repo_url}@{dataset.commit}:{dataset.path}"
    assert {t.key: t.value for t in logged.tags}["mlflow.data.context"] == "training"
