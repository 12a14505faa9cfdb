"""Load a registered Stoker classifier without running anything the model ships.

``mlflow.pyfunc.load_model`` runs the model's code (a "model from code" file and its
``code_paths``) or unpickles its CloudPickle object: a model registered by anyone with write
access to the registry would run on the reader's machine. ``stoker predict`` instead downloads
the model's files, checks its ``MLmodel`` file before anything is loaded (one
``python_function`` flavor, no pickled Python model, Stoker's ``stoker`` metadata, a weights
and a meta artifact), and builds the classifier from the *installed* Stoker with the weights
loaded data-only (``torch.load(..., weights_only=True)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from stoker.tracking.pyfunc import ImageClassifier


class UnsafeModelError(ValueError):
    """The model is not a Stoker classifier Stoker can load as data only."""


def check_mlmodel(mlmodel: dict, model_uri: str) -> dict[str, str]:
    """Check an ``MLmodel`` file's content before anything of the model is loaded.

    Args:
        mlmodel: the parsed ``MLmodel`` YAML.
        model_uri: the model's URI, for the message.

    Returns:
        The ``python_function`` flavor's artifacts: name -> path inside the model folder.

    Raises:
        UnsafeModelError: another flavor, a pickled Python model, no Stoker metadata, or a
            missing weights/meta artifact (the message names which).
    """
    flavors = mlmodel.get("flavors") or {}
    if set(flavors) != {"python_function"}:
        raise UnsafeModelError(f"{model_uri}: flavors {sorted(flavors)}; a Stoker classifier has "
                               "python_function only")
    flavor = flavors["python_function"] or {}
    pickled = flavor.get("python_model")  # a model from code records model_code_path instead
    if pickled or "model_code_path" not in flavor:
        raise UnsafeModelError(f"{model_uri}: a pickled Python model ({pickled or 'no code'}); "
                               "Stoker loads no pickled model")
    if not isinstance((mlmodel.get("metadata") or {}).get("stoker"), dict):
        raise UnsafeModelError(f"{model_uri}: not a Stoker classifier (no 'stoker' metadata)")
    artifacts = {name: (spec or {}).get("path") for name, spec in
                 (flavor.get("artifacts") or {}).items()}
    for name in ("weights", "meta"):
        path = artifacts.get(name)
        if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
            raise UnsafeModelError(f"{model_uri}: no usable '{name}' artifact")
    return artifacts


def fetch_model(model_uri: str, dst: Path) -> tuple[Path, dict[str, str], dict]:
    """Download ``model_uri`` into ``dst`` and check its ``MLmodel`` file; nothing of the model
    is loaded (no torch either: a caller can refuse its input first).

    Args:
        model_uri: an MLflow model URI (``models:/name@alias``, ``runs:/...``).
        dst: an empty folder for the model's files.

    Returns:
        (the model's folder, its artifacts: name -> path inside it, the ``stoker`` metadata of
        its MLmodel file).

    Raises:
        UnsafeModelError: the model fails ``check_mlmodel``.
        mlflow.exceptions.MlflowException: the store has no such model.
    """
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    artifacts = check_mlmodel(mlmodel, model_uri)
    return local, artifacts, mlmodel["metadata"]["stoker"]


def load_fetched(model_uri: str, local: Path, artifacts: dict[str, str]) -> ImageClassifier:
    """The classifier of a model :func:`fetch_model` checked, its weights loaded data-only.

    Raises:
        UnsafeModelError: its weights name a type outside tensors and plain types, or cannot
            be read.
    """
    classifier = ImageClassifier()
    context = type("Context", (), {"artifacts": {
        name: str(local / path) for name, path in artifacts.items()}})()
    try:
        classifier.load_context(context)
    except Exception as e:  # the weights-only unpickler names the refused type
        raise UnsafeModelError(f"{model_uri}: weights refused or unreadable "
                               f"({str(e).splitlines()[-1][:200]})") from e
    json.loads(Path(context.artifacts["meta"]).read_text())  # the class list is readable
    return classifier


def load_classifier(model_uri: str, dst: Path) -> tuple[ImageClassifier, dict]:
    """Download ``model_uri`` into ``dst``, check it, and load it data-only
    (:func:`fetch_model`, then :func:`load_fetched`).

    Returns:
        (the classifier, the ``stoker`` metadata of its MLmodel file).

    Raises:
        UnsafeModelError, mlflow.exceptions.MlflowException: as those two.
    """
    local, artifacts, meta = fetch_model(model_uri, dst)
    return load_fetched(model_uri, local, artifacts), meta
