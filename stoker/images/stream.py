"""Reading the Docker Engine's JSON message stream (build, push, pull).

The Engine reports a failure in a message's ``errorDetail`` object (``{"code": .., "message":
..}``) and, in most versions, repeats it as the string ``error``; some engines and BuildKit
paths send only ``errorDetail``. Both are read here, so the Engine's own words reach the user
instead of a later "ended without an image id" or "returned no digest".
"""

from __future__ import annotations

import re


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


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the legacy builder colors a step's stderr red
CAUSE = re.compile(r"^(ERROR|E|error|fatal)\b:?|No matching distribution|Unable to locate package")


# Why a package index was not reached: pip says "No matching distribution" after its retries
# failed, which reads as a version that does not exist (trial: a TLS-intercepting proxy).
UNREACHED = re.compile(
    r"certificate verify failed[^'\"()\]]*|self-signed certificate[^'\"()\]]*"
    r"|Name or service not known|Temporary failure in name resolution|Connection refused"
    r"|Network is unreachable|No route to host|Read timed out|Connection timed out"
    r"|ProxyError|Could not resolve host[^'\"()\]]*")
HOST = re.compile(r"host='([^']+)'")


def build_cause(lines: list[str]) -> str | None:
    """The last output line of a failed build step that says why it failed (pip's ``ERROR:``,
    apt's ``E:``, a shell's ``error:``), or None: the Engine's own error names only the step's
    command and its exit code. When the lines also say a package index could not be reached
    (TLS verification, name resolution, a refused connection), that reason is added:
    ``ERROR: No matching distribution found for torch==2.13.0; pypi.org was not reached
    (self-signed certificate in certificate chain)``."""
    plain = [ANSI.sub("", line).strip() for line in reversed(lines)]
    cause = next((line for line in plain if CAUSE.search(line)), None)
    unreached = next(((line, found) for line in plain if (found := UNREACHED.search(line))),
                     None)
    if unreached is None:
        return cause
    line, found = unreached
    host = HOST.search(line)
    reason = (f"{host[1] if host else 'a package index'} was not reached "
              f"({found[0].strip(' ,:')})")
    return f"{cause}; {reason}" if cause else reason



STEP_COMMAND = re.compile(r"""(['"])/bin/sh -c (.+?)\1(?= returned| did not complete)""",
                          re.DOTALL)


def shortened(error: str, keep: int = 80) -> str:
    """``error`` with a failed step's quoted shell command (the Engine repeats a ``RUN`` step's
    whole line, hundreds of characters) cut to its first ``keep`` characters.

    Example: ``The command '/bin/sh -c pip install ... (600 chars)' returned a non-zero code:
    1`` reads ``The command '/bin/sh -c pip install ...…' returned a non-zero code: 1``.
    """
    def cut(match: re.Match) -> str:
        command = " ".join(match[2].split())  # a continued line's runs of spaces as one
        if len(command) > keep:
            command = command[:keep] + "…"
        return f"{match[1]}/bin/sh -c {command}{match[1]}"

    return STEP_COMMAND.sub(cut, error)
