"""prefect.yaml deployments on a real Prefect server with a real process worker."""

from __future__ import annotations

import json
import re
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
        # pipeline-docker's form, deployed without its build step (as if the image were built).
        import yaml

        spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
        (docker,) = [d for d in spec["deployments"] if d["name"] == "pipeline-docker"]
        docker.pop("build")
        docker["parameters"]["config"]["docker"]["image"] = PINNED
        spec["deployments"] = [docker]
        (root / "docker.yaml").write_text(yaml.safe_dump(spec))
        server.prefect("--no-prompt", "deploy", "--prefect-file", str(root / "docker.yaml"),
                       "--name", "pipeline-docker", cwd=REPO)
        yield server


PINNED = "127.0.0.1:5000/stoker/train@sha256:" + "0" * 64


def read_deployment(server: PrefectServer, name: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), \
            get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_parameter_schema_is_a_usable_form(deployed):
    schema = read_deployment(deployed, "pipeline/pipeline").parameter_openapi_schema
    definitions = schema["definitions"]
    config = definitions["PipelineForm"]["properties"]
    assert {"work_dir", "job_id", "data", "train", "tracking", "retry"} <= config.keys()
    train = definitions["Train"]["properties"]
    assert train["epochs"]["type"] == "integer" and train["epochs"]["default"] == 12
    assert train["epochs"]["exclusiveMinimum"] == 0
    assert train["lr"]["type"] == "number" and train["lr"]["description"]
    assert set(train["precision"]["enum"]) == {"fp32", "bf16", "fp16"}
    assert definitions["Data"]["properties"]["rev"]["default"] == "v1"
    assert all(p.get("description") for p in train.values()), "every train field documented"


def test_prefect_yaml_declares_the_docker_deployment_with_the_image_build_step():
    import yaml

    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())
                   ["deployments"]}
    docker = deployments["pipeline-docker"]
    (step,) = docker["build"]
    assert "tasks.images.prefect_build_step" in step
    assert docker["parameters"]["config"]["docker"]["image"] == \
        "{{ build-training-image.pinned_image }}"


def test_every_deployment_is_created_with_its_schedule(deployed):
    pipeline = read_deployment(deployed, "pipeline/pipeline")
    assert [s.active for s in pipeline.schedules] == [False]  # nightly example, off by default
    assert "stoker:owned" in pipeline.tags
    assert read_deployment(deployed, "train/train").entrypoint == "flows/train.py:train_local"
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
                         "overrides": ["tracking.system_metrics_interval_s=null"]}}
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



# Issue 18, point 7: each deployment's form holds what that deployment uses.
FORMS = {
    "pipeline/pipeline": {
        "groups": {"data", "train", "tracking", "retry"},
        "absent": {"launcher", "cost", "docker", "image", "prices", "kubernetes"},
        "extra": {}},
    "train/train": {
        "groups": {"data", "train", "tracking", "retry"},
        "absent": {"launcher", "cost", "docker", "image", "registered_model", "promote_metric"},
        "extra": {}},
    "pipeline/pipeline-docker": {
        "groups": {"data", "train", "tracking", "retry", "docker"},
        "absent": {"launcher", "cost", "kubernetes", "prices", "matrix_entry", "wheelhouse"},
        "extra": {"tracking": {"tracking_uri": "http://127.0.0.1:5000"}}},
    "cost-guard/cost-guard": {
        "groups": {"policy"},
        "absent": {"prices", "nvml_module", "launcher", "train"},
        "extra": {}},
}
INTERNALS = re.compile(r"prefect|pydantic|draws a form|\.py\b|LaunchConfig", re.I)


def _walk(schema: dict, node: dict, path: str = "config"):
    """(path, property schema) of every field under ``node``, following $refs."""
    for name, prop in node.get("properties", {}).items():
        yield f"{path}.{name}", prop
        if _definition(schema, prop) is not None:
            yield from _walk(schema, _definition(schema, prop), f"{path}.{name}")


def _definition(schema: dict, prop: dict) -> dict | None:
    ref = prop.get("$ref") or next((p["$ref"] for p in prop.get("allOf", []) if "$ref" in p), None)
    return schema["definitions"][ref.rsplit("/", 1)[-1]] if ref else None


@pytest.mark.parametrize("name", list(FORMS))
def test_each_deployment_form_holds_what_it_uses(deployed, name):
    deployment = read_deployment(deployed, name)
    schema = deployment.parameter_openapi_schema
    assert set(schema["properties"]) == {"config"}, "no image-build parameter beside the config"
    (config_field,) = [prop for path, prop in _walk(schema, schema) if path == "config.config"]
    form = _definition(schema, config_field)
    fields = dict(_walk(schema, form))
    top = {path.split(".")[1] for path in fields}
    expected = FORMS[name]
    assert expected["groups"] <= top, top
    leaves = {path.rsplit(".", 1)[-1] for path in fields}
    assert not expected["absent"] & leaves, expected["absent"] & leaves
    assert "overrides" in top  # every other setting stays reachable
    for path, prop in fields.items():
        # Raw JSON boxes: a free-form mapping has additionalProperties other than false.
        assert prop.get("additionalProperties") in (None, False), f"{path} is raw JSON"
        description = prop.get("description", "")
        if "$ref" not in prop and "allOf" not in prop:
            assert description, f"{path} has no description"
        assert not INTERNALS.search(description), f"{path}: {description}"
    for definition in schema["definitions"].values():
        assert not INTERNALS.search(definition.get("description", "")), definition
    assert len(fields) <= 40, f"{len(fields)} fields: the form is still every knob"

    # A run with the form's defaults (plus the deployment's parameters) validates as the flow
    # run itself does, and yields the full configuration.
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(str(REPO / deployment.entrypoint))
    params = json.loads(json.dumps(deployment.parameters))
    params.setdefault("config", {})
    for group, values in expected["extra"].items():
        params["config"].setdefault(group, {}).update(values)
    config = flow.validate_parameters(params)["config"].to_config()
    if name == "pipeline/pipeline-docker":
        assert config.launcher.kind == "docker" and config.launcher.docker.image == PINNED
    if name == "cost-guard/cost-guard":
        assert config.dry_run is True


def test_form_overrides_reach_every_field_and_name_a_bad_one(deployed):
    from prefect.exceptions import ParameterTypeError
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(str(REPO / "flows/pipeline.py:pipeline_local"))
    config = flow.validate_parameters({"config": {"overrides": [
        "train.weight_decay=0.5", "cost.capacity_type=spot"]}})["config"]
    full = config.to_config()
    assert full.train.weight_decay == 0.5 and full.cost.capacity_type == "spot"
    with pytest.raises(ParameterTypeError, match="train.weight_dekay: unknown field"):
        flow.validate_parameters({"config": {"overrides": ["train.weight_dekay=0.5"]}})
    with pytest.raises(ParameterTypeError, match="global_batch_size: must be a multiple"):
        flow.validate_parameters({"config": {"train": {"global_batch_size": 7,
                                                       "nproc_per_node": 2}}})
    docker = load_flow_from_entrypoint(str(REPO / "flows/pipeline.py:pipeline_docker"))
    with pytest.raises(ParameterTypeError, match="tracking"):
        docker.validate_parameters({"config": {"docker": {"image": PINNED}}})
