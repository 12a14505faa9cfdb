"""Write the example manifests in this folder from Stoker's renderer.

    PYTHONPATH=. python infra/kubernetes/examples/render_examples.py

tests/test_kubernetes.py checks that the committed files equal what this renders, so they are
always what the launcher submits for EXAMPLE_CONFIG and EXAMPLE_SPEC, and that every object
parses with Kubeflow's and Kubernetes' own API models (``render`` checks them too).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from stoker.config import TrainConfig
from stoker.launch.kubeflow import KubernetesLaunchConfig, VolumeClaim, kubernetes_name, render
from stoker.runtime.spec import RunSpec

HERE = Path(__file__).parent
JOB_ID = "3f2a9c01d4e5-20260101T120000000000Z"
EXAMPLE_SPEC = RunSpec(
    train=TrainConfig(model="resnet50", epochs=30, global_batch_size=1024, precision="bf16",
                      deterministic=False, num_workers=8, checkpoint_every_s=600),
    data_dir="/data/datasets/0123456789abcdef0123456789abcdef", job_dir=f"/jobs/{JOB_ID}",
    tracking_uri="http://mlflow.stoker.svc.cluster.local:5000", experiment="stoker",
    run_name=JOB_ID, tags={"dvc.rev": "v1", "dvc.md5": "0123456789abcdef0123456789abcdef"},
)
EXAMPLE_CONFIG = KubernetesLaunchConfig(
    namespace="stoker",
    image="registry.example.com/stoker/train@sha256:" + "ab" * 32,
    num_nodes=2, gpus_per_node=8, cpu_per_node="64", memory_per_node="512Gi", shm_size="64Gi",
    capacity_type="spot", node_pool="karpenter", service_account="stoker-training",
    volume_claims=[VolumeClaim(claim_name="stoker-datasets", mount_path="/data", read_only=True),
                   VolumeClaim(claim_name="stoker-jobs", mount_path="/jobs")],
    credentials_secret="stoker-object-store",
    checkpoint_dir=f"s3://stoker-checkpoints/{JOB_ID}",
    env={"NCCL_DEBUG": "WARN"},
)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the run spec) as literal blocks, so the example reads as YAML."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def examples() -> dict[str, str]:
    """File name -> YAML text (the spec ConfigMap and the job, as two documents)."""
    name = kubernetes_name(JOB_ID)
    out = {}
    for flavor in ("trainjob", "pytorchjob"):
        config = EXAMPLE_CONFIG.model_copy(update={"flavor": flavor})
        docs = render(EXAMPLE_SPEC, name, config)
        out[f"{flavor}.yaml"] = (f"# Rendered by infra/kubernetes/examples/render_examples.py "
                                 f"(flavor {flavor}); do not edit.\n"
                                 + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False))
    return out


if __name__ == "__main__":
    for file_name, text in examples().items():
        (HERE / file_name).write_text(text)
        print(f"wrote {HERE / file_name}")
