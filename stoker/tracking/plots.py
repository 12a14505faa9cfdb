"""Training curves as an image artifact for the MLflow run."""

from __future__ import annotations

from pathlib import Path


def plot_curves(tracking_uri: str, run_id: str, out: Path) -> Path:
    """Draw train loss (as logged: every ``train.metrics_every_steps`` steps) and validation
    loss/accuracy per epoch from the run's metric history into a PNG at ``out`` (1200x450 px).
    Returns ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)

    def series(key: str) -> tuple[list[int], list[float]]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        return [m.step for m in history], [m.value for m in history]

    # Matplotlib's object API, not pyplot: no global figure state (the flow is threaded) and
    # no pyplot import (about 0.25 CPU-s on 2 cores).
    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    left.plot(*series("train_loss"), label="train loss", linewidth=0.8)
    left.plot(*series("val_loss"), "o-", label="validation loss")
    left.set_xlabel("step")
    left.set_yscale("log")
    left.legend()
    right.plot(*series("val_accuracy"), "o-", color="tab:green")
    right.set_xlabel("step")
    right.set_ylabel("validation accuracy")
    fig.suptitle(f"run {run_id}")
    fig.tight_layout()
    fig.savefig(out)
    return out
