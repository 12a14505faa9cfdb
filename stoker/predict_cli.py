"""``stoker predict``: a registered model's class names and probabilities for image files.

A read: it creates no store and no Prefect home. Bad input (a missing file, a model the store does
not hold, a store that does not exist) is one line with exit code 2, found before the model loads
where it can be.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, NoReturn

import typer


def predict(
    images: Annotated[list[Path], typer.Argument(
        help="Image files, or folders of them (read with their subfolders, in name order); "
        "each is resized to the model's size")],
    model_uri: Annotated[str | None, typer.Option(
        help="MLflow model URI [default: models:/stoker-digits@champion (the demo's) when the "
        "store has it, else the champion of the store's only registered model]")] = None,
    tracking_uri: Annotated[str | None, typer.Option(
        help="MLflow tracking URI [default: the store of --work-dir when given, else "
        "MLFLOW_TRACKING_URI when set, else sqlite:///work/mlflow.db]",
        show_default=False)] = None,
    work_dir: Annotated[Path | None, typer.Option(
        "--work-dir", "-w", help="The work folder whose MLflow store (`<work-dir>/mlflow.db`, "
        "where `stoker run` logs by default) is read when --tracking-uri is not given "
        "[default: work]", show_default=False)] = None,
    logits: Annotated[bool, typer.Option(help="Also print the logits per class")] = False,
) -> None:
    """Load a registered model and print each image's class name and probability."""
    from stoker.environment import TELEMETRY_OFF, sqlite_path

    for name, value in TELEMETRY_OFF.items():  # a read creates nothing: no PREFECT_HOME either
        os.environ.setdefault(name, value)
    from stoker.config import tracking_uri_from_env

    from_env = tracking_uri is None and work_dir is None and tracking_uri_from_env()
    tracking_uri = (tracking_uri or from_env
                    or f"sqlite:///{(work_dir or Path('work')) / 'mlflow.db'}")
    from stoker.config_base import masked_url, url_credentials

    if (found := url_credentials(tracking_uri)) is not None:  # as stoker run refuses it
        fail(f"--tracking-uri holds {found}: give the URL without it and the credential in "
             "the environment (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
             f"MLFLOW_TRACKING_TOKEN); got {masked_url(tracking_uri)}")
    store = sqlite_path(tracking_uri)
    relative = f" (from {Path.cwd()})" if store is not None and not store.is_absolute() else ""
    source = " of MLFLOW_TRACKING_URI" if from_env else ""
    where = (f"tracking URI {tracking_uri}{source}{relative}; point --work-dir or "
             "--tracking-uri at your store")
    if store is not None and not store.is_file():
        fail(f"no MLflow store at {store}: {where}")
    from stoker.config import ConfigError
    from stoker.server_auth import CredentialError, check_mlflow_server
    from stoker.tracking.server import check_tracking_server

    try:
        # A server that does not answer: one line in seconds, not after MLflow's retries
        # (trial: 249 s, then its whole retry message).
        check_tracking_server(tracking_uri, name="MLFLOW_TRACKING_URI" if from_env
                              else "--tracking-uri")
        check_mlflow_server(tracking_uri)  # a missing or wrong credential: one line
    except (ConfigError, CredentialError) as e:
        fail(str(e))
    folders = [p for p in images if p.is_dir()]
    images = expand_images(images)  # before the model loads (seconds)
    from stoker.predict_checks import UnusableImage, image_modes

    try:  # an unreadable or oversized image: before MLflow and torch are imported
        modes = image_modes(images)
    except UnusableImage as e:
        fail(str(e))
    import mlflow
    from mlflow.exceptions import MlflowException

    from stoker.predict_checks import answered_by, mismatch
    from stoker.tracking.pyfunc import preprocess_images
    from stoker.tracking.safe_model import UnsafeModelError, fetch_model, load_fetched

    mlflow.set_tracking_uri(tracking_uri)
    if model_uri is None:
        model_uri = default_model_uri(where)
    with tempfile.TemporaryDirectory(prefix="stoker-predict-") as tmp:
        try:  # checks the MLmodel file first; runs no code the model ships (safe_model)
            local, artifacts, meta = fetch_model(model_uri, Path(tmp))
        except MlflowException as e:
            said = e.message.strip().splitlines()[0].rstrip(". ")  # MLflow ends it with '.'
            fail(f"{model_uri}: {said}; {registered_models()} ({where})")
        except UnsafeModelError as e:
            fail(f"{e} (refused before loading)")
        # Images the model cannot take: refused from its metadata, before torch loads it.
        if problem := mismatch(images, folders, meta, model_uri, modes):
            fail(problem)
        try:
            model = load_fetched(model_uri, local, artifacts)
        except UnsafeModelError as e:
            fail(f"{e} (refused before loading)")
    typer.echo(answered_by(model_uri), err=True)
    try:
        batch = preprocess_images(images, meta["preprocessing"])
    except OSError as e:
        fail(str(e))
    table = model.predict(None, batch, params={"logits": logits})
    for path, (_, row) in zip(images, table.iterrows(), strict=True):
        extra = "".join(f"\t{k}={row[k]:.3f}" for k in table.columns if k.startswith("logit_"))
        typer.echo(f"{path}\t{row['class']}\t{row['probability']:.3f}{extra}")


def expand_images(paths: list[Path]) -> list[Path]:
    """Each file as given; each folder as the visible files in it and its subfolders, in name
    order (a dataset folder of class folders works as is).

    Exits 2 (one line) for a path that does not exist or a folder without a file.
    """
    from stoker.runtime.listing import visible  # no torch: a bad path fails in a second

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such image file or folder: {', '.join(missing[:5])}")
    files: list[Path] = []
    for path in paths:
        if not path.is_dir():
            files.append(path)
            continue
        found = []
        for folder, subfolders, names in os.walk(path):  # top-down: a folder, then its subfolders
            subfolders[:] = sorted(d for d in subfolders if visible(Path(d)))
            found += [Path(folder) / n for n in sorted(names) if visible(Path(n))]
        if not found:
            fail(f"{path}: a folder with no image file in it or its subfolders")
        files += found
    return files


DEMO_MODEL = "stoker-digits"


def default_model_uri(where: str) -> str:
    """Without ``--model-uri``: the demo's champion when the store has the demo's model, else
    the champion of the store's only registered model (said on stderr). Exits 2 (one line
    listing them) when the store holds none, or several and not the demo's."""
    from mlflow import MlflowClient

    try:
        names = sorted(m.name for m in MlflowClient().search_registered_models(max_results=20))
    except Exception as e:  # noqa: BLE001 - the store itself failed: say where
        fail(f"the registered models could not be listed: {e} ({where})")
    if DEMO_MODEL in names or not names:
        return f"models:/{DEMO_MODEL}@champion"  # none: loading it says so, with the hint
    if len(names) > 1:
        fail(f"no --model-uri, and the store holds {len(names)} registered models: "
             f"{', '.join(names)}; e.g. --model-uri models:/{names[0]}@champion ({where})")
    typer.echo(f"model: models:/{names[0]}@champion (the store's only registered model)",
               err=True)
    return f"models:/{names[0]}@champion"


def registered_models() -> str:
    """The registered models of the current tracking store, as a hint for ``--model-uri``."""
    from mlflow import MlflowClient

    try:
        names = sorted(m.name for m in MlflowClient().search_registered_models(max_results=20))
    except Exception:  # noqa: BLE001 - only a hint: the store already failed once
        return "the store's registered models could not be listed"
    if not names:
        return "the store holds no registered model"
    return ("registered models there: " + ", ".join(names)
            + f"; e.g. --model-uri models:/{names[0]}@champion")


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (a user error)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
