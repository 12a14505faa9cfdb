"""A sweep's result as the plain dict ``stoker cost-guard`` prints (JSON) and the flow returns."""

from __future__ import annotations


def summary(result) -> dict:
    """A :class:`~stoker.costguard.sweep.SweepResult` as JSON-ready fields.

    Args:
        result: the sweep's result.

    Returns:
        dry_run, idle_gpu_hours (GPU-hours), usd_per_hour (USD/h), resources (verdict, reasons,
        action per resource), gpus (verdict and reasons per GPU) and notes.
    """
    return {
        "dry_run": result.dry_run,
        "idle_gpu_hours": result.idle_gpu_hours,
        "usd_per_hour": result.usd_per_hour,
        "resources": [{"resource": r.key, "verdict": str(r.decision.verdict),
                       "reasons": list(r.decision.reasons),
                       "action": r.action_status, "detail": r.action}
                      for r in result.resources],
        "gpus": [{"gpu": r.id, "verdict": str(r.decision.verdict),
                  "reasons": list(r.decision.reasons)} for r in result.gpus],
        "notes": list(result.notes),
    }
