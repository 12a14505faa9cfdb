"""prefect.yaml deployments on a real Prefect server with a real process worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect_server import PrefectServer

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefect-server")
    with PrefectServer(root) as server:
        server.prefect("work-pool", "create", "stoker-process", "--type", "process",
                       "--base-job-template", str(REPO / "infra/work-pools/process.json"))
        server.prefect("work-pool", "create", "stoker-guard", "--type", "process",
                       "--base-job-template", str(REPO / "infra/work-pools/process.json"))
        # Everything but pipeline-docker, whose build step needs a Docker Engine (tested with
        # the images: tests/test_image_flow.py runs the same step).
        server.prefect("--no-prompt", "deploy", "--name", "pipeline", "--name", "train",
                       "--name", "cost-guard", cwd=REPO)
        yield server


def read_deployment(server: PrefectServer, name: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), \
            get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_parameter_schema_is_a_usable_form(deployed):
    schema = read_deployment(deployed, "pipeline/pipeline").parameter_openapi_schema
    definitions = schema["definitions"]
    config = definitions["PipelineConfig"]["properties"]
    assert {"work_dir", "job_id", "data", "train", "tracking", "retry", "cost"} <= config.keys()
    train = definitions["TrainConfig"]["properties"]
    assert train["epochs"]["type"] == "integer" and train["epochs"]["default"] == 12
    assert train["epochs"]["exclusiveMinimum"] == 0
    assert train["lr"]["type"] == "number" and train["lr"]["description"]
    assert set(train["precision"]["enum"]) == {"fp32", "bf16", "fp16"}
    assert definitions["DataConfig"]["properties"]["rev"]["default"] == "v1"
    assert all(p.get("description") for p in train.values()), "every train field documented"


def test_prefect_yaml_declares_the_docker_deployment_with_the_image_build_step():
    import yaml

    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())
                   ["deployments"]}
    docker = deployments["pipeline-docker"]
    (step,) = docker["build"]
    assert "tasks.images.prefect_build_step" in step
    assert docker["parameters"]["config"]["launcher"]["docker"]["image"] == \
        "{{ build-training-image.pinned_image }}"


def test_every_deployment_is_created_with_its_schedule(deployed):
    pipeline = read_deployment(deployed, "pipeline/pipeline")
    assert [s.active for s in pipeline.schedules] == [False]  # nightly example, off by default
    assert "stoker:owned" in pipeline.tags
    assert read_deployment(deployed, "train/train").entrypoint == "flows/train.py:train_only"
    guard = read_deployment(deployed, "cost-guard/cost-guard")
    assert guard.schedules[0].active and guard.schedules[0].schedule.interval.total_seconds() == 300
    assert guard.parameters["config"]["dry_run"] is True


def test_cost_guard_never_holds_a_training_slot(deployed):
    """Its own pool and queue: a pool concurrency limit on training never counts a sweep."""
    guard = read_deployment(deployed, "cost-guard/cost-guard")
    training = {read_deployment(deployed, name).work_pool_name
                for name in ("pipeline/pipeline", "train/train")}
    assert guard.work_pool_name == "stoker-guard" and guard.work_queue_name == "cost-guard"
    assert guard.work_pool_name not in training
    assert guard.global_concurrency_limit.limit == 1  # never two sweeps at once


def test_invalid_parameters_are_rejected_by_name(deployed):
    with pytest.raises(RuntimeError, match="epochs"):
        deployed.prefect("deployment", "run", "pipeline/pipeline",
                         "--params", json.dumps({"config": {"train": {"epochs": -1}}}))


def test_deployment_runs_on_a_process_worker(deployed, tmp_path):
    params = {"config": {"work_dir": str(tmp_path / "work"),
                         "train": {"epochs": 4, "nproc_per_node": 1},
                         "tracking": {"system_metrics_interval_s": None}}}
    out = deployed.prefect("deployment", "run", "pipeline/pipeline",
                           "--params", json.dumps(params)).stdout
    flow_run_id = next(line.split("UUID:")[1].strip() for line in out.splitlines()
                       if "UUID:" in line)
    deployed.prefect("worker", "start", "--pool", "stoker-process", "--run-once", timeout=600)

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: deployed.api_url}), \
            get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
    assert flow_run.state.type.value == "COMPLETED", flow_run.state
    client = MlflowClient(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    version = client.get_model_version_by_alias("stoker-digits", "champion")
    run = client.get_run(version.run_id)
    assert run.data.tags["prefect.flow_run_id"] == flow_run_id


def test_deploying_needs_no_variable_and_runs_from_this_checkout(deployed):
    """Deployed without any environment variable: the working directory is this checkout (it
    used to store the literal ``{{ $STOKER_CHECKOUT }}`` and fail at run time)."""
    for name in ("pipeline/pipeline", "train/train", "cost-guard/cost-guard"):
        steps = read_deployment(deployed, name).pull_steps
        (step,) = steps
        directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
        assert Path(directory).resolve() == REPO.resolve(), steps
        assert (Path(directory) / "flows" / "pipeline.py").is_file()

