"""The environment of Stoker's commands: telemetry off, Prefect's home (one per user and
machine), and where a local tracking store lives. Shared by every command module (``stoker.cli``,
``stoker.predict_cli``, ``stoker.server_cli``) without importing one another."""

from __future__ import annotations

import os
from pathlib import Path

from stoker.runtime import private

TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1",
                 # and no progress bars of MLflow's artifact downloads in a terminal log
                 "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (relative to the current directory
    when written with three slashes and a relative path), else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///"))


def prefect_home() -> Path:
    """Prefect's home for Stoker's commands, where the one local Prefect server of this user
    and machine keeps its database, log and record: ``PREFECT_HOME`` when set, else
    ``prefect`` in the user's state folder (``$XDG_STATE_HOME/stoker``, by default
    ``~/.local/state/stoker`` on Linux; platformdirs' ``user_state_path``), whatever the work
    folder, so every work folder reuses one server.

    Returns:
        An absolute path (not created here).
    """
    from platformdirs import user_state_path

    home = os.environ.get("PREFECT_HOME") or user_state_path("stoker") / "prefect"
    return Path(home).expanduser().resolve()


def quiet_telemetry(work_dir: Path) -> None:
    """Telemetry off and Prefect's home set (:func:`prefect_home`), unless the user set them.

    Args:
        work_dir: the command's work folder (Prefect's home no longer depends on it).
    """
    os.environ["PREFECT_HOME"] = str(prefect_home())
    private.make_dir(os.environ["PREFECT_HOME"], narrow_existing=False)
    # What a new local server may take to answer (its database is prepared before it starts).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    for name, value in TELEMETRY_OFF.items():
        os.environ.setdefault(name, value)
