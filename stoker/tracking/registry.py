"""Register a trained model in MLflow and move aliases through a promotion gate.

Registry stages are deprecated in MLflow: Stoker uses aliases only. Every new version gets
``challenger``; ``champion`` moves to it only when its ``promote_metric`` beats the current
champion's (the first version becomes champion).

A lineage is a class list and an input shape ([C, H, W]); both are tagged on every version
(``stoker.classes``, ``stoker.input_shape``). The gate never compares across lineages: a model
whose lineage differs from the champion's is refused before it is logged (``LineageError``, which
names the field to change), because a 5-class 32x32 model and a 10-class 8x8 model answer different
questions. The read-compare-set of the gate holds a file lock per registered model for sqlite and
file stores, and for any store re-checks after setting (see ``_settle``), so concurrent
registrations end with the best version as champion whatever the interleaving.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.data.pull import DatasetRef

log = logging.getLogger(__name__)

CHALLENGER = "challenger"
CHAMPION = "champion"
CLASSES_TAG = "stoker.classes"
SHAPE_TAG = "stoker.input_shape"


class LineageError(ValueError):
    """The model's classes or input shape differ from the registered model's champion."""


@dataclass(frozen=True)
class Lineage:
    """What a model answers: class names (label order) and input shape [C, H, W]."""

    classes: tuple[str, ...]
    input_shape: tuple[int, ...]

    def tags(self) -> dict[str, str]:
        return {CLASSES_TAG: json.dumps(list(self.classes)),
                SHAPE_TAG: "x".join(str(v) for v in self.input_shape)}

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Lineage | None:
        try:
            return cls(tuple(json.loads(tags[CLASSES_TAG])),
                       tuple(int(v) for v in tags[SHAPE_TAG].split("x")))
        except (KeyError, ValueError, TypeError):
            return None  # a version registered before lineage tags (or a hand-edited tag)

    def describe(self) -> str:
        shape = "x".join(map(str, self.input_shape))
        return f"{len(self.classes)} classes {list(self.classes)}, input {shape}"


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


def champion_outcome(registration: Registration) -> str:
    """What registering did to the ``champion`` alias, for the flow's log line: ``moved to
    it``, or why it stayed (a tie keeps the champion: trial, where three versions at
    val_accuracy 1.0 left the 3-epoch one champion and the line did not say why)."""
    if registration.promoted:
        return "moved to it"
    kept = f"stays at version {registration.previous_champion}"
    if registration.previous_value is None:
        return kept
    old = f"{registration.metric}={registration.previous_value:.4f}"
    if registration.previous_value == registration.value:
        return f"{kept} ({old} too: a tie keeps the champion, a new version must beat it)"
    return f"{kept} ({old}, better)"


# Requirement name -> import name of the packages a logged model needs.
REQUIRED_PACKAGES = {"mlflow": "mlflow", "torch": "torch", "numpy": "numpy", "pandas": "pandas",
                     "pillow": "PIL"}


def pip_requirements() -> list[str]:
    """Exact requirements of a logged model, without local version suffixes (``+cu121``)."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in REQUIRED_PACKAGES]


@contextlib.contextmanager
def _known_packages():
    """While logging a model: MLflow checks its requirements against the installed packages by
    first mapping every installed distribution to its modules (``packages_distributions``,
    ~1.6 CPU-s on a full environment, once per process). Our requirements are the installed
    versions by construction, so the map is seeded with just their packages for the call and
    reset after it. Without that MLflow internal (another MLflow version), nothing changes."""
    try:
        from mlflow.utils import requirements_utils as reqs
    except ImportError:
        yield
        return
    if getattr(reqs, "_MODULES_TO_PACKAGES", "absent") is not None:
        yield  # already built in this process, or an MLflow without it
        return
    reqs._MODULES_TO_PACKAGES = {module: [name] for name, module in REQUIRED_PACKAGES.items()}
    try:
        yield
    finally:
        reqs._MODULES_TO_PACKAGES = reqs._PACKAGES_TO_MODULES = None


def _champion(client, name: str, metric: str):
    """(version, value, lineage) of the champion, or (None, None, None)."""
    from mlflow.exceptions import MlflowException

    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None, None, None  # no registered model or no champion yet
    value = _champion_value(client, champion, metric)
    lineage = Lineage.from_tags(champion.tags or {}) or _signature_lineage(
        client, name, str(champion.version))
    return str(champion.version), value, lineage


def _champion_value(client, champion, metric: str) -> float | None:
    """The champion's ``metric``: its version's own tag (set at registration), else its run's
    metric. A run the store no longer holds (lost with a node's store, garbage-collected) and
    no tag: None (nothing to beat), with a warning naming the version and the run."""
    from mlflow.exceptions import MlflowException

    try:
        return float((champion.tags or {})[metric])
    except (KeyError, ValueError):
        pass
    try:
        return client.get_run(champion.run_id).data.metrics.get(metric)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    log.warning("champion version %s: its MLflow run %s is not in the store and the version "
                "has no %s tag: nothing to compare with", champion.version, champion.run_id,
                metric)
    return None


def _signature_lineage(client, name: str, version: str) -> Lineage | None:
    """The lineage of a version registered before lineage tags, from its MLmodel signature:
    input tensor [-1, C, H, W], output [-1, K]; the classes read as "0".."K-1", the folder names
    of the demo digits (so the demo's old champions still compare, and any other old model,
    whose class names are unknown, counts as another lineage). None without a usable signature.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.models import get_model_info

    try:
        # models:/ resolves through the global registry URI, set by the callers to this store.
        signature = get_model_info(f"models:/{name}/{version}").signature
        shape = tuple(int(v) for v in signature.inputs.inputs[0].shape[1:])
        width = int(signature.outputs.inputs[0].shape[-1])
    except (MlflowException, OSError, AttributeError, IndexError, TypeError, ValueError):
        return None
    return Lineage(tuple(str(i) for i in range(width)), shape)


def check_lineage(tracking_uri: str, name: str, lineage: Lineage, say=None) -> None:
    """Refuse a model whose lineage differs from ``name``'s champion (none: accepted); ``say``
    is told when a new store is created (stoker.tracking.store.open_store).

    Raises:
        LineageError: naming both lineages and ``tracking.registered_model``.
        stoker.tracking.store.TrackingStoreError: the store cannot be opened (one line).
    """
    import mlflow
    from mlflow import MlflowClient

    from stoker.tracking.store import open_store

    open_store(tracking_uri, say=say)  # a run's first contact: made whole, or one line (exit 2)
    mlflow.set_tracking_uri(tracking_uri)
    version, _value, incumbent = _champion(MlflowClient(tracking_uri), name, "")
    if version is not None and incumbent is not None and incumbent != lineage:
        raise LineageError(
            f"tracking.registered_model {name!r}: its champion (version {version}) has "
            f"{incumbent.describe()}; this dataset has {lineage.describe()}. A model of another "
            "lineage is never compared with it: set tracking.registered_model to a new name "
            "for this lineage")


def promotion_lock(tracking_uri: str, name: str):
    """A file lock per registered model for sqlite and file stores; a no-op elsewhere (remote
    stores rely on the re-check in ``_settle``)."""
    from urllib.parse import urlparse

    from filelock import FileLock

    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":
        where = Path(tracking_uri.removeprefix("sqlite:///")).parent
    elif parsed.scheme in ("", "file"):
        where = Path(parsed.path)
    else:
        return contextlib.nullcontext()
    key = hashlib.sha1(name.encode()).hexdigest()[:16]
    where.mkdir(parents=True, exist_ok=True)
    return FileLock(str(where / f".promote-{key}.lock"), timeout=600)


def log_model(tracking_uri: str, run_id: str, result: dict, example) -> str:
    """Log the trained model of ``result`` to MLflow run ``run_id`` as a pyfunc (its signature
    inferred from ``example`` and the model's answer to it; MLflow loads the logged model once
    to check that it serves ``example``). Returns the logged model's URI (``models:/m-...``).

    Rank 0 calls it as a completed job ends (torch, MLflow and the store are loaded there), so
    the orchestrator registers that URI without importing torch; the orchestrator calls it
    itself when the job has no record it can trust (ranks in a training image, or logging
    failed in rank 0).

    Args:
        result: the job's ``result.json`` fields (``model_path``: the final weights).
        example: float32 [N, C, H, W] in [0, 1] (:func:`input_example`).

    Raises:
        mlflow.exceptions.MlflowException: the store refused the run's artifacts.
    """
    import mlflow
    from mlflow.models import infer_signature

    import stoker
    from stoker.runtime.tracking import quiet_mlflow
    from stoker.tracking import pyfunc
    from stoker.tracking.model_code import stage_model_code
    from stoker.tracking.pyfunc import ImageClassifier, model_meta
    from stoker.tracking.served_input import served_signature

    mlflow.set_tracking_uri(tracking_uri)
    meta = model_meta(result)
    classifier = ImageClassifier()
    with tempfile.TemporaryDirectory() as tmp:
        meta_path = Path(tmp) / "stoker.json"
        meta_path.write_text(json.dumps(meta, indent=2))
        classifier.load_context(type("Context", (), {"artifacts": {
            "meta": str(meta_path), "weights": result["model_path"]}})())
        output = classifier.predict(None, example)
        loader = Path(pyfunc.__file__).with_name("pyfunc_code.py")
        code = stage_model_code(loader, Path(stoker.__file__).parent, Path(tmp) / "code")
        with mlflow.start_run(run_id=run_id), _known_packages(), quiet_mlflow():
            info = mlflow.pyfunc.log_model(
                name="model", python_model=str(loader),
                artifacts={"weights": result["model_path"], "meta": str(meta_path)},
                signature=served_signature(infer_signature(example, output,
                                                           params={"logits": False})),
                input_example=example, pip_requirements=pip_requirements(),
                code_paths=[str(code)], metadata={"stoker": meta},
            )
    return str(info.model_uri)


LOGGED_MODEL_FILE = "final/mlflow_model.json"  # in the job folder: what rank 0 logged


def log_completed_model(spec, result: dict, run_id: str) -> None:
    """Rank 0's hook for a completed job (entry point ``stoker.runtime.completed``, see
    ``stoker.runtime.reporting``): log the model to run ``run_id`` (:func:`log_model`, with the
    first images of ``spec.data_dir`` as the input example) and record its URI in
    ``<job>/final/mlflow_model.json`` for the orchestrator (:func:`logged_model`).

    Args:
        spec: the job's ``stoker.runtime.spec.RunSpec``.
        result: the ``result.json`` fields rank 0 just wrote.

    Raises:
        mlflow.exceptions.MlflowException, OSError: the model could not be logged (the runtime
            warns; the orchestrator then logs it).
    """
    uri = log_model(spec.tracking_uri, run_id, result, input_example(Path(spec.data_dir), result))
    write_logged_model(spec.job_dir, run_id, uri)


def write_logged_model(job_dir: str | Path, run_id: str, model_uri: str) -> None:
    """Record (atomically) that ``model_uri`` was logged to ``run_id`` for the job."""
    from stoker.runtime.records import write_json

    write_json(Path(job_dir) / LOGGED_MODEL_FILE, {"run_id": run_id, "model_uri": model_uri})


def logged_model(job_dir: str | Path, run_id: str) -> str | None:
    """The model URI rank 0 logged to ``run_id`` for the job (``models:/...``), or None: no
    record, a torn or foreign one (another run's, a value that is not a models URI)."""
    from stoker.runtime.records import read_json

    record = read_json(Path(job_dir) / LOGGED_MODEL_FILE)
    if not isinstance(record, dict) or record.get("run_id") != run_id:
        return None
    uri = record.get("model_uri")
    return uri if isinstance(uri, str) and uri.startswith("models:/") else None


def _logged_by(client, model_uri: str, run_id: str) -> bool:
    """Whether the store holds logged model ``model_uri`` (``models:/m-...``) from ``run_id``:
    a record in the job folder names the model, the store vouches for it."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_logged_model(model_uri.removeprefix("models:/"))
    except MlflowException:
        return False
    return model.source_run_id == run_id


def _register(model_uri: str, name: str, tags: dict[str, str]) -> str:
    """Register ``model_uri`` as a new version of ``name`` carrying ``tags`` (one write with
    the version, not one per tag); returns the new version."""
    import mlflow

    from stoker.runtime.tracking import quiet_mlflow

    with quiet_mlflow():
        return str(mlflow.register_model(model_uri, name, tags=tags).version)


def _versions(client, name: str, run_id: str | None = None, newer_than: int | None = None
              ) -> list:
    """The versions of registered model ``name`` (a quote in the name is quoted, not spliced):
    all of them, or those of MLflow run ``run_id``, or those numbered above ``newer_than``.

    The store filters them: a registration reads the versions it needs, not every version the
    model has (each one a row with its tags: about 2.4 ms per version on a local sqlite store,
    0.18 s at 75 versions, twice per registration). A registry that cannot filter on the
    version number (MLflow names only ``name``, ``run_id`` and ``source_path`` as portable)
    is asked for all of them, filtered here."""
    from mlflow.exceptions import MlflowException

    def quoted(value: str) -> str:
        quote = '"' if "'" in value else "'"
        return f"{quote}{value}{quote}"

    query = f"name = {quoted(name)}"
    if run_id is not None:
        query += f" and run_id = {quoted(run_id)}"
    if newer_than is None:
        return client.search_model_versions(query)
    try:
        return client.search_model_versions(f"{query} and version_number > {int(newer_than)}")
    except MlflowException:
        return [v for v in client.search_model_versions(query) if int(v.version) > newer_than]


def _settle(client, name: str, metric: str, direction: str, lineage: Lineage,
            since_version: int) -> None:
    """Compare-and-set re-check after setting: among this lineage's versions newer than the
    champion we compared against, the best one that beats the current champion takes the alias.
    Every registration runs it, so a registration that read a stale champion and overwrote a
    better one is undone by whichever registration checks last."""
    best_version, best_value = None, None
    for v in _versions(client, name, newer_than=since_version):
        tags = v.tags or {}
        if int(v.version) <= since_version or Lineage.from_tags(tags) != lineage:
            continue
        try:
            value = float(tags[metric])
        except (KeyError, ValueError):
            continue
        if best_value is None or beats(value, best_value, direction):
            best_version, best_value = str(v.version), value
    current, current_value, _lineage = _champion(client, name, metric)
    if best_version is not None and best_version != current and beats(
            best_value, current_value, direction):
        client.set_registered_model_alias(name, CHAMPION, best_version)


def log_and_register(tracking_uri: str, run_id: str, registered_model: str, result: dict,
                     input_example, tags: dict[str, str], metric: str, value: float,
                     direction: str = "max", logged_model_uri: str | None = None
                     ) -> Registration:
    """Register the trained model of ``result`` (logging it first as a pyfunc unless rank 0
    did: ``logged_model_uri``), tag the version, apply the gate.

    Args:
        result: the job's ``result.json`` fields: ``model``, ``classes``, ``input_shape``
            ([C, H, W]) and ``model_path`` (final weights).
        input_example: float32 [N, C, H, W] in [0, 1], the signature is inferred from it; or
            a callable returning it, called only when the model is logged here.
        tags: lineage tags set on the model version.
        metric, value, direction: promotion metric, the new model's value, "max" or "min".
        logged_model_uri: the model rank 0 logged to ``run_id`` (:func:`logged_model`), or None.

    Raises:
        LineageError: the champion has other classes or another input shape (nothing
            registered).
        mlflow.exceptions.MlflowException: the tracking server or registry rejected a call.
    """
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri)
    lineage = Lineage(tuple(result["classes"]), tuple(int(v) for v in result["input_shape"]))
    check_lineage(tracking_uri, registered_model, lineage)
    version_tags = {**tags, **lineage.tags(), metric: str(value)}
    existing = [v for v in _versions(client, registered_model, run_id=run_id)
                if v.run_id == run_id]
    if existing:  # an earlier, interrupted registration of this run: finish that version
        version = str(max(int(v.version) for v in existing))
        for key, tag in version_tags.items():
            client.set_model_version_tag(registered_model, version, key, tag)
    else:
        if logged_model_uri is not None and not _logged_by(client, logged_model_uri, run_id):
            log.warning("%s was not logged by MLflow run %s: logging the model again",
                        logged_model_uri, run_id)
            logged_model_uri = None
        model_uri = logged_model_uri or log_model(
            tracking_uri, run_id, result,
            input_example() if callable(input_example) else input_example)
        version = _register(model_uri, registered_model, version_tags)
    # Only completed training is registered: reopening the run must leave it FINISHED, also
    # when an earlier interrupted registration left it FAILED.
    client.set_terminated(run_id, status="FINISHED")
    client.set_registered_model_alias(registered_model, CHALLENGER, version)

    with promotion_lock(tracking_uri, registered_model):
        previous, previous_value, incumbent = _champion(client, registered_model, metric)
        if (incumbent is None or incumbent == lineage) and beats(value, previous_value,
                                                                  direction):
            client.set_registered_model_alias(registered_model, CHAMPION, version)
        _settle(client, registered_model, metric, direction, lineage, int(previous or 0))
    promoted = _champion(client, registered_model, metric)[0] == version
    return Registration(registered_model, version, metric, value, promoted, previous,
                        previous_value, f"models:/{registered_model}/{version}")


# What registration imports that nothing before it in the orchestrator needs: with
# ``tracking.plot_curves``, the plotting library's figure and Agg canvas (about 0.25 CPU-s on 2
# cores once MLflow is imported; drawing and saving the figure takes 0.4 more); and, when the
# orchestrator logs the model itself (rank 0 did not: a training image, see ``log_model``),
# torch (the model is loaded to infer the signature, and MLflow loads it again to validate the
# serving input) and MLflow's pyfunc flavor (about 2.5 CPU-s more).
REGISTRATION_IMPORTS = ("matplotlib.figure", "matplotlib.backends.backend_agg")
MODEL_LOGGING_IMPORTS = ("torch", "stoker.runtime.data", "stoker.tracking.pyfunc",
                         "mlflow.models")


def warm_up_registration(logs_model: bool = False, plots: bool = True) -> threading.Thread:
    """Import ``REGISTRATION_IMPORTS`` when ``plots`` (``tracking.plot_curves``: registration
    draws the curves) and ``MODEL_LOGGING_IMPORTS`` when ``logs_model`` (the orchestrator will
    log the model itself) in a daemon thread and return it.

    The pipeline starts it as training starts, so that these imports are not paid after the
    last step. The thread runs at the lowest CPU priority (nice 19, this thread only: Linux
    gives each thread its own): it takes what CPU the ranks leave (waits in all-reduce, data
    loading) instead of slowing their steps, and once training ends, whatever is left runs at
    once (nothing competes then). A failed import is left for registration to raise where it
    happens."""
    def run() -> None:
        import importlib
        import os

        with contextlib.suppress(OSError, AttributeError):  # not Linux: normal priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for name in ((REGISTRATION_IMPORTS if plots else ())
                     + (MODEL_LOGGING_IMPORTS if logs_model else ())):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - registration imports it again and says why
                return

    thread = threading.Thread(target=run, name="stoker-warm-up-registration", daemon=True)
    thread.start()
    return thread


def load_trained_model(result: dict):
    """Rebuild the trained module from ``result.json`` fields and its final weights (eval mode)."""
    import torch

    from stoker.runtime.models import build_model

    model = build_model(result["model"], result["num_classes"], result["input_shape"][0])
    model.load_state_dict(torch.load(result["model_path"], map_location="cpu", weights_only=True),
                          strict=True)
    return model.eval()


def input_example(dataset: DatasetRef | Path, result: dict, count: int = 4):
    """The first ``count`` images of the dataset (a pulled dataset or its folder),
    preprocessed as the model expects them:
    float32 [count, C, H, W]. Reads only those files (and lists only the class folders they
    are in), whatever the size of the dataset."""
    from stoker.runtime.data import class_folders, image_files
    from stoker.tracking.pyfunc import model_meta, preprocess_images

    paths: list[Path] = []
    root = dataset if isinstance(dataset, Path) else Path(dataset.local_path)
    for folder in class_folders(root):
        paths += image_files(folder)[:count - len(paths)]
        if len(paths) == count:
            break
    return preprocess_images(paths, model_meta(result)["preprocessing"])
