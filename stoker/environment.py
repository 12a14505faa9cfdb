"""The environment of Stoker's commands: telemetry off, Prefect's home in the work folder, and
where a local tracking store lives. Shared by every command module (``stoker.cli``,
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


def quiet_telemetry(work_dir: Path) -> None:
    """Telemetry off and Prefect's home inside the work directory, unless the user set them."""
    os.environ.setdefault("PREFECT_HOME", str((work_dir / ".prefect").resolve()))
    private.make_dir(os.environ["PREFECT_HOME"], narrow_existing=False)
    # The local Prefect server migrates its database on first start: slow on 2 cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    for name, value in TELEMETRY_OFF.items():
        os.environ.setdefault(name, value)
