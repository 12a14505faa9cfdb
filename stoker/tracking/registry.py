"""Register a trained model in MLflow and move aliases through a promotion gate.

Registry stages are deprecated in MLflow: Stoker uses aliases only. Every new version gets
``challenger``; ``champion`` moves to it only when its ``promote_metric`` beats the current
champion's (the first version becomes champion).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.data.pull import DatasetRef

CHALLENGER = "challenger"
CHAMPION = "champion"


@dataclass(frozen=True)
class Registration:
    """Outcome of registering one model version.

    Attributes:
        name, version: the registered model and its new version.
        metric, value: the promotion metric and the new version's value.
        promoted: whether ``champion`` now points at the new version.
        previous_champion, previous_value: the version (and value) that held ``champion`` before.
        model_uri: ``models:/<name>/<version>``.
    """

    name: str
    version: str
    metric: str
    value: float
    promoted: bool
    previous_champion: str | None
    previous_value: float | None
    model_uri: str

    def to_dict(self) -> dict:
        return asdict(self)


def beats(new: float, old: float | None, direction: str) -> bool:
    """Whether ``new`` is strictly better than ``old`` (None: nothing to beat)."""
    if old is None:
        return True
    return new > old if direction == "max" else new < old


def pip_requirements() -> list[str]:
    """Exact requirements of a logged model, without local version suffixes (``+cu121``)."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in ("mlflow", "torch", "numpy")]


def log_and_register(tracking_uri: str, run_id: str, registered_model: str, model, input_example,
                     tags: dict[str, str], metric: str, value: float,
                     direction: str = "max") -> Registration:
    """Log ``model`` to run ``run_id``, register it, tag it and apply the promotion gate.

    Args:
        model: a torch.nn.Module in eval mode; ``input_example`` a float32 array it accepts
            ([N, C, H, W]); the signature is inferred from it and the model's output logits.
        tags: lineage tags set on the model version.
        metric, value, direction: promotion metric, the new model's value, "max" or "min".

    Raises:
        mlflow.exceptions.MlflowException: the tracking server or registry rejected a call.
    """
    import mlflow
    import torch
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.models import infer_signature

    import stoker

    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri)
    with torch.no_grad():
        output = model(torch.as_tensor(input_example)).numpy()
    existing = client.search_model_versions(f"name='{registered_model}' and run_id='{run_id}'")
    if existing:  # an earlier, interrupted registration of this run: finish that version
        version = str(max(int(v.version) for v in existing))
    else:
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pytorch.log_model(
                model, name="model", signature=infer_signature(input_example, output),
                input_example=input_example, pip_requirements=pip_requirements(),
                code_paths=[str(Path(stoker.__file__).parent)],
                registered_model_name=registered_model,
            )
        version = str(info.registered_model_version)
    # Only completed training is registered: reopening the run must leave it FINISHED, also
    # when an earlier interrupted registration left it FAILED.
    client.set_terminated(run_id, status="FINISHED")
    for key, tag in tags.items():
        client.set_model_version_tag(registered_model, version, key, tag)
    client.set_model_version_tag(registered_model, version, metric, str(value))
    client.set_registered_model_alias(registered_model, CHALLENGER, version)

    previous, previous_value = None, None
    try:
        champion = client.get_model_version_by_alias(registered_model, CHAMPION)
        previous = str(champion.version)
        previous_value = client.get_run(champion.run_id).data.metrics.get(metric)
    except MlflowException:
        pass  # no champion yet
    promoted = beats(value, previous_value, direction)
    if promoted:
        client.set_registered_model_alias(registered_model, CHAMPION, version)
    return Registration(registered_model, version, metric, value, promoted, previous,
                        previous_value, f"models:/{registered_model}/{version}")


def load_trained_model(result: dict):
    """Rebuild the trained module from ``result.json`` fields and its final weights (eval mode)."""
    import torch

    from stoker.runtime.models import build_model

    model = build_model(result["model"], result["num_classes"], result["input_shape"][0])
    model.load_state_dict(torch.load(result["model_path"], map_location="cpu"), strict=True)
    return model.eval()


def input_example(dataset: DatasetRef, count: int = 4):
    """The first ``count`` images of the dataset as float32 [count, C, H, W] in [0, 1]."""
    from stoker.runtime.data import load_image_folder

    images, _labels, _classes = load_image_folder(Path(dataset.local_path))
    return images[:count].numpy()
