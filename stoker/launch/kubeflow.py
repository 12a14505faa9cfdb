"""Multi-node training on Kubernetes: render a Kubeflow TrainJob or PyTorchJob for a run spec.

No Prefect here. Every pod runs the training image's entrypoint, ``python -m stoker.runtime.launch``
(torchrun with Stoker's exit codes), on the run spec mounted from a ConfigMap at
``/etc/stoker/spec.yaml``. Two flavors:

* ``trainjob``: Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1`` TrainJob referencing a
  (Cluster)TrainingRuntime such as ``torch-distributed``). The Trainer's torch plugin sets
  ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
  ``PET_MASTER_PORT``, which torchrun reads. Pod settings go through ``spec.runtimePatches``.
* ``pytorchjob``: the Kubeflow Training Operator v1 (``kubeflow.org/v1`` PyTorchJob) with an
  ``elasticPolicy``: the operator sets ``PET_RDZV_ENDPOINT`` (``<job>-worker-0:23456``),
  ``PET_RDZV_BACKEND=c10d`` and ``PET_NNODES``; every pod is a Worker.

Every attempt ends the whole job (torchrun ``--max-restarts=0``, PyTorchJob ``restartPolicy:
Never``): the caller resubmits the same manifests to resume (see ``stoker.launch.kubernetes``), so
preemptions, infrastructure failures and user errors keep their separate retry budgets.
``render`` checks every object against Kubeflow's and Kubernetes' own API models
(``stoker.launch.api_models``) before anything is submitted.
"""

from __future__ import annotations

import logging
import re

import yaml

from stoker.config import ConfigError
from stoker.launch.api_models import check_manifest
from stoker.launch.kubernetes_config import (  # noqa: F401 - re-exported: the launcher's settings
    DNS_LABEL,
    GPU_TOLERATION,
    ON_DEMAND_NODE_LABELS,
    SECRET_NAME,
    SHM_DIR,
    SPEC_DIR,
    SPOT_NODE_LABELS,
    SPOT_TOLERATIONS,
    KubernetesLaunchConfig,
    Toleration,
    VolumeClaim,
)
from stoker.ownership import DOCKER_JOB_LABEL, DOCKER_OWNER_LABEL
from stoker.runtime.spec import RunSpec

log = logging.getLogger(__name__)

# The label values are valid Kubernetes label keys too; the cost guard finds pods by them.
OWNER_LABEL = DOCKER_OWNER_LABEL
JOB_LABEL = DOCKER_JOB_LABEL

SPEC_KEY = "spec.yaml"
SPEC_PATH = f"{SPEC_DIR}/{SPEC_KEY}"
TRAINJOB_NODE = "node"  # replicated job and container name in Kubeflow's torch runtimes
PYTORCH_CONTAINER = "pytorch"  # the operator looks up this container and port name
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_PORT = 23456
PATCH_MANAGER = "dev.stoker/kubernetes-launcher"
# Seconds a pod keeps after SIGTERM beyond the runtime's preemption grace (checkpoint upload).
TERMINATION_MARGIN_S = 15

def kubernetes_name(job_id: str) -> str:
    """A job name Kubernetes and the Trainer accept (RFC 1035 label, at most 63 characters).

    ``job_id`` (a Stoker job folder name such as ``3f2a9c01d4e5-20260101T120000Z``) is lowercased,
    other characters become ``-`` and it is prefixed with ``stoker-``; the ConfigMap adds
    ``-spec`` (so the name is cut to 58 characters).
    """
    text = re.sub(r"[^a-z0-9-]+", "-", job_id.lower()).strip("-")
    if not text:
        raise ConfigError(f"job id {job_id!r}: has no letters or digits")
    return f"stoker-{text}"[:58].rstrip("-")


def configmap_name(name: str) -> str:
    return f"{name}-spec"


# Environment names that hold credentials (AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD, ...).


def pod_spec(spec: RunSpec, config: KubernetesLaunchConfig) -> RunSpec:
    """The run spec as the pods see it: ``checkpoint_dir`` from ``config`` when it sets one.

    Raises:
        ConfigError: ``data_dir``, ``job_dir`` or a checkpoint path is not on a volume claim
            (or the job folder or checkpoints are on a read-only one), so pods could not share
            them and a resumed job would not find its checkpoints. Checkpoints in an object
            store without ``credentials_secret`` or ``service_account`` are warned about (a
            node's instance role may still reach the bucket).
    """
    if config.checkpoint_dir:
        spec = spec.model_copy(update={"checkpoint_dir": config.checkpoint_dir})
    needs = {"data_dir": (spec.data_dir, False), "job_dir": (spec.job_dir, True)}
    if "://" not in spec.checkpoint_location:
        needs["checkpoint_dir"] = (spec.checkpoint_location, True)
    elif not (config.credentials_secret or config.service_account):
        log.warning("checkpoint_dir %s: the pods get no bucket credentials (no launcher."
                    "kubernetes.credentials_secret or service_account): only a node's own "
                    "role can reach the bucket", spec.checkpoint_location)
    for field, (path, writable) in needs.items():
        claim = _claim_for(path, config.volume_claims)
        if claim is None:
            mounts = [c.mount_path for c in config.volume_claims] or "none"
            raise ConfigError(f"run spec {field} {path!r}: not under a volume claim mount "
                              f"(kubernetes.volume_claims mount paths: {mounts})")
        if writable and claim.read_only:
            raise ConfigError(f"run spec {field} {path!r}: volume claim {claim.claim_name} is "
                              "read-only")
    return spec


def _claim_for(path: str, claims: list[VolumeClaim]) -> VolumeClaim | None:
    for claim in claims:
        if path == claim.mount_path or path.startswith(claim.mount_path + "/"):
            return claim
    return None


def render_spec_configmap(spec: RunSpec, name: str, config: KubernetesLaunchConfig) -> dict:
    """The ConfigMap ``<name>-spec`` holding the pods' run spec (key ``spec.yaml``).

    Raises:
        ConfigError: see ``pod_spec``.
    """
    text = yaml.safe_dump(pod_spec(spec, config).model_dump(mode="json"), sort_keys=False)
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": configmap_name(name), "namespace": config.namespace,
                     "labels": _labels(name, config)},
        "data": {SPEC_KEY: text},
    }


def _labels(name: str, config: KubernetesLaunchConfig) -> dict[str, str]:
    return {**config.labels, OWNER_LABEL: "true", JOB_LABEL: name}


def _command(spec: RunSpec, config: KubernetesLaunchConfig) -> tuple[list[str], list[str]]:
    """Entrypoint and torchrun arguments; nodes, rank and rendezvous come from PET_* variables."""
    args = [f"--nproc-per-node={config.procs_per_node}", "--max-restarts=0",
            f"--shutdown-timeout={int(spec.train.preemption_grace_s)}",
            "-m", "stoker.runtime", SPEC_PATH]
    return ["python", "-m", "stoker.runtime.launch"], args


def _env(config: KubernetesLaunchConfig) -> list[dict]:
    env = [{"name": k, "value": v} for k, v in sorted(config.env.items())]
    if config.credentials_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {
            "name": config.credentials_secret, "key": key, "optional": True}}}
            for key in config.credentials_keys if key not in config.env]
    return env


def _volumes(name: str, config: KubernetesLaunchConfig) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "stoker-spec", "configMap": {"name": configmap_name(name)}}]
    mounts = [{"name": "stoker-spec", "mountPath": SPEC_DIR, "readOnly": True}]
    if config.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": config.shm_size}})
        mounts.append({"name": "dshm", "mountPath": SHM_DIR})
    for i, claim in enumerate(config.volume_claims):
        volumes.append({"name": f"claim-{i}", "persistentVolumeClaim": {
            "claimName": claim.claim_name, "readOnly": claim.read_only}})
        mounts.append({"name": f"claim-{i}", "mountPath": claim.mount_path,
                       "readOnly": claim.read_only})
    return volumes, mounts


def _resources(config: KubernetesLaunchConfig) -> dict:
    resources: dict = {}
    if config.gpus_per_node:
        # Extended resources are set as limits; the request defaults to the limit.
        resources["limits"] = {config.gpu_resource: str(config.gpus_per_node)}
    requests = {k: v for k, v in (("cpu", config.cpu_per_node),
                                  ("memory", config.memory_per_node)) if v}
    if requests:
        resources["requests"] = requests
    return resources


def node_selector(config: KubernetesLaunchConfig) -> dict[str, str]:
    """The capacity-type label of ``config.node_pool`` (if any) overridden by ``node_selector``."""
    presets = SPOT_NODE_LABELS if config.capacity_type == "spot" else ON_DEMAND_NODE_LABELS
    return {**presets.get(config.node_pool or "", {}), **config.node_selector}


def tolerations(config: KubernetesLaunchConfig) -> list[dict]:
    """``config.tolerations`` if set, else spot tolerations (spot) plus the GPU one (GPUs)."""
    if config.tolerations is not None:
        chosen = list(config.tolerations)
    else:
        chosen = list(SPOT_TOLERATIONS) if config.capacity_type == "spot" else []
        chosen += [GPU_TOLERATION] if config.gpus_per_node else []
    return [t.manifest() for t in chosen]


def _scheduling(config: KubernetesLaunchConfig) -> dict:
    pod: dict = {}
    if selector := node_selector(config):
        pod["nodeSelector"] = selector
    if tols := tolerations(config):
        pod["tolerations"] = tols
    if config.service_account:
        pod["serviceAccountName"] = config.service_account
    return pod


def render_pytorchjob(spec: RunSpec, name: str, config: KubernetesLaunchConfig) -> dict:
    """A ``kubeflow.org/v1`` PyTorchJob: ``num_nodes`` elastic Workers, c10d rendezvous.

    Raises:
        ConfigError: see ``pod_spec``.
    """
    pod_spec(spec, config)
    command, args = _command(spec, config)
    volumes, mounts = _volumes(name, config)
    container = {
        "name": PYTORCH_CONTAINER, "image": config.image,
        "imagePullPolicy": config.image_pull_policy, "command": command, "args": args,
        "ports": [{"name": PYTORCH_PORT_NAME, "containerPort": PYTORCH_PORT}],
        "resources": _resources(config), "volumeMounts": mounts,
    }
    if env := _env(config):
        container["env"] = env
    pod = {"containers": [container], "volumes": volumes, **_scheduling(config),
           "terminationGracePeriodSeconds":
               int(spec.train.preemption_grace_s) + TERMINATION_MARGIN_S}
    run_policy: dict = {"backoffLimit": 0, "cleanPodPolicy": "Running"}
    if config.active_deadline_s:
        run_policy["activeDeadlineSeconds"] = config.active_deadline_s
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": config.namespace,
                     "labels": _labels(name, config)},
        "spec": {
            "runPolicy": run_policy,
            "nprocPerNode": str(config.procs_per_node),
            "elasticPolicy": {"rdzvBackend": "c10d", "rdzvId": name,
                              "minReplicas": config.num_nodes, "maxReplicas": config.num_nodes,
                              "maxRestarts": 0},
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": config.num_nodes, "restartPolicy": "Never",
                "template": {"metadata": {"labels": _labels(name, config)}, "spec": pod},
            }},
        },
    }


def render_trainjob(spec: RunSpec, name: str, config: KubernetesLaunchConfig) -> dict:
    """A ``trainer.kubeflow.org/v1alpha1`` TrainJob on runtime ``config.runtime_ref``.

    Image, command, environment, node count and resources go in ``spec.trainer``; volumes,
    scheduling and the service account in a ``runtimePatches`` entry for the ``node`` job.
    The pod termination grace period is the runtime's (the patch API has no field for it).

    Raises:
        ConfigError: see ``pod_spec``.
    """
    pod_spec(spec, config)
    command, args = _command(spec, config)
    volumes, mounts = _volumes(name, config)
    trainer: dict = {"image": config.image, "command": command, "args": args,
                     "numNodes": config.num_nodes, "numProcPerNode": config.procs_per_node,
                     "resourcesPerNode": _resources(config)}
    if env := _env(config):
        trainer["env"] = env
    pod_patch = {"containers": [{"name": TRAINJOB_NODE, "volumeMounts": mounts}],
                 "volumes": volumes, **_scheduling(config)}
    job_spec: dict = {
        "runtimeRef": {"name": config.runtime_ref, "apiGroup": "trainer.kubeflow.org",
                       "kind": config.runtime_kind},
        "trainer": trainer,
        "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {
            "spec": {"replicatedJobs": [{"name": TRAINJOB_NODE, "template": {"spec": {
                "template": {"metadata": {"labels": _labels(name, config)},
                             "spec": pod_patch}}}}]}}}}],
    }
    if config.active_deadline_s:
        job_spec["activeDeadlineSeconds"] = config.active_deadline_s
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": config.namespace,
                     "labels": _labels(name, config)},
        "spec": job_spec,
    }


def render(spec: RunSpec, name: str, config: KubernetesLaunchConfig) -> list[dict]:
    """The manifests to apply, in order: the spec ConfigMap, then the job of ``config.flavor``.

    Raises:
        ConfigError: ``name`` is not an RFC 1035 label of at most 58 characters, an object
            does not parse with its API model (see ``check_manifest``), or see ``pod_spec``.
    """
    if not DNS_LABEL.match(name) or len(name) > 58:
        raise ConfigError(f"job name {name!r}: must be lowercase letters, digits and '-', "
                          "start with a letter and have at most 58 characters "
                          "(use kubernetes_name())")
    job = (render_trainjob if config.flavor == "trainjob" else render_pytorchjob)(
        spec, name, config)
    manifests = [render_spec_configmap(spec, name, config), job]
    for manifest in manifests:
        check_manifest(manifest)
    return manifests
