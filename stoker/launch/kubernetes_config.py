"""The ``launcher.kubernetes`` settings (validated when the config is read) and the node labels
and tolerations of spot and on-demand capacity, by node pool provider. Rendering is in
:mod:`stoker.launch.kubeflow`."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from stoker.config import _Frozen

SPEC_DIR = "/etc/stoker"  # the run spec's ConfigMap mount
SHM_DIR = "/dev/shm"

# Node labels of spot / preemptible capacity, by node pool provider (each set by the provider
# or its autoscaler on every such node).
SPOT_NODE_LABELS: dict[str, dict[str, str]] = {
    "gke": {"cloud.google.com/gke-spot": "true"},
    "eks": {"eks.amazonaws.com/capacityType": "SPOT"},
    "karpenter": {"karpenter.sh/capacity-type": "spot"},
    "aks": {"kubernetes.azure.com/scalesetpriority": "spot"},
}
# GKE and AKS mark only spot nodes, so on-demand capacity has no selector there.
ON_DEMAND_NODE_LABELS: dict[str, dict[str, str]] = {
    "eks": {"eks.amazonaws.com/capacityType": "ON_DEMAND"},
    "karpenter": {"karpenter.sh/capacity-type": "on-demand"},
}
_QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123 label
# An env variable name that holds a credential (never inline in a job manifest).
SECRET_NAME = re.compile(r"(?i)(SECRET|PASSWORD|TOKEN|ACCESS_KEY|CREDENTIAL)")


class Toleration(_Frozen):
    """A pod toleration (Kubernetes ``core/v1`` Toleration)."""

    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    def manifest(self) -> dict:
        return self.model_dump(exclude_none=True)


# Taints that spot node pools commonly carry: AKS always taints spot nodes; GKE and Karpenter
# pools are often tainted by their operators with these keys. A toleration without its taint
# does nothing, so all are safe to add.
SPOT_TOLERATIONS = (
    Toleration(key="cloud.google.com/gke-spot", value="true", effect="NoSchedule"),
    Toleration(key="kubernetes.azure.com/scalesetpriority", value="spot", effect="NoSchedule"),
    Toleration(key="karpenter.sh/capacity-type", value="spot", effect="NoSchedule"),
)
# GKE taints GPU nodes with nvidia.com/gpu=present:NoSchedule; many EKS GPU pools do the same.
GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


class VolumeClaim(_Frozen):
    """A PersistentVolumeClaim mounted into every training pod."""

    claim_name: str = Field(description="Name of an existing PVC in the job's namespace.")
    mount_path: str = Field(description="Absolute mount path inside the container.")
    read_only: bool = False

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") in ("", SPEC_DIR, SHM_DIR):
            raise ValueError(f"must be an absolute path other than /, {SPEC_DIR}, {SHM_DIR}")
        return value.rstrip("/")


class KubernetesLaunchConfig(_Frozen):
    """Where and how the training job runs on a cluster that already has the Kubeflow operator."""

    namespace: str = Field("default", description="Namespace of the job, ConfigMap and PVCs.")
    flavor: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob", description="Kubeflow Trainer TrainJob, or PyTorchJob (Training Operator v1).")
    image: str = Field(min_length=1, description="Training image (a digest reference is best).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    num_nodes: int = Field(1, ge=1, description="Pods (nodes) in the job.")
    gpus_per_node: int = Field(1, ge=0, description="GPUs requested by each pod.")
    nproc_per_node: int | None = Field(
        None, gt=0, description="Processes per pod; empty: gpus_per_node (1 without GPUs).")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name of a GPU.")
    cpu_per_node: str | None = Field(None, description="CPU request per pod (quantity, '8').")
    memory_per_node: str | None = Field(None, description="Memory request per pod ('64Gi').")
    shm_size: str | None = Field(
        "8Gi", description="Size of the in-memory /dev/shm (DataLoader workers, NCCL); empty: "
        "the container runtime's default (often 64 MB).")
    capacity_type: Literal["spot", "on_demand"] = Field(
        "spot", description="Node capacity: spot adds SPOT_TOLERATIONS and the spot selector.")
    node_pool: Literal["gke", "eks", "karpenter", "aks"] | None = Field(
        None, description="Provider whose capacity-type node label to select on; empty: none.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra node labels to require (override presets).")
    tolerations: list[Toleration] | None = Field(
        None, description="Pod tolerations; empty: the defaults for capacity type and GPUs.")
    service_account: str | None = Field(None, description="Service account of the pods.")
    volume_claims: list[VolumeClaim] = Field(
        default_factory=list, description="PVCs holding the dataset and the job folder.")
    credentials_secret: str | None = Field(
        None, description="Secret whose credentials_keys become environment variables.")
    credentials_keys: list[str] = Field(
        default_factory=lambda: ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                 "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL",
                                 "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"],
        description="Keys read from credentials_secret (each optional).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables.")
    checkpoint_dir: str | None = Field(
        None, description="Checkpoint location for the pods: an object-store URL "
        "(s3://bucket/job) or a path on a writable volume claim; empty: the spec's.")
    runtime_ref: str = Field("torch-distributed", description="TrainJob: runtime name.")
    runtime_kind: Literal["ClusterTrainingRuntime", "TrainingRuntime"] = "ClusterTrainingRuntime"
    active_deadline_s: int | None = Field(None, ge=1, description="Kill the job after this long.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels (job, pods).")

    @field_validator("namespace")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not DNS_LABEL.match(value) or len(value) > 63:
            raise ValueError("must be a DNS label: lowercase letters, digits and '-', at most 63")
        return value

    @field_validator("cpu_per_node", "memory_per_node", "shm_size")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not _QUANTITY.match(value):
            raise ValueError("must be a Kubernetes quantity such as '8', '500m' or '64Gi'")
        return value

    @model_validator(mode="after")
    def _check(self) -> KubernetesLaunchConfig:
        paths = [c.mount_path for c in self.volume_claims]
        if len(set(paths)) != len(paths):
            raise ValueError(f"volume_claims: mount paths must differ, got {paths}")
        if self.credentials_secret and not self.credentials_keys:
            raise ValueError("credentials_keys must not be empty when credentials_secret is set")
        inline = sorted(k for k in self.env if SECRET_NAME.search(k))
        if inline:
            raise ValueError(f"env.{inline[0]}: credentials never go inline into the job "
                             "manifest; put them in the Secret named by credentials_secret")
        return self

    @property
    def procs_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1
