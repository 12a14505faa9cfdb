"""The pipeline run's summary as Markdown: dataset, metrics, cost, MLflow links, promotion."""

from __future__ import annotations

from stoker.config import TrackingConfig
from stoker.data.pull import DatasetRef
from stoker.launch.supervisor import TrainResult
from stoker.tracking.registry import Registration


def mlflow_links(ui_url: str | None, experiment_id: str, run_id: str, name: str,
                 version: str) -> tuple[str, str]:
    """Markdown for the run and the model version: links when an MLflow UI URL is known."""
    if not ui_url:
        return f"`{run_id}`", f"`{name}` version **{version}**"
    base = ui_url.rstrip("/")
    return (f"[{run_id}]({base}/#/experiments/{experiment_id}/runs/{run_id})",
            f"[`{name}` version **{version}**]({base}/#/models/{name}/versions/{version})")


def render(dataset: DatasetRef, trained: TrainResult, registration: Registration,
           tracking_uri: str, ui_url: str | None = None, experiment_id: str = "") -> str:
    """Markdown: dataset revision and hash, metrics, cost, MLflow run and model version links,
    promotion."""
    metrics = "\n".join(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                        for k, v in sorted(trained.metrics.items()))
    run_link, model_link = mlflow_links(ui_url, experiment_id, trained.run_id,
                                        registration.name, registration.version)
    cost = trained.cost
    attempts = ", ".join(f"#{a['number']} {a['outcome']}" for a in trained.attempts)
    champion = ("promoted to **champion**" if registration.promoted else
                f"not promoted (champion stays version {registration.previous_champion}, "
                f"{registration.metric}={registration.previous_value})")
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

- MLflow run: {run_link} (tracking URI `{tracking_uri}`)
- Model: {model_link}, alias `challenger`; {champion}
- Attempts: {attempts}
- Cost: {cost.get("gpu_hours", 0):.4f} GPU-hours, ${cost.get("cost_usd", 0):.4f}, goodput
  {cost.get("goodput", 0):.2f}, {int(cost.get("preemptions", 0))} preemption(s),
  {int(cost.get("steps_lost", 0))} step(s) lost
- Job folder: `{trained.job_dir}`
"""


def ui_base(tracking: TrackingConfig, tracking_uri: str) -> str | None:
    """The MLflow UI to link to: ``tracking.ui_url``, else an http(s) tracking URI."""
    if tracking.ui_url:
        return tracking.ui_url
    return tracking_uri if tracking_uri.startswith(("http://", "https://")) else None
