"""The cost report on a schedule: spend per job and per model, and the purchase-mix advice, as
the ``stoker-cost`` markdown artifact (what ``stoker cost`` prints; docs/how-to/cost-report.md).
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, Field

from tasks.cost_report import cost_report


class CostReportForm(BaseModel):
    """The ``cost-report`` deployment's form: the store and the period to report."""

    tracking_uri: str = Field("sqlite:///work/mlflow.db", description="MLflow tracking URI.")
    days: float = Field(30.0, gt=0, description="Report the last N days (ending now).")


@flow(name="cost-report", log_prints=True)
def cost_report_flow(form: CostReportForm = CostReportForm()) -> dict:  # noqa: B008 - form
    """Read the period's jobs from MLflow and publish the report; returns its JSON."""
    return cost_report(form.tracking_uri, form.days)
