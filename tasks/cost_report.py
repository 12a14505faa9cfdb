"""Cost report task: the period's spend as the ``stoker-cost`` markdown artifact."""

from __future__ import annotations

import time

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE


@task(name="cost-report", cache_policy=NO_CACHE)
def cost_report(tracking_uri: str, days: float) -> dict:
    """Publish the last ``days`` days of spend (:mod:`stoker.tracking.spend_report`)."""
    from mlflow import MlflowClient

    from stoker.tracking.pricing import PriceTable
    from stoker.tracking.spend_report import collect, render_markdown

    now = time.time()
    summary = collect(MlflowClient(tracking_uri), now - days * 86400, now, PriceTable())
    create_markdown_artifact(markdown=render_markdown(summary), key="stoker-cost",
                             description=f"Spend of the last {days:g} days and purchase mix")
    return summary.to_json()
