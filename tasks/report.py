"""Report task: a Prefect markdown artifact summarizing the pipeline run."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from stoker.dataset import DatasetRef
from stoker.registry import Registration
from tasks.train import TrainResult


def render(dataset: DatasetRef, trained: TrainResult, registration: Registration,
           tracking_uri: str) -> str:
    """Markdown: dataset revision and hash, metrics, MLflow run and model version, promotion."""
    metrics = "\n".join(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                        for k, v in sorted(trained.metrics.items()))
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

- MLflow run: `{trained.run_id}` (tracking URI `{tracking_uri}`)
- Model: `{registration.name}` version **{registration.version}**, alias `challenger`;
  {champion}
- Attempts: {attempts}
- Job folder: `{trained.job_dir}`
"""


@task(name="report", cache_policy=NO_CACHE)
def report(dataset: DatasetRef, trained: TrainResult, registration: Registration,
           tracking_uri: str) -> str:
    markdown = render(dataset, trained, registration, tracking_uri)
    create_markdown_artifact(markdown=markdown, key="stoker-pipeline",
                             description="Dataset, metrics, MLflow run and model version")
    return markdown
