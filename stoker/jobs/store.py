"""Job state on durable storage (a bucket), so that a job survives losing its machine.

With a top-level ``checkpoint_dir`` (a path or fsspec URL such as ``s3://bucket/jobs``) every job
keeps, under ``<checkpoint_dir>/<job name>/``:

    checkpoints/step-*/        committed checkpoints (written there directly by the runtime)
    attempts.jsonl             the attempt record (attempts, preemptions, billed time)
    mlflow_run_id              the MLflow run the job logs to
    spec.yaml                  the run spec of the last launch
    progress.jsonl, heartbeat.json, result.json, pipeline_done.json
    billed.json                what the closed attempts were billed (``stoker.jobs.billed``)
    lease.json                 who trains the job now, until when (see ``BucketLease``)

The local ``<work_dir>/jobs/<job name>/`` folder is a cache: ``pull`` fills a fresh one from the
bucket (another node, an empty disk) and ``push`` copies the records back. The records that
decide resumption and billing (the attempt record, the spec, the done marker; the runtime writes
``mlflow_run_id`` itself) are written through at once (``write_through``), so a node killed right
after writing one loses nothing; ``RecordSync`` pushes the rest (progress, heartbeat) every few
seconds while the job trains.

Fencing: while a node owns a job (``own``), every push first checks that the lease object in the
bucket is still this node's; a node whose lease was taken over writes nothing more there.

Credentials come from the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ...), read by s3fs/boto3 themselves; they are never logged.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec

from stoker.config import ConfigError
from stoker.jobs.text import one_line
from stoker.runtime import private
from stoker.runtime.records import real_number

log = logging.getLogger(__name__)

RECORDS = ("attempts.jsonl", "mlflow_run_id", "spec.yaml", "progress.jsonl", "heartbeat.json",
           "result.json", "pipeline_done.json", "billed.json")
DONE_MARKER = "pipeline_done.json"


class BucketError(ConfigError):
    """The job store (``checkpoint_dir``) cannot be reached, read or written."""


# Jobs this process owns in a bucket: job folder -> (store, lease check), and one lock per job so
# that a write-through and a periodic push never land out of order.
_OWNED: dict[Path, tuple[JobStore, Callable[[], None]]] = {}
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def own(job_dir: Path, store: JobStore, check: Callable[[], None]) -> None:
    """Register ``job_dir`` as held in ``store``: ``check`` (raising ``LeaseLost`` once the
    lease is another node's) guards every push, and ``write_through`` pushes at once."""
    _OWNED[Path(job_dir).resolve()] = (store, check)


def disown(job_dir: Path) -> None:
    _OWNED.pop(Path(job_dir).resolve(), None)


def _lock(name: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(name, threading.Lock())


def write_through(job_dir: Path, *records: str) -> None:
    """Push ``records`` of ``job_dir`` to its bucket now, when this process owns the job there
    (a no-op otherwise). A store error or a lost lease is logged, never raised: the caller's
    local record stands, and the periodic push (or the next run) catches up."""
    owner = _OWNED.get(Path(job_dir).resolve())
    if owner is None:
        return
    try:
        owner[0].push(Path(job_dir), records)
    except Exception as e:  # the bucket down, or the job another node's now (LeaseLost)
        log.warning("job %s: %s not written to %s (%s: %s)", Path(job_dir).name,
                    ", ".join(records), owner[0].url, type(e).__name__, str(e)[:200])


def _redact(text: str) -> str:
    """An error message without anything that looks like a secret key."""
    return re.sub(r"(?i)(secret[_a-z]*['\"]?\s*[:=]\s*)\S+", r"\1***", text)


class JobStore:
    """The durable home of job state under one ``checkpoint_dir``.

    Args:
        url: ``checkpoint_dir``: a local path or an fsspec URL (``s3://bucket/jobs``).
    """

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        # A fresh filesystem: a cached one would keep the credentials it was made with.
        self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True)
        self.root = self.root.rstrip("/")
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        self.local = bool({"file", "local"} & set(protocols))

    def put(self, path: str, data: bytes) -> None:
        """Write one object (a whole file) at ``path`` (a path inside the store)."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        private.fs_make_dir(self.fs, path.rsplit("/", 1)[0])  # (a bucket has no folders)
        with private.fs_open(self.fs, path, "wb") as f:
            f.write(data)

    def job_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def checkpoints(self, name: str) -> str:
        """The checkpoint location of job ``name`` (path or URL), as given to the runtime."""
        return f"{self.job_url(name)}/checkpoints"

    def _path(self, name: str, record: str = "") -> str:
        return f"{self.root}/{name}" + (f"/{record}" if record else "")

    def check(self) -> None:
        """Write, read back and delete a probe object, before anything trains.

        Raises:
            BucketError: naming ``checkpoint_dir`` and the store's reason (wrong credentials,
                no such bucket, endpoint down); secrets are never part of the message.
        """
        probe = f"{self.root}/.stoker-probe-{uuid.uuid4().hex}"
        try:
            if self.local:
                # A bucket is never created here; a shared folder keeps its mode.
                private.fs_make_dir(self.fs, self.root, narrow_existing=False)
            self.fs.pipe_file(probe, b"ok")
            if self.fs.cat_file(probe) != b"ok":
                raise OSError("probe object read back differently")
            self.fs.rm_file(probe)
        except Exception as e:  # botocore/aiohttp raise many types: all mean "unusable store"
            raise BucketError(f"checkpoint_dir {self.url}: cannot write there "
                              f"({type(e).__name__}: {_redact(str(e))[:300]}); check the "
                              "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), "
                              "AWS_ENDPOINT_URL and that the bucket exists") from None

    def unfinished(self, key: str) -> list[str]:
        """Names of the jobs with ``key`` that are not done, oldest first."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return [n for n in names if n.startswith(f"{key}-")
                and not self.fs.exists(self._path(n, DONE_MARKER))]

    def jobs(self) -> list[str]:
        """Names of every job in the store, sorted."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries
                 if e.get("type") == "directory"]
        return sorted(n for n in names if not n.startswith("."))

    def lease(self, name: str) -> dict | None:
        """The job's lease object (who trains it now), or None (none, or unreadable)."""
        try:
            record = json.loads(self.fs.cat_file(self._path(name, "lease.json")))
        except (FileNotFoundError, ValueError):
            return None
        return record if isinstance(record, dict) and isinstance(record.get("token"), str) \
            and real_number(record.get("expires")) is not None else None

    def is_done(self, name: str) -> bool:
        return self.fs.exists(self._path(name, DONE_MARKER))

    def pull(self, name: str, job_dir: Path, refresh: bool = False) -> list[str]:
        """Refresh the local cache ``job_dir`` of job ``name`` from the store; returns the
        records copied. A record the cache lacks is copied; an append-only one
        (``*.jsonl``) is replaced when the store's is longer (another node ran the job since
        this cache was written); other records already cached are kept, unless ``refresh``
        (a node that does not train the job, showing it: the store's are newer)."""
        private.make_dir(job_dir)
        copied = []
        self.fs.invalidate_cache(self._path(name))
        for record in RECORDS:
            local = job_dir / record
            if local.exists() and not record.endswith(".jsonl") and not refresh:
                continue
            try:
                data = self.fs.cat_file(self._path(name, record))
            except FileNotFoundError:
                continue
            if local.exists() and (len(data) <= local.stat().st_size if record.endswith(".jsonl")
                                   else data == local.read_bytes()):
                continue  # the cache is as new (or newer: a push that failed)
            tmp = local.with_name(f".{record}.pull")
            private.write_bytes(tmp, data)
            tmp.replace(local)
            copied.append(record)
        return copied

    def push(self, job_dir: Path, records: tuple[str, ...] = RECORDS) -> None:
        """Copy the records of ``job_dir`` to the store (each object replaced whole).

        Raises:
            LeaseLost: this process owns the job (``own``) but the bucket lease is no longer its.
        """
        owner = _OWNED.get(Path(job_dir).resolve())
        with _lock(job_dir.name):
            if owner is not None:
                owner[1]()  # fencing: right before the writes
            for record in records:
                local = job_dir / record
                if local.exists():
                    self.put(self._path(job_dir.name, record), local.read_bytes())


class RecordSync(threading.Thread):
    """Pushes a job's records to the store every ``every_s`` seconds until ``stop``.

    A failed push is logged and retried at the next tick: the bucket being down must not stop
    training (the checkpoints carry the state; the records catch up)."""

    def __init__(self, store: JobStore, job_dir: Path, every_s: float = 3.0):
        super().__init__(daemon=True, name=f"records-{job_dir.name}")
        self.store, self.job_dir, self.every_s = store, job_dir, every_s
        self._stop_event = threading.Event()

    def sync(self) -> bool:
        try:
            self.store.push(self.job_dir)
            return True
        except Exception as e:  # any store error: retried at the next tick
            log.warning("job %s: records not pushed to %s (%s: %s); retrying",
                        self.job_dir.name, self.store.url, type(e).__name__,
                        one_line(str(e))[:200])
            return False

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            self.sync()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)
        self.sync()
