"""Whether a peer rank this rank waits for outside a collective is still there (no torch, no
Prefect).

A collective notices a dead peer at once (gloo: ``Connection closed by peer``), but rank 0's wait
for the other ranks' checkpoint digests is a poll of files: a rank killed before it wrote its
digest was waited on until ``commit_timeout_s``, or until torchrun's SIGKILL 30 s after it had
seen the death, silently (issue 45's re-trial). This module answers "is rank r gone?" from what
this node knows: the rank's heartbeat (:mod:`stoker.runtime.hang`) names its pid, and the process
behind that pid must be alive and a sibling of this rank (a child of the same torchrun); a rank on
another node (no heartbeat here) is never called gone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from stoker.runtime import CheckpointError
from stoker.runtime.hang import HEARTBEAT_DIR_ENV, read_beats

log = logging.getLogger(__name__)

PEER_CHECK_EVERY_S = 0.5  # between two looks at a peer's process while waiting for it
PEER_WAIT_SAY_S = 5.0  # a wait on a peer longer than this is said in one line


class PeerGone(CheckpointError):
    """A rank this rank waited for is gone (killed, exited) or never answered within the wait:
    an infrastructure failure (exit 137, retried from the last committed checkpoint), not a
    user error."""


class PeerWait:
    """One wait for other ranks outside a collective (rank 0's wait for their checkpoint
    digests): the caller polls what it waits for and calls :meth:`check` between polls.

    Args:
        what: what waits, for the messages (``"checkpoint <folder>"``).
        timeout_s: the longest wait, s.
        gone: ``rank -> reason or None`` (:func:`local_peer_gone`); None: only the timeout.
    """

    def __init__(self, what: str, timeout_s: float,
                 gone: Callable[[int], str | None] | None = None):
        self.what, self.timeout_s, self.gone = what, timeout_s, gone
        self.started = self._checked = time.monotonic()
        self._said = False

    def check(self, rank: int, waited_for: str) -> None:
        """Between two polls for ``waited_for`` of rank ``rank``: say a wait past
        ``PEER_WAIT_SAY_S`` once (a warning), look at the rank every ``PEER_CHECK_EVERY_S``.

        Raises:
            PeerGone: the rank is gone, or ``timeout_s`` has passed.
        """
        now = time.monotonic()
        if self.gone is not None and now - self._checked >= PEER_CHECK_EVERY_S:
            self._checked = now
            if (reason := self.gone(rank)) is not None:
                raise PeerGone(f"{self.what}: {reason} before it wrote {waited_for}; "
                               "left uncommitted")
        if now - self.started > self.timeout_s:
            raise PeerGone(f"{self.what}: rank {rank} did not write {waited_for} within "
                           f"{self.timeout_s:.0f} s; left uncommitted")
        if not self._said and now - self.started >= PEER_WAIT_SAY_S:
            self._said = True
            log.warning("%s: waiting %.0f s so far for rank %d to write %s (given up after "
                        "%.0f s, or as soon as the rank is gone)", self.what,
                        now - self.started, rank, waited_for, self.timeout_s)


def peer_gone(error: BaseException | None) -> PeerGone | None:
    """The :class:`PeerGone` in ``error`` or its causes, None when there is none."""
    while error is not None:
        if isinstance(error, PeerGone):
            return error
        error = error.__cause__ or error.__context__
    return None


def local_peer_gone(rank: int, folder: str | Path | None = None) -> str | None:
    """Why rank ``rank`` is gone (``"rank 1 (pid 4242) has exited"``), or None when it runs or
    nothing is known of it here.

    Args:
        rank: the peer's global rank.
        folder: the attempt's heartbeat folder; None: ``STOKER_HEARTBEAT_DIR``.

    Returns:
        A reason when the rank's heartbeat names a pid whose process has ended (or is a zombie,
        or is no longer a child of this rank's parent: the pid was reused); None without a
        heartbeat folder or a heartbeat of that rank (a rank on another node).
    """
    import psutil

    folder = folder or os.environ.get(HEARTBEAT_DIR_ENV, "").strip()
    if not folder or not Path(folder).is_dir():
        return None
    beat = read_beats(folder).get(rank)
    if beat is None:
        return None
    try:
        proc = psutil.Process(beat.pid)
        if proc.ppid() != os.getppid():  # not torchrun's child any more: another process
            return f"rank {rank} (pid {beat.pid}) has exited"
        if proc.status() == psutil.STATUS_ZOMBIE:
            return f"rank {rank} (pid {beat.pid}) has exited"
    except psutil.NoSuchProcess:
        return f"rank {rank} (pid {beat.pid}) has exited"
    except psutil.Error:  # not ours to look at: say nothing rather than guess
        return None
    return None
