"""Training and model events for Prefect automations: names, resources and payloads.

No Prefect here: :func:`training_event` and :func:`model_event` return the keyword arguments of
``prefect.events.emit_event``; the tasks emit them. Events (the flow run and task run are added
as related resources by Prefect):

- ``stoker.training.started``: the first attempt of a job starts;
- ``stoker.training.resumed``: a later attempt starts (after a preemption, a failure, or in a new
  flow run of an unfinished job);
- ``stoker.training.preempted``: an attempt was preempted (its stop checkpoint committed);
- ``stoker.training.completed`` / ``stoker.training.failed``: the job's training ended;
- ``stoker.model.registered``: a new model version; ``stoker.model.promoted``: it became
  ``champion``.
"""

from __future__ import annotations

from typing import Any

TRAINING = "stoker.training"
MODEL = "stoker.model"
TRAINING_KINDS = ("started", "resumed", "preempted", "completed", "failed")
MODEL_KINDS = ("registered", "promoted")


def _job(job: str) -> dict[str, str]:
    return {"prefect.resource.id": f"stoker.job.{job}", "prefect.resource.name": job,
            "stoker.kind": "job"}


def _run(run_id: str | None) -> list[dict[str, str]]:
    if not run_id:
        return []
    return [{"prefect.resource.id": f"mlflow.run.{run_id}", "prefect.resource.role": "mlflow-run",
             "prefect.resource.name": run_id}]


def training_event(kind: str, job: str, run_id: str | None = None,
                   **payload: Any) -> dict[str, Any]:
    """``emit_event`` arguments for ``stoker.training.<kind>`` about ``job`` (its folder name),
    related to the MLflow run when known; ``payload`` holds attempt, step, outcome, exit code.

    Raises:
        ValueError: ``kind`` is not one of :data:`TRAINING_KINDS`.
    """
    if kind not in TRAINING_KINDS:
        raise ValueError(f"training event kind {kind!r}: use one of {', '.join(TRAINING_KINDS)}")
    return {"event": f"{TRAINING}.{kind}", "resource": _job(job), "related": _run(run_id),
            "payload": {k: v for k, v in payload.items() if v is not None}}


def model_event(kind: str, name: str, version: str, job: str, run_id: str,
                **payload: Any) -> dict[str, Any]:
    """``emit_event`` arguments for ``stoker.model.<kind>`` about version ``version`` of the
    registered model ``name``, related to its job and MLflow run.

    Raises:
        ValueError: ``kind`` is not one of :data:`MODEL_KINDS`.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"model event kind {kind!r}: use one of {', '.join(MODEL_KINDS)}")
    resource = {"prefect.resource.id": f"stoker.model.{name}.{version}",
                "prefect.resource.name": f"{name} version {version}", "stoker.kind": "model",
                "stoker.model": name, "stoker.version": str(version)}
    related = [{**_job(job), "prefect.resource.role": "stoker-job"}, *_run(run_id)]
    return {"event": f"{MODEL}.{kind}", "resource": resource, "related": related,
            "payload": {k: v for k, v in payload.items() if v is not None}}
