"""Reading the Docker Engine's JSON message stream (build, push, pull).

The Engine reports a failure in a message's ``errorDetail`` object (``{"code": .., "message":
..}``) and, in most versions, repeats it as the string ``error``; some engines and BuildKit
paths send only ``errorDetail``. Both are read here, so the Engine's own words reach the user
instead of a later "ended without an image id" or "returned no digest".
"""

from __future__ import annotations


def engine_error(chunk: dict) -> str | None:
    """The failure a stream message reports, in the Engine's words, or None.

    Args:
        chunk: one decoded JSON message of the stream.

    Returns:
        ``error``, else ``errorDetail.message`` (with its code when given), stripped; None when
        the message reports no failure.
    """
    error = chunk.get("error")
    if isinstance(error, str) and error.strip():
        return error.strip()
    detail = chunk.get("errorDetail")
    if isinstance(detail, dict):
        message = str(detail.get("message") or "").strip()
        code = detail.get("code")
        if message or code is not None:
            text = message or "(no message)"
            return f"{text} (code {code})" if code not in (None, "") else text
    elif isinstance(detail, str) and detail.strip():
        return detail.strip()
    return None
