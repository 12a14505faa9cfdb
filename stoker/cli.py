"""The ``stoker`` command line.

``stoker run [--config FILE] [field=value ...]`` runs the pipeline flow with the embedded defaults:
Prefect without a separately started server (unless PREFECT_API_URL is set), MLflow in
``<work_dir>/mlflow.db``, DVC with a local remote.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from stoker import stopping
from stoker.config import ConfigError, PipelineConfig, load_pipeline_config

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Stoker: resumable GPU training pipelines on Prefect, DVC, PyTorch, MLflow.")


def quiet_telemetry(work_dir: Path) -> None:
    """Telemetry off and Prefect's home inside the work directory, unless the user set them."""
    os.environ.setdefault("PREFECT_HOME", str((work_dir / ".prefect").resolve()))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    # The embedded (ephemeral) Prefect server migrates its database on first start: slow on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _config(config_file: Path | None, overrides: list[str] | None) -> PipelineConfig:
    try:
        return load_pipeline_config(config_file, overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. train.epochs=3 data.rev=v1")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with PipelineConfig fields")] = None,
) -> None:
    """Run the main job: pull the dataset, train with torchrun, register the model in MLflow."""
    config = _config(config_file, overrides)
    quiet_telemetry(config.work_dir)
    stopping.install()
    code = 0
    try:
        with prefect_api():
            from flows.pipeline import pipeline
            from tasks.stopping import TrainingStopped

            try:
                summary = pipeline(config)
                typer.echo(json.dumps(summary, indent=2, default=str))
            except TrainingStopped as e:  # the cost guard or a user stopped the job
                typer.echo(f"stoker run: {e}", err=True)
                code = stopping.EXIT_STOPPED
    except KeyboardInterrupt as e:
        typer.echo(f"stoker run: {stopping.stop_reason() or 'interrupted'}: stopped", err=True)
        code = stopping.exit_code(e)
    except Exception:
        traceback.print_exc()
        code = 1
    # Everything is recorded and the training tree is gone: skip the interpreter's finalizers
    # (Prefect's exit hooks, torch), which held the exit back for seconds.
    stopping.exit_now(code)


@contextlib.contextmanager
def prefect_api():
    """The Prefect API for this command: PREFECT_API_URL when set, else a temporary server that
    this process owns (its own session, ends with this process; see stoker.embedded_server)."""
    if os.environ.get("PREFECT_API_URL"):
        try:
            yield
        finally:
            drain_prefect_workers()
        return
    from stoker.embedded_server import EmbeddedServer

    server = EmbeddedServer(Path(os.environ["PREFECT_HOME"]) / "server.log",
                            float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
    # Prefect's own wording and log format: benchmarks/bench_pipeline_overhead.py times it.
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:12]
    typer.echo(f"{stamp} | INFO    | stoker - Starting temporary server on "
               f"{server.api_url.removesuffix('/api')}", err=True)
    try:
        server.start()
        # Before Prefect is imported: its global settings (seen by every thread) read the env.
        os.environ["PREFECT_API_URL"] = server.api_url
        yield
    finally:
        drain_prefect_workers()
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()


def drain_prefect_workers() -> None:
    """Send Prefect's queued logs and events (before the server they go to stops)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)


@app.command("cost-guard")
def cost_guard(
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Dotted overrides, e.g. dry_run=false policy.window_s=120")] = None,
    config_file: Annotated[Path | None, typer.Option(
        "--config", "-c", help="YAML file with CostGuardConfig fields")] = None,
) -> None:
    """Run one cost-guard sweep: find idle GPUs and stalled jobs (dry run unless dry_run=false)."""
    from stoker.config import load_config
    from stoker.costguard.config import CostGuardConfig

    try:
        config = load_config(CostGuardConfig, config_file, overrides)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    quiet_telemetry(config.work_dir)
    from flows.cost_guard import cost_guard as cost_guard_flow

    typer.echo(json.dumps(cost_guard_flow(config), indent=2, default=str))


@app.command("show-config")
def show_config(
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides")] = None,
    config_file: Annotated[Path | None, typer.Option("--config", "-c")] = None,
) -> None:
    """Print the resolved, validated configuration as YAML."""
    import yaml

    config = _config(config_file, overrides)
    typer.echo(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


@app.command()
def predict(
    images: Annotated[list[Path], typer.Argument(help="Image files (same size as training)")],
    model_uri: Annotated[str, typer.Option(help="MLflow model URI")] =
        "models:/stoker-digits@champion",
    tracking_uri: Annotated[str, typer.Option(help="MLflow tracking URI")] =
        "sqlite:///work/mlflow.db",
) -> None:
    """Load a registered model and print the predicted class of each image."""
    import mlflow
    import numpy as np
    from PIL import Image

    quiet_telemetry(Path("work"))
    mlflow.set_tracking_uri(tracking_uri)
    model = mlflow.pyfunc.load_model(model_uri)
    batch = np.stack([np.asarray(Image.open(p).convert("L"), dtype=np.float32) / 255.0
                      for p in images])[:, None]
    for path, logits in zip(images, model.predict(batch), strict=True):
        typer.echo(f"{path}\t{int(np.argmax(logits))}")


if __name__ == "__main__":
    sys.exit(app())
