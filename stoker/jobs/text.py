"""How a job's messages quote free text (a stop reason, an error from a bucket): on one line."""

from __future__ import annotations

import re

MAX_REASON = 300  # characters of a reason kept: it is quoted in one-line messages


def one_line(text: str) -> str:
    """``text`` as one line for the messages that quote it: every run of whitespace and control
    characters (a newline, a tab, an escape sequence's ESC) is one space; at most
    ``MAX_REASON`` characters (then ``…``)."""
    flat = " ".join(re.sub(r"[\x00-\x1f\x7f]+", " ", text).split())
    return flat if len(flat) <= MAX_REASON else flat[:MAX_REASON - 1] + "…"
