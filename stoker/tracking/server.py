"""Reachability of an MLflow tracking server, checked before any data is pulled or process started.

A dead ``tracking.tracking_uri`` otherwise surfaces minutes later, inside a rank at step 0, after
MLflow's own retries. Stores that are files (sqlite, a local path) need no check.
"""

from __future__ import annotations

import httpx

from stoker.config import ConfigError


def check_tracking_server(uri: str, timeout_s: float = 5.0,
                          name: str = "tracking.tracking_uri") -> None:
    """Ask an http(s) tracking server's ``/health`` endpoint; other URIs pass unchecked.

    Args:
        uri: the tracking URI.
        timeout_s: how long to wait for the answer, in seconds.
        name: where the URI came from, named first in the error (``--tracking-uri``).

    Raises:
        ConfigError: ``tracking.tracking_uri: no MLflow server answers at URI (reason)``, or the
            server answered ``/health`` with an error status.
    """
    if not uri.startswith(("http://", "https://")):
        return
    from urllib.parse import urlsplit, urlunsplit

    from stoker.config_base import masked_url

    parts = urlsplit(uri)  # the fragment is no part of a request (trial: "#token=..." was)
    url = urlunsplit((*parts[:4], "")).rstrip("/") + "/health"
    shown = masked_url(uri)
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        reason = type(e).__name__ if not str(e) else str(e)
        raise ConfigError(f"{name}: no MLflow server answers at {shown} "
                          f"({reason})") from None
    if response.status_code >= 400:
        raise ConfigError(f"{name}: {shown} answered /health with HTTP "
                          f"{response.status_code}; is it an MLflow tracking server?")
