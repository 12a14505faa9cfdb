"""Job identity: the same command resumes an unfinished job and starts a new one otherwise.

A job lives in ``<work_dir>/jobs/<key>-<UTC time>/``; ``key`` hashes what defines the training
trajectory (train config fields that change results, and the dataset content hash). A job whose
folder has no ``pipeline_done.json`` is unfinished: running the pipeline again with the same key
continues it from its last committed checkpoint. Processes per node are not part of the key, so
a job can resume at another world size.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path

from stoker.config import PipelineConfig
from stoker.runtime.trainer import TRAJECTORY_FIELDS

DONE_MARKER = "pipeline_done.json"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def job_key(config: PipelineConfig, dataset_md5: str) -> str:
    """12 hex digits of sha256 over the trajectory-defining config and the dataset hash."""
    train = config.train.model_dump(mode="json")
    payload = {f: train[f] for f in TRAJECTORY_FIELDS}
    payload |= {"dataset": dataset_md5, "experiment": config.tracking.experiment}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def resolve_job_dir(config: PipelineConfig, dataset_md5: str) -> Path:
    """The folder of the job to run: ``config.job_id`` if given, else the newest unfinished job
    with the same key, else a new one.

    Raises:
        ValueError: ``job_id`` is not a plain folder name.
    """
    jobs = config.work_dir.resolve() / "jobs"
    if config.job_id:
        if not _JOB_ID.match(config.job_id):
            raise ValueError(f"job_id {config.job_id!r}: use letters, digits, '.', '_' or '-'")
        return jobs / config.job_id
    key = job_key(config, dataset_md5)
    unfinished = [p for p in sorted(jobs.glob(f"{key}-*")) if not (p / DONE_MARKER).exists()]
    if unfinished:
        return unfinished[-1]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return jobs / f"{key}-{stamp}"


def mark_done(job_dir: Path, summary: dict) -> None:
    """Record that the pipeline finished this job (training, registration, report)."""
    tmp = job_dir / (DONE_MARKER + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(job_dir / DONE_MARKER)
