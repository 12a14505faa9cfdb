"""The pipeline run's summary as Markdown: dataset, metrics, cost, MLflow links, promotion."""

from __future__ import annotations

from stoker.config import TrackingConfig
from stoker.data.pull import DatasetRef
from stoker.launch.supervisor import TrainResult
from stoker.tracking.registry import Registration


def run_page(ui_url: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI's page of run ``run_id`` (``<ui>/#/experiments/<id>/runs/<run id>``)."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_links(ui_url: str | None, experiment_id: str, run_id: str, name: str,
                 version: str) -> tuple[str, str]:
    """Markdown for the run and the model version: links when an MLflow UI URL is known."""
    if not ui_url:
        return f"`{run_id}`", f"`{name}` version **{version}**"
    base = ui_url.rstrip("/")
    # Plain link text: Prefect's renderer shows `code` and **bold** inside a link literally.
    return (f"[{run_id}]({run_page(base, experiment_id, run_id)})",
            f"[{name} version {version}]({base}/#/models/{name}/versions/{version})")


SPARK_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """A text curve of ``values`` (resampled to at most ``width`` bars, lowest value ``▁``),
    so the loss curve shows in the Prefect UI without leaving it. Empty input: empty string."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return ""
    if len(finite) > width:  # mean of equal slices keeps the shape
        edges = [round(i * len(finite) / width) for i in range(width + 1)]
        finite = [sum(finite[a:b]) / (b - a) for a, b in zip(edges, edges[1:], strict=False)]
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(SPARK_BARS[round((v - low) / span * (len(SPARK_BARS) - 1))] for v in finite)


def render(dataset: DatasetRef, trained: TrainResult, registration: Registration,
           tracking_uri: str, ui_url: str | None = None, experiment_id: str = "",
           loss_curve: list[float] | None = None, curves_plot: bool = False) -> str:
    """Markdown: dataset revision and hash, metrics, loss curve, cost, MLflow run and model
    version (links when an MLflow UI is known, else how to open one), promotion.
    ``curves_plot``: the run has ``plots/curves.png`` (``tracking.plot_curves``); without it the
    report points to the run's *Model metrics* tab, where the MLflow UI charts the metrics."""
    metrics = "\n".join(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                        for k, v in sorted(trained.metrics.items()))
    run_link, model_link = mlflow_links(ui_url, experiment_id, trained.run_id,
                                        registration.name, registration.version)
    if not ui_url:
        # `stoker ui`: one worker, its own errors said (a plain `mlflow ui` could die silently).
        run_link += (f" (open it with `stoker ui --tracking-uri {tracking_uri}`, "
                     f"experiment {experiment_id})")
    else:
        run_link += f" (tracking URI `{tracking_uri}`)"
    cost = trained.cost
    attempts = ", ".join(f"#{a['number']} {a['outcome']}" for a in trained.attempts)
    champion = ("promoted to **champion**" if registration.promoted else
                f"not promoted (champion stays version {registration.previous_champion}, "
                f"{registration.metric}={_value(registration.previous_value)})")
    device = str(trained.result.get("gpu_model") or "device")
    curve = ""
    if loss_curve:
        curve = (f"- Training loss: `{sparkline(loss_curve)}` ({len(loss_curve)} logged points, "
                 f"{loss_curve[0]:.4g} → {loss_curve[-1]:.4g}; "
                 + ("plot in the MLflow run's `plots/curves.png`" if curves_plot else
                    "charted in the MLflow run's *Model metrics* tab") + ")\n")
    return f"""# Stoker pipeline run

| dataset | |
|---|---|
| repository | `{dataset.repo_url}` |
| revision | `{dataset.rev}` (commit `{dataset.commit[:12]}`) |
| path | `{dataset.path}` |
| DVC hash | `{dataset.md5}` ({dataset.nfiles} files) |

| metric | value |
|---|---|
{metrics}

{curve}- MLflow run: {run_link}
- Model: {model_link}, alias `challenger`; {champion}
- Attempts: {attempts}
- Cost: {cost.get("gpu_hours", 0):.4f} device-hours on {device}, ${cost.get("cost_usd", 0):.4f}, goodput {cost.get("goodput", 0):.2f}, {int(cost.get("preemptions", 0))} preemption(s), {int(cost.get("steps_lost", 0))} step(s) lost
- Job folder: `{trained.job_dir}`
"""  # noqa: E501 (the cost item stays one line: a wrapped list item renders as two paragraphs)


def _value(value) -> str:
    """A metric value as the metrics table shows it (4 decimals), anything else as is."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def ui_base(tracking: TrackingConfig, tracking_uri: str) -> str | None:
    """The MLflow UI to link to: ``tracking.ui_url``, else an http(s) tracking URI."""
    if tracking.ui_url:
        return tracking.ui_url
    return tracking_uri if tracking_uri.startswith(("http://", "https://")) else None
