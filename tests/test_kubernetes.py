"""The Kubernetes launcher's manifests: accepted by Kubeflow's and Kubernetes' own API models,
consistent with what the Kubeflow operators and torchrun expect, and equal to the committed
examples."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml

from stoker.config import ConfigError, TrainConfig
from stoker.launch import kubeflow
from stoker.launch.api_models import check_manifest
from stoker.launch.kubeflow import (
    GPU_TOLERATION,
    JOB_LABEL,
    OWNER_LABEL,
    SPEC_PATH,
    SPOT_TOLERATIONS,
    KubernetesLaunchConfig,
    Toleration,
    VolumeClaim,
    configmap_name,
    kubernetes_name,
    node_selector,
    render,
    render_pytorchjob,
    render_spec_configmap,
    render_trainjob,
    tolerations,
)
from stoker.runtime.spec import RunSpec


def _require(module: str) -> None:
    """The API models are in the kubernetes extra: skip without them, but fail under CI=true."""
    try:
        importlib.import_module(module)
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"{module} is not installed: pip install -e '.[kubernetes]'",
                    allow_module_level=True)


for _module in ("kubernetes.client", "kubeflow_trainer_api.models", "kubeflow.training.models"):
    _require(_module)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "infra" / "kubernetes" / "examples"
IMAGE = "registry.example.com/stoker/train@sha256:" + "ab" * 32
NAME = "stoker-3f2a9c01d4e5-20260101t120000z"


def assert_valid(job: dict) -> None:
    """The API models plus the rules they cannot express (CEL rules, operator webhook)."""
    check_manifest(job)
    name = job["metadata"]["name"]
    assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) and len(name) <= 63
    if job["kind"] == "PyTorchJob":  # pkg/apis/kubeflow.org/v1/pytorch_validation.go
        for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
            assert rtype in ("Master", "Worker")
            containers = replica["template"]["spec"]["containers"]
            assert all(c.get("image") for c in containers)
            assert "pytorch" in [c["name"] for c in containers]


def pod_of(job: dict) -> tuple[dict, dict]:
    """(pod spec fields, training container fields) of a rendered job, for either flavor."""
    if job["kind"] == "PyTorchJob":
        pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        return pod, pod["containers"][0]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return pod, {**job["spec"]["trainer"], **pod["containers"][0]}


@pytest.fixture
def spec() -> RunSpec:
    return RunSpec(train=TrainConfig(preemption_grace_s=40), data_dir="/data/digits",
                   job_dir="/jobs/j1", tracking_uri="http://mlflow:5000")


def config(**fields) -> KubernetesLaunchConfig:
    claims = [VolumeClaim(claim_name="datasets", mount_path="/data", read_only=True),
              VolumeClaim(claim_name="jobs", mount_path="/jobs")]
    return KubernetesLaunchConfig(**{"image": IMAGE, "volume_claims": claims, **fields})


CONFIGS = {
    "defaults": {},
    "multi-node-spot-gpu": dict(num_nodes=4, gpus_per_node=8, node_pool="gke", shm_size="64Gi",
                                cpu_per_node="96", memory_per_node="1Ti", namespace="training",
                                credentials_secret="s3", service_account="trainer",
                                checkpoint_dir="s3://bucket/j1", active_deadline_s=86400,
                                env={"NCCL_DEBUG": "INFO"}, labels={"team": "vision"}),
    "cpu-on-demand": dict(gpus_per_node=0, nproc_per_node=4, capacity_type="on_demand",
                          node_pool="karpenter", shm_size=None),
    "explicit-scheduling": dict(node_selector={"pool": "a100"}, tolerations=[
        Toleration(key="dedicated", value="ml", effect="NoExecute")]),
}


@pytest.mark.parametrize("flavor", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_rendered_jobs_are_valid_against_the_api_models(spec, flavor, case):
    cm, job = render(spec, NAME, config(flavor=flavor, **CONFIGS[case]))
    assert_valid(job)
    check_manifest(cm)
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["namespace"] == job["metadata"]["namespace"]


_POD = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs",
        0, "template", "spec", "template", "spec")
_WORKER = ("spec", "pytorchReplicaSpecs", "Worker")
_CONTAINER = (*_WORKER, "template", "spec", "containers", 0)


@pytest.mark.parametrize(("kind", "path", "value", "message"), [
    ("TrainJob", ("spec", "trainer", "numNodes"), "2",
     "TrainJob: TrainerV1alpha1Trainer.numNodes: Input should be a valid integer, got '2'"),
    ("TrainJob", ("spec", "trainer", "nodeCount"), 2,
     "TrainJob.spec.trainer.nodeCount: unknown field"),
    ("TrainJob", ("spec", "runtimeRef"), None, "TrainerV1alpha1TrainJobSpec.runtimeRef"),
    ("TrainJob", (*_POD, "volumes", 0, "configMapp"), {},
     "TrainJob.spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0]"
     ".template.spec.template.spec.volumes[0].configMapp: unknown field"),
    ("PyTorchJob", ("spec", "runPolicy", "backoffLimit"), "0",
     "PyTorchJob.spec.runPolicy.backoffLimit: expected int, got '0'"),
    ("PyTorchJob", ("spec", "elasticPolicy", "rdzvBackends"), "c10d",
     "PyTorchJob.spec.elasticPolicy.rdzvBackends: unknown field"),
    ("PyTorchJob", (*_WORKER, "replicas"), True,
     "PyTorchJob.spec.pytorchReplicaSpecs.Worker.replicas: expected int, got True"),
    ("PyTorchJob", ("spec", "pytorchReplicaSpecs"), None,
     "PyTorchJob.spec.pytorchReplicaSpecs: Invalid value for `pytorch_replica_specs`"),
    ("PyTorchJob", (*_CONTAINER, "imagePullPolicy"), 3,
     "PyTorchJob.spec.pytorchReplicaSpecs.Worker.template: V1Container.imagePullPolicy: "
     "Input should be a valid string, got 3"),
    ("PyTorchJob", (*_CONTAINER, "volumeMount"), [],
     "PyTorchJob.spec.pytorchReplicaSpecs.Worker.template.spec.containers[0].volumeMount: "
     "unknown field"),
    ("PyTorchJob", ("metadata", "labelz"), {}, "PyTorchJob.metadata.labelz: unknown field"),
])
def test_the_api_models_reject_invalid_fields_by_path(spec, kind, path, value, message):
    render_fn = render_trainjob if kind == "TrainJob" else render_pytorchjob
    job = render_fn(spec, NAME, config())
    check_manifest(job)
    node = job
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_manifest(job)


def test_a_kind_without_a_model_is_refused():
    with pytest.raises(ConfigError, match="manifest kind 'MPIJob': no API model"):
        check_manifest({"apiVersion": "kubeflow.org/v1", "kind": "MPIJob"})


@pytest.mark.parametrize("flavor", ["trainjob", "pytorchjob"])
def test_render_refuses_a_job_the_api_would_not_accept(spec, flavor, monkeypatch):
    """A renderer slip (here a misspelt env field) fails at render time, naming the field."""
    monkeypatch.setattr(kubeflow, "_env", lambda config: [{"name": "X", "valu": "1"}])
    with pytest.raises(ConfigError, match=r"env\[0\]\.valu: unknown field"):
        render(spec, NAME, config(flavor=flavor))


@pytest.mark.parametrize("flavor", ["trainjob", "pytorchjob"])
def test_pods_mount_the_spec_configmap_shm_and_claims(spec, flavor):
    cm, job = render(spec, NAME, config(flavor=flavor, shm_size="16Gi"))
    pod, container = pod_of(job)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} == set(volumes)
    spec_volume = volumes[mounts[str(Path(SPEC_PATH).parent)]["name"]]
    assert spec_volume["configMap"]["name"] == cm["metadata"]["name"] == configmap_name(NAME)
    assert Path(SPEC_PATH).name in cm["data"]
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory",
                                                              "sizeLimit": "16Gi"}
    assert volumes[mounts["/data"]["name"]]["persistentVolumeClaim"] == {
        "claimName": "datasets", "readOnly": True}
    assert mounts["/data"]["readOnly"] and not mounts["/jobs"]["readOnly"]
    for labels in (job["metadata"]["labels"], cm["metadata"]["labels"]):
        assert labels[OWNER_LABEL] == "true" and labels[JOB_LABEL] == NAME


@pytest.mark.parametrize("flavor", ["trainjob", "pytorchjob"])
def test_gpu_requests_and_spot_scheduling(spec, flavor):
    job = render(spec, NAME, config(flavor=flavor, gpus_per_node=8, node_pool="eks",
                                    service_account="trainer"))[1]
    pod, container = pod_of(job)
    resources = container.get("resources") or container["resourcesPerNode"]
    assert resources == {"limits": {"nvidia.com/gpu": "8"}}
    assert pod["nodeSelector"] == {"eks.amazonaws.com/capacityType": "SPOT"}
    assert pod["tolerations"] == [t.manifest() for t in (*SPOT_TOLERATIONS, GPU_TOLERATION)]
    assert pod["serviceAccountName"] == "trainer"


def test_scheduling_presets():
    assert node_selector(config(node_pool="karpenter", capacity_type="on_demand")) == {
        "karpenter.sh/capacity-type": "on-demand"}
    assert node_selector(config(node_pool="gke", capacity_type="on_demand")) == {}
    assert node_selector(config(node_pool="aks", node_selector={"pool": "gpu"})) == {
        "kubernetes.azure.com/scalesetpriority": "spot", "pool": "gpu"}
    assert tolerations(config(capacity_type="on_demand", gpus_per_node=0)) == []
    assert tolerations(config(tolerations=[])) == []


def _torchrun_args(container: dict, env: dict[str, str], monkeypatch):
    from torch.distributed.run import parse_args

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert container["command"] == ["python", "-m", "stoker.runtime.launch"]
    return parse_args(container["args"])


def test_trainjob_command_reads_the_trainer_torch_plugin_env(spec, monkeypatch):
    job = render_trainjob(spec, NAME, config(num_nodes=3, gpus_per_node=4))
    assert job["spec"]["trainer"]["numNodes"] == 3
    assert job["spec"]["trainer"]["numProcPerNode"] == 4
    # What the Trainer's torch plugin sets on node 2 of this TrainJob.
    args = _torchrun_args(job["spec"]["trainer"], {
        "PET_NNODES": "3", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": f"{NAME}-node-0-0.{NAME}", "PET_MASTER_PORT": "29400"}, monkeypatch)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("3", "4", 2)
    assert (args.master_addr, args.master_port) == (f"{NAME}-node-0-0.{NAME}", 29400)
    assert args.max_restarts == 0 and args.training_script == "stoker.runtime" and args.module
    assert args.training_script_args == [SPEC_PATH]


def test_pytorchjob_command_reads_the_elastic_policy_env(spec, monkeypatch):
    job = render_pytorchjob(spec, NAME, config(num_nodes=2, gpus_per_node=8))
    elastic = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == elastic["minReplicas"] == elastic["maxReplicas"] == 2
    assert worker["restartPolicy"] == "Never" and job["spec"]["runPolicy"]["backoffLimit"] == 0
    container = worker["template"]["spec"]["containers"][0]
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
    # What the training operator's elastic env generator sets (pkg/controller.v1/pytorch).
    args = _torchrun_args(container, {
        "PET_RDZV_ENDPOINT": f"{NAME}-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "2:2", "PET_MAX_RESTARTS": "0", "PET_RDZV_ID": NAME}, monkeypatch)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.nnodes) == (
        "c10d", f"{NAME}-worker-0:23456", "2:2")
    assert args.nproc_per_node == "8" and args.rdzv_id == NAME


def test_termination_grace_covers_the_preemption_grace(spec):
    job = render_pytorchjob(spec, NAME, config())
    pod, container = pod_of(job)
    assert "--shutdown-timeout=40" in container["args"]
    assert pod["terminationGracePeriodSeconds"] > 40


def test_spec_configmap_round_trips_with_the_checkpoint_override(spec, tmp_path):
    cm = render_spec_configmap(spec, NAME, config(checkpoint_dir="s3://bucket/ckpt/j1"))
    (tmp_path / "spec.yaml").write_text(cm["data"]["spec.yaml"])
    loaded = RunSpec.load(tmp_path / "spec.yaml")
    assert loaded == spec.model_copy(update={"checkpoint_dir": "s3://bucket/ckpt/j1"})


def test_credentials_come_from_the_secret_as_optional_keys(spec):
    job = render_trainjob(spec, NAME, config(credentials_secret="s3", env={"AWS_ENDPOINT_URL":
                                                                           "http://minio:9000"}))
    env = {e["name"]: e for e in job["spec"]["trainer"]["env"]}
    assert env["AWS_ENDPOINT_URL"] == {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3", "key": "AWS_ACCESS_KEY_ID", "optional": True}


@pytest.mark.parametrize(("fields", "spec_fields", "message"), [
    ({}, {"data_dir": "/elsewhere/d"}, "run spec data_dir '/elsewhere/d': not under a volume"),
    ({"volume_claims": [VolumeClaim(claim_name="all", mount_path="/data", read_only=True),
                        VolumeClaim(claim_name="j", mount_path="/jobs", read_only=True)]},
     {}, "run spec job_dir '/jobs/j1': volume claim j is read-only"),
    ({"checkpoint_dir": "/scratch/ckpt"}, {}, "run spec checkpoint_dir '/scratch/ckpt'"),
    ({}, {"checkpoint_dir": "/tmp/ckpt"}, "run spec checkpoint_dir '/tmp/ckpt'"),
])
def test_paths_the_pods_cannot_share_are_refused(spec, fields, spec_fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        render(spec.model_copy(update=spec_fields), NAME, config(**fields))


@pytest.mark.parametrize(("fields", "field"), [
    ({"namespace": "Training"}, "namespace"),
    ({"memory_per_node": "64GB"}, "memory_per_node"),
    ({"num_nodes": 0}, "num_nodes"),
    ({"image": ""}, "image"),
    ({"volume_claims": [{"claim_name": "x", "mount_path": "/etc/stoker"}]}, "mount_path"),
    ({"volume_claims": [{"claim_name": "x", "mount_path": "/d"},
                        {"claim_name": "y", "mount_path": "/d/"}]}, "mount paths must differ"),
    ({"flavor": "mpijob"}, "flavor"),
])
def test_bad_config_names_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        KubernetesLaunchConfig(**{"image": IMAGE, **fields})


def test_job_names():
    assert kubernetes_name("3F2A9C01D4E5-20260101T120000Z") == NAME
    assert kubernetes_name("a_b.c") == "stoker-a-b-c"
    assert len(kubernetes_name("x" * 200)) == 58
    with pytest.raises(ConfigError, match="no letters or digits"):
        kubernetes_name("___")
    with pytest.raises(ConfigError, match="job name 'Bad_Name'"):
        render(RunSpec(data_dir="/data/d", job_dir="/jobs/j"), "Bad_Name", config())


def _load_examples_module():
    path = EXAMPLES / "render_examples.py"
    module_spec = importlib.util.spec_from_file_location("render_examples", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_committed_examples_equal_what_the_launcher_renders():
    rendered = _load_examples_module().examples()
    assert sorted(rendered) == ["pytorchjob.yaml", "trainjob.yaml"]
    for file_name, text in rendered.items():
        committed = (EXAMPLES / file_name).read_text()
        assert committed == text, (f"{file_name} is stale: run PYTHONPATH=. python "
                                   "infra/kubernetes/examples/render_examples.py")
        docs = list(yaml.safe_load_all(committed))
        assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob" if "train" in file_name
                                             else "PyTorchJob"]
        check_manifest(docs[0])
        assert_valid(docs[1])


def test_example_spec_is_a_valid_run_spec(tmp_path):
    docs = list(yaml.safe_load_all((EXAMPLES / "trainjob.yaml").read_text()))
    (tmp_path / "spec.yaml").write_text(docs[0]["data"]["spec.yaml"])
    assert RunSpec.load(tmp_path / "spec.yaml").checkpoint_dir.startswith("s3://")


def test_args_never_drop_the_spec_path(spec):
    for flavor in ("trainjob", "pytorchjob"):
        _, container = pod_of(render(spec, NAME, config(flavor=flavor))[1])
        assert container["args"][-3:] == ["-m", "stoker.runtime", SPEC_PATH]
