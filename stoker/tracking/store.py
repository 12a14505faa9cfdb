"""The tracking store as the orchestrator meets it: opened once, and named in one line when it
cannot be used (a sqlite file that is not a database, a server that does not answer)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from stoker.config import ConfigError
from stoker.runtime.tracking import URL_PASSWORD, ensure_store


class TrackingStoreError(ConfigError):
    """The tracking store cannot be opened, read or written (bad input: exit 2, one line)."""


def safe_uri(uri: str) -> str:
    """``uri`` with any password in it masked (``http://user:***@host``)."""
    return URL_PASSWORD.sub(r"\1***@", uri)


def store_error(uri: str, error: BaseException, job: str | None = None,
                run_id: str | None = None) -> TrackingStoreError:
    """The one line for a store that cannot be used.

    Args:
        uri: the tracking URI (its password is masked).
        error: the cause, named by its type and first 300 characters (on one line).
        job: the job the store was opened for, if known yet.
        run_id: the job's recorded MLflow run, if it has one yet.
    """
    message = safe_uri(" ".join(str(error).split()))[:300]
    what = (f"cannot read MLflow run {run_id} of job {job}" if run_id
            else f"cannot be opened for job {job}" if job else "cannot be opened")
    return TrackingStoreError(
        f"tracking store {safe_uri(uri)}: {what} ({type(error).__name__}: {message}); check "
        "that the store is reachable and intact, then run the same command (it resumes)")


def open_store(uri: str, job: str | None = None, run_id: str | None = None,
               say: Callable[[str], None] | None = None) -> None:
    """Create (an embedded sqlite store) or reach the tracking store ``uri``.

    Args:
        uri: the tracking URI.
        job: the job it is opened for, if known yet (named in the error).
        run_id: the job's recorded MLflow run, if it has one yet (named in the error).
        say: told, before and after, when a new sqlite store is created (its migrations take
            seconds: a first run said nothing meanwhile).

    Raises:
        TrackingStoreError: it cannot be created or read, in one line (:func:`store_error`).
    """
    new = uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists()
    if new and say is not None:
        say(f"creating the MLflow store (once): {uri.removeprefix('sqlite:///')}")
    started_s = time.monotonic()
    try:
        ensure_store(uri)
    except Exception as e:  # noqa: BLE001 - sqlalchemy, sqlite, OS errors: the store is unusable
        raise store_error(uri, e, job, run_id) from None
    if new and say is not None:
        say(f"MLflow store ready in {time.monotonic() - started_s:.1f} s")
