"""Training and model events for Prefect automations: names, resources and payloads.

No Prefect here: :func:`training_event` and :func:`model_event` return the keyword arguments of
``prefect.events.emit_event``; the tasks emit them. Events (the flow run and task run are added
as related resources by Prefect):

- ``stoker.training.started``: the first attempt of a job starts;
- ``stoker.training.resumed``: a later attempt starts (after a preemption, a failure, or in a new
  flow run of an unfinished job);
- ``stoker.training.preempted``: an attempt was preempted (its stop checkpoint committed);
- ``stoker.training.completed`` / ``stoker.training.failed``: the job's training ended;
- ``stoker.training.straggler``: rank 0 found a rank slower than ``train.straggler.threshold``
  times the median (:func:`straggler_notice`, from the ranks' ``straggler`` progress event);
- ``stoker.model.registered``: a new model version; ``stoker.model.promoted``: it became
  ``champion``.
"""

from __future__ import annotations

from typing import Any

from stoker.runtime.records import integer, real_number

TRAINING = "stoker.training"
MODEL = "stoker.model"
TRAINING_KINDS = ("started", "resumed", "preempted", "completed", "failed", "straggler")
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


def straggler_notice(job: str, run_id: str | None,
                     record: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The flow's warning line and ``emit_event`` arguments for a ranks' ``straggler`` progress
    event (:mod:`stoker.runtime.stragglers`).

    Args:
        job: the job's folder name.
        run_id: the MLflow run, when known.
        record: one line of ``progress.jsonl``: ``rank``, ``relative_score``, ``step_s`` and
            ``median_step_s`` (s per step), ``data_wait_s``, ``first_step``, ``step``.

    Returns:
        (line, event arguments), or None when the record is not a whole straggler event (a
        field missing or of the wrong type).
    """
    rank, score = integer(record.get("rank")), real_number(record.get("relative_score"))
    step_s, median_s = real_number(record.get("step_s")), real_number(record.get("median_step_s"))
    first, last = integer(record.get("first_step")), integer(record.get("step"))
    if None in (rank, score, step_s, median_s, first, last):
        return None
    data_s = real_number(record.get("data_wait_s"))
    line = (f"straggler: rank {rank} is {score:.1f}x slower than the median rank "
            f"({1000 * step_s:.0f} ms vs {1000 * median_s:.0f} ms of its own time per step) over "
            f"steps {first}-{last}")
    event = training_event("straggler", job, run_id, rank=rank, relative_score=score,
                           step_s=step_s, median_step_s=median_s, data_wait_s=data_s,
                           first_step=first, step=last)
    return line, event
