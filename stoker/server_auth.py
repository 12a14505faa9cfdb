"""Pre-flight of credentials: the Prefect API and the MLflow server take this user's credential.

Asked once, before anything is pulled, created or started: a missing or wrong credential is one
line naming the server (its URL without userinfo) and the variable to set, instead of a 401 deep
inside a flow or a rank minutes later. The secret itself is never part of the line.

A server that does not answer is not this module's business: the checks pass, and whatever
reported a dead server before still does (``check_tracking_server`` for MLflow; Prefect's client
for the Prefect API).
"""

from __future__ import annotations

import base64
import os
import tomllib
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from stoker.config import ConfigError

TIMEOUT_S = 5.0  # a server that takes longer is left to the existing checks
PREFECT_VARS = "PREFECT_API_AUTH_STRING (PREFECT_API_KEY for Prefect Cloud)"
MLFLOW_VARS = "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"


class CredentialError(ConfigError):
    """A server refused this user's credential, or asked for one (bad input: exit 2)."""


def public_url(url: str) -> str:
    """``url`` without its userinfo (``http://user:pw@host:5000/x`` -> ``http://host:5000/x``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _refused(server: str, url: str, status: int, given: str | None, variables: str) -> str:
    """The one line for a refused request (``given``: the variable that was sent, if any)."""
    what = (f"refused the credential in {given} (HTTP {status}): set {given} to a valid one"
            if given else f"asks for a credential (HTTP {status}): set {variables}")
    return f"{server} {public_url(url)} {what}"


def _ask(method: str, url: str, headers: dict[str, str], timeout_s: float,
         **kwargs) -> int | None:
    """The HTTP status of one request, or None when the server does not answer."""
    try:
        return httpx.request(method, url, headers=headers, timeout=timeout_s, **kwargs).status_code
    except httpx.HTTPError:
        return None


def prefect_credential() -> tuple[str | None, dict[str, str]]:
    """The variable that holds this client's Prefect credential and its header, as Prefect's
    client sends it (the auth string wins over the API key); ``(None, {})`` without one.

    Read from the environment, else from the active profile of Prefect's profiles file, without
    importing Prefect: its settings, once imported, would miss the PREFECT_HOME that ``stoker
    run`` sets afterwards."""
    values = {**_prefect_profile(), **os.environ}
    for name, scheme in (("PREFECT_API_AUTH_STRING", "Basic"), ("PREFECT_API_KEY", "Bearer")):
        if value := str(values.get(name) or ""):
            if scheme == "Basic":
                value = base64.b64encode(value.encode()).decode()
            return name, {"Authorization": f"{scheme} {value}"}
    return None, {}


def _prefect_profile() -> dict[str, object]:
    """The settings of Prefect's active profile (PREFECT_PROFILE, else the file's ``active``),
    from PREFECT_PROFILES_PATH, else ``$PREFECT_HOME/profiles.toml`` (``~/.prefect``); {}
    when there is none or it cannot be read."""
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    found = profiles.get("profiles", {}).get(active, {})
    return found if isinstance(found, dict) else {}


def check_prefect_api(api_url: str | None = None, timeout_s: float = TIMEOUT_S) -> None:
    """Ask the Prefect API (``api_url``, default ``PREFECT_API_URL``) to list one flow.

    Args:
        api_url: the API's URL (``http://host:4200/api``); None and no PREFECT_API_URL: Stoker's
            local server (no credential), nothing checked.
        timeout_s: how long to wait for the answer, in seconds.

    Raises:
        CredentialError: HTTP 401 or 403: the server (without userinfo) and the variable to set.
    """
    api_url = api_url or os.environ.get("PREFECT_API_URL")
    if not api_url:
        return
    given, headers = prefect_credential()
    status = _ask("POST", api_url.rstrip("/") + "/flows/filter", headers, timeout_s,
                  json={"limit": 1})
    if status in (401, 403):
        raise CredentialError(_refused("Prefect API", api_url, status, given, PREFECT_VARS))


def mlflow_credential() -> tuple[str | None, dict[str, str]]:
    """The variables that hold this client's MLflow credential and its header, as MLflow's
    client sends it (username and password win over the token); ``(None, {})`` without one."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user or password:
        token = base64.b64encode(f"{user or ''}:{password or ''}".encode()).decode()
        return ("MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD",
                {"Authorization": f"Basic {token}"})
    if bearer := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return "MLFLOW_TRACKING_TOKEN", {"Authorization": f"Bearer {bearer}"}
    return None, {}


def check_mlflow_server(uri: str, timeout_s: float = TIMEOUT_S) -> None:
    """Ask an http(s) tracking server to list one experiment; other stores pass unchecked.

    Args:
        uri: the tracking URI (``http://host:5000``).
        timeout_s: how long to wait for the answer, in seconds.

    Raises:
        CredentialError: HTTP 401 or 403: the server (without userinfo) and the variables to set.
    """
    if not uri.startswith(("http://", "https://")):
        return
    given, headers = mlflow_credential()
    status = _ask("GET", uri.rstrip("/") + "/api/2.0/mlflow/experiments/search", headers,
                  timeout_s, params={"max_results": 1})
    if status in (401, 403):
        raise CredentialError(_refused("MLflow tracking server", uri, status, given,
                                       MLFLOW_VARS))


def check_servers(tracking_uri: str, prefect_api_url: str | None = None) -> None:
    """Both checks, Prefect first: what ``stoker run`` asks before anything else.

    Raises:
        CredentialError: as :func:`check_prefect_api` and :func:`check_mlflow_server`.
    """
    check_prefect_api(prefect_api_url)
    check_mlflow_server(tracking_uri)
