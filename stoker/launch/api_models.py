"""Check rendered Kubernetes objects against the API models of the projects that define them.

No Prefect here. Kubeflow's own Python models are the schema, so nothing is copied:

* ``TrainJob`` and ``ClusterTrainingRuntime`` (``trainer.kubeflow.org/v1alpha1``): the pydantic
  models of ``kubeflow-trainer-api``;
* ``PyTorchJob`` (``kubeflow.org/v1``): the OpenAPI models of ``kubeflow-training`` (the Training
  Operator v1 SDK); its pod templates and object metadata are ``kubernetes`` client models;
* ``ConfigMap``: the ``kubernetes`` client's ``V1ConfigMap``.

A field the model does not know, a value of the wrong JSON type, or a missing required field is
an error naming the field's path (``PyTorchJob spec.runPolicy.backofLimit: unknown field``). What
the models cannot express (value ranges, CEL rules, the operators' webhooks) is not checked
here. The packages are in the ``kubernetes`` extra and imported on first use.
"""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import re
from functools import cache
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ValidationError

from stoker.config import ConfigError

# kind -> (module, class) of the model that parses a whole object of that kind.
MODELS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("kubernetes.client", "V1ConfigMap"),
    "TrainJob": ("kubeflow_trainer_api.models", "TrainerV1alpha1TrainJob"),
    "ClusterTrainingRuntime": ("kubeflow_trainer_api.models",
                               "TrainerV1alpha1ClusterTrainingRuntime"),
    "PyTorchJob": ("kubeflow.training.models", "KubeflowOrgV1PyTorchJob"),
}
EXTRA_HINT = "pip install 'stoker[kubernetes]'"
# Type names of the OpenAPI (non-pydantic) models of kubeflow-training, in both spellings the
# generator has used: list[X] / List[X], dict(str, X) / Dict[str, X].
_LIST = re.compile(r"(?:list|List)\[(?P<item>.+)\]")
_DICT = re.compile(r"(?:dict\(str, (?P<a>.+)\)|Dict\[str, (?P<b>.+)\])")
_PRIMITIVES: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "float": (int, float), "bool": bool, "object": object,
    "datetime": str, "date": str,  # RFC 3339 text in a manifest
}


def check_manifest(manifest: dict) -> None:
    """Parse ``manifest`` with the API model of its ``kind`` and refuse what the model refuses.

    Raises:
        ConfigError: the kind has no model here, a model package is not installed, or a field
            is unknown, of the wrong type or missing; the message names the field's path.
    """
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind not in MODELS:
        raise ConfigError(f"manifest kind {kind!r}: no API model to check it against "
                          f"(known: {', '.join(MODELS)})")
    module_name, class_name = MODELS[kind]
    models = _models(module_name)
    _check_openapi(manifest, class_name, kind, models)


@cache
def _models(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{module_name} is needed to check Kubernetes manifests: "
                          f"{EXTRA_HINT}") from e


def _check_pydantic(model: type[BaseModel], value: Any, path: str) -> None:
    """``model.from_dict`` (the generated parser) must accept ``value`` and keep all of it."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected an object, got {_shown(value)}")
    try:
        parsed = model.from_dict(value)
    except (ValidationError, ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {_pydantic_reason(e)}") from e
    # The generated parsers drop fields they do not know: a round trip shows them.
    # The kubernetes client's to_dict() has Python names unless serialize=True (API names).
    takes_serialize = "serialize" in inspect.signature(parsed.to_dict).parameters
    kept = parsed.to_dict(serialize=True) if takes_serialize else parsed.to_dict()
    _same(value, kept, path)


def _pydantic_reason(error: Exception) -> str:
    if not isinstance(error, ValidationError) or not error.errors():
        return str(error).splitlines()[0]
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return (f"{error.title}.{where}: {first['msg']}, got {_shown(first.get('input'))}"
            if where else f"{error.title}: {first['msg']}")


def _same(given: Any, kept: Any, path: str) -> None:
    if isinstance(given, dict) and isinstance(kept, dict):
        for key, item in given.items():
            if kept.get(key) is None and item is not None:
                raise ConfigError(f"{path}.{key}: unknown field")
            _same(item, kept.get(key), f"{path}.{key}")
    elif isinstance(given, list) and isinstance(kept, list) and len(given) == len(kept):
        for i, (item, kept_item) in enumerate(zip(given, kept, strict=True)):
            _same(item, kept_item, f"{path}[{i}]")
    elif isinstance(kept, dt.date) and isinstance(given, str):
        return  # an RFC 3339 time the model parsed
    elif given != kept or type(given) is not type(kept):
        raise ConfigError(f"{path}: {_shown(given)} is not accepted as given (read as "
                          f"{_shown(kept)})")


def _check_openapi(value: Any, type_name: str, path: str, models: ModuleType) -> None:
    """Check ``value`` against the type named ``type_name`` in ``models``: pydantic models
    parse it; OpenAPI-generator (non-pydantic) models are walked by their ``openapi_types``."""
    if match := _LIST.fullmatch(type_name):
        _expect(value, list, path, "a list")
        for i, item in enumerate(value):
            _check_openapi(item, match["item"], f"{path}[{i}]", models)
    elif match := _DICT.fullmatch(type_name):
        _expect(value, dict, path, "an object")
        for key, item in value.items():
            _check_openapi(item, match["a"] or match["b"], f"{path}.{key}", models)
    elif type_name in _PRIMITIVES:
        if isinstance(value, bool) and type_name in ("int", "float"):
            raise ConfigError(f"{path}: expected {type_name}, got {_shown(value)}")
        _expect(value, _PRIMITIVES[type_name], path, type_name)
    else:
        model = getattr(models, type_name)
        if issubclass(model, BaseModel):  # kubernetes client models (pod template, metadata)
            _check_pydantic(model, value, path)
        else:
            _check_openapi_model(model, value, path, models)


def _check_openapi_model(model: type, value: Any, path: str, models: ModuleType) -> None:
    _expect(value, dict, path, "an object")
    attrs = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, item in value.items():
        if key not in attrs:
            raise ConfigError(f"{path}.{key}: unknown field")
        _check_openapi(item, model.openapi_types[attrs[key]], f"{path}.{key}", models)
    try:  # the generated setters refuse missing required fields and values off an enum
        model(**{attrs[key]: item for key, item in value.items()})
    except ValueError as e:
        attr = re.search(r"`(\w+)`", str(e))
        field = model.attribute_map.get(attr[1], attr[1]) if attr else "?"
        raise ConfigError(f"{path}.{field}: {e}") from e


def _expect(value: Any, kind: type | tuple[type, ...], path: str, what: str) -> None:
    if not isinstance(value, kind):
        raise ConfigError(f"{path}: expected {what}, got {_shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
