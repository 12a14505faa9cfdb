"""Static checks of infra/: what cannot be started here (the compose stack needs images from
public registries; there is no cluster) is validated against the schemas and the models of the
tools that consume it."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from stoker.launch.kubeflow import (
    GPU_TOLERATION,
    SPOT_TOLERATIONS,
    TERMINATION_MARGIN_S,
    TRAINJOB_NODE,
)

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
POOLS = INFRA / "work-pools"
_VAR = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::(?P<op>[-?])(?P<arg>[^}]*))?\}")


def _require(module: str):
    """Import an optional dependency; skip without it, but fail under CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"{module} is not installed (pip install -e '.[docker,kubernetes]')")


def env_example() -> dict[str, str]:
    lines = (INFRA / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} interpolation ($$ is a literal $)."""
    def sub(match: re.Match) -> str:
        value = env.get(match["name"])
        if match["op"] == "-" and not value:
            return match["arg"]
        if value is None:
            raise KeyError(f"{match['name']} is not set: {match['arg']}")
        return value
    return _VAR.sub(sub, text.replace("$$", "\0")).replace("\0", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env_example()))


def test_compose_file_matches_the_compose_spec_schema():
    # The Compose Specification's schema as check-jsonschema ships it (--builtin-schema).
    builtin = _require("check_jsonschema.builtin_schemas")
    schema = builtin.get_builtin_schema("vendor.compose-spec")
    assert schema["$schema"].endswith("/draft/2020-12/schema")
    assert "services" in schema["properties"]
    validator = jsonschema.Draft202012Validator(schema)
    for document in (yaml.safe_load(COMPOSE.read_text()),  # as written
                     yaml.safe_load(interpolate(COMPOSE.read_text(), env_example()))):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(document)]
        assert not errors, errors
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["postgres"]["healthcheck"]["intervall"] = "5s"
    assert list(validator.iter_errors(broken)), "the schema check must reject unknown keys"


def _compose_plugin() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _compose_plugin(), reason="the docker compose plugin is not installed "
                    "here; the compose-spec schema test covers the file")
def test_docker_compose_config_accepts_the_file():
    subprocess.run(["docker", "compose", "-f", str(COMPOSE), "--env-file",
                    str(INFRA / ".env.example"), "config", "-q"], check=True)


def _one_shots(compose: dict) -> set[str]:
    gated = set()
    for service in compose["services"].values():
        for name, dep in (service.get("depends_on") or {}).items():
            if dep.get("condition") == "service_completed_successfully":
                gated.add(name)
    return gated


def test_every_long_running_service_has_a_healthcheck(compose):
    one_shots = _one_shots(compose)
    assert one_shots == {"minio-buckets"}
    for name, service in compose["services"].items():
        if name in one_shots:
            assert service["restart"] == "no"
            continue
        check = service.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name}: no healthcheck"
        assert service["restart"] == "unless-stopped", name


def test_dependencies_wait_for_health(compose):
    for name, service in compose["services"].items():
        for dep_name, dep in (service.get("depends_on") or {}).items():
            assert dep["condition"] in ("service_healthy", "service_completed_successfully"), \
                f"{name} -> {dep_name}"
    assert compose["services"]["mlflow"]["depends_on"]["postgres"]["condition"] == \
        "service_healthy"
    assert compose["services"]["prefect-server"]["depends_on"]["postgres"]["condition"] == \
        "service_healthy"


def test_ports_are_bound_to_loopback_only(compose):
    published = []
    for name, service in compose["services"].items():
        for port in service.get("ports") or []:
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name}: {port}"
            published.append(port)
    assert len(published) == 5  # Prefect, MLflow, MinIO API + console, registry
    hosts = [p.split(":")[1] for p in published]
    assert len(set(hosts)) == len(hosts), f"host ports collide: {hosts}"


def test_images_are_pinned_and_every_variable_is_in_the_env_example(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
        assert tag and tag != "latest", f"{name}: image {image} is not pinned"
    used = {m["name"] for m in _VAR.finditer(COMPOSE.read_text())}
    assert used <= set(env_example()), used - set(env_example())


def test_stack_wiring(compose):
    services = compose["services"]
    mlflow = " ".join(services["mlflow"]["entrypoint"])
    assert "postgresql://stoker:" in mlflow and "@postgres:5432/mlflow" in mlflow
    assert "--artifacts-destination s3://mlflow/" in mlflow
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert "mc mb --ignore-existing stoker/mlflow" in services["minio-buckets"]["entrypoint"][2]
    prefect_db = services["prefect-server"]["environment"]
    assert prefect_db["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert prefect_db["PREFECT_SERVER_DATABASE_NAME"] == "prefect"
    assert (INFRA / "mlflow" / "Dockerfile").read_text().count("psycopg2-binary") == 1
    init = services["postgres"]["volumes"][1].split(":")[0]
    assert "CREATE DATABASE mlflow" in (INFRA / init).read_text()


# --- work pools -------------------------------------------------------------------------------

def pool(kind: str) -> dict:
    return json.loads((POOLS / f"{kind}.json").read_text())


def job_configuration(cls, template: dict, values: dict):
    """The worker's own configuration model from the template, as a worker builds it
    (Prefect's templating; block and variable references need a server and are not used)."""
    from prefect.utilities.templating import apply_values

    variables = cls._get_base_config_defaults(template["variables"]["properties"])
    variables.update(values)
    return cls(**apply_values(template["job_configuration"], variables))


@pytest.mark.parametrize("kind", ["process", "docker", "kubernetes"])
def test_work_pool_templates_pass_prefects_server_validation(kind):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.templating import find_placeholders

    template = pool(kind)
    WorkPoolCreate(name=f"stoker-{kind}", type=kind, base_job_template=template)
    variables = template["variables"]
    jsonschema.Draft202012Validator.check_schema(variables)
    defaults = {k: p["default"] for k, p in variables["properties"].items() if "default" in p}
    jsonschema.validate(defaults, variables, cls=jsonschema.Draft202012Validator)
    placeholders = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    assert placeholders <= set(variables["properties"])
    broken = {**template, "job_configuration": {**template["job_configuration"],
                                                "extra": "{{ undeclared }}"}}
    with pytest.raises(ValueError, match="undeclared"):
        WorkPoolCreate(name="x", type=kind, base_job_template=broken)


def test_process_pool_is_prefects_default():
    from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

    assert pool("process") == ProcessWorker.get_default_base_job_template()
    assert job_configuration(ProcessJobConfiguration, pool("process"), {}).stream_output


def test_docker_pool_requests_gpus_shared_memory_and_host_ipc():
    _require("prefect_docker")
    from docker.models.containers import RUN_HOST_CONFIG_KWARGS
    from docker.types import HostConfig
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    template = pool("docker")
    default = DockerWorker.get_default_base_job_template()
    assert set(default["variables"]["properties"]) - set(template["variables"]["properties"]) \
        == {"container_create_kwargs"}
    config = job_configuration(DockerWorkerJobConfiguration, template,
                               {"image": "stoker/train:1", "gpu_count": 2})
    kwargs = config.container_create_kwargs
    assert set(kwargs) <= set(RUN_HOST_CONFIG_KWARGS)
    host = HostConfig(version="1.44", **kwargs)  # docker-py's own checks and conversion
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": 2, "DeviceIDs": [],
                                       "Capabilities": [["gpu"]], "Options": {}}]
    assert host["ShmSize"] == 16 * 1024**3 and host["IpcMode"] == "host"
    assert {u["Name"] for u in host["Ulimits"]} == {"memlock", "stack"}
    default_gpus = job_configuration(DockerWorkerJobConfiguration, template, {})
    assert default_gpus.container_create_kwargs["device_requests"][0]["count"] == -1


def test_kubernetes_pool_requests_gpus_and_tolerates_spot_nodes():
    _require("prefect_kubernetes")
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    template = pool("kubernetes")
    default = KubernetesWorker.get_default_base_job_template()
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])
    config = job_configuration(KubernetesWorkerJobConfiguration, template, {
        "image": "stoker/flows:1", "gpu_count": 1,
        "node_selector": {"karpenter.sh/capacity-type": "spot"}})
    pod = config.job_manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert pod["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert pod["tolerations"] == [t.manifest() for t in (*SPOT_TOLERATIONS, GPU_TOLERATION)]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["serviceAccountName"] == "stoker-launcher" and config.namespace == "stoker"
    cpu_only = job_configuration(KubernetesWorkerJobConfiguration, template, {})
    limits = cpu_only.job_manifest["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in limits["limits"]


# --- kubernetes manifests ---------------------------------------------------------------------

def test_worker_helm_values_set_the_kubernetes_pool():
    values = yaml.safe_load((INFRA / "kubernetes/prefect-worker/values.yaml").read_text())
    schema = json.loads((INFRA / "kubernetes/prefect-worker/values.schema.subset.json")
                        .read_text())
    jsonschema.validate(values, schema)
    config = values["worker"]["config"]
    assert (config["workPool"], config["type"]) == ("stoker-kubernetes", "kubernetes")
    assert config["baseJobTemplate"]["existingConfigMapName"]
    assert values["worker"]["apiConfig"] == "server"
    assert values["worker"]["serverApiConfig"]["apiUrl"].endswith("/api")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"worker": {"config": {"workPool": 3}}}, schema)


def test_stoker_training_runtime_ends_the_job_on_any_failure():
    runtime = yaml.safe_load((INFRA / "kubernetes/trainer/stoker-torch-distributed.yaml")
                             .read_text())
    assert runtime["kind"] == "ClusterTrainingRuntime"
    _require("kubeflow_trainer_api.models")
    from stoker.launch.api_models import check_manifest

    check_manifest(runtime)  # kubeflow-trainer-api's ClusterTrainingRuntime model
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"]["maxRestarts"] == 0
    (node,) = jobset["replicatedJobs"]
    assert node["name"] == TRAINJOB_NODE
    assert node["template"]["metadata"]["labels"][
        "trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    job = node["template"]["spec"]
    pod = job["template"]["spec"]
    assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert [c["name"] for c in pod["containers"]] == [TRAINJOB_NODE]
    from stoker.config import TrainConfig

    assert pod["terminationGracePeriodSeconds"] >= \
        TrainConfig().preemption_grace_s + TERMINATION_MARGIN_S
