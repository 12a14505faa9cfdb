"""Preemption notices: a signal handler and an optional cloud notice poller that set one flag.

Neither acts: the training loop reads the flag at the next step boundary, all ranks agree on it
with one collective, save together and exit with EXIT_PREEMPTED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG).

    A SIGKILLed orchestrator or torchrun cannot clean up; with this, its children still get
    SIGTERM (the runtime checkpoints and exits) instead of training on as orphans. No-op where
    prctl is unavailable.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG


# torchrun's wrapper (stoker.runtime.launch) names a file here; a rank writes it once the stop
# checkpoint has committed on every rank, so "preempted" (75) is claimed only when it is true.
STOP_COMMITTED_ENV = "STOKER_STOP_COMMITTED_FILE"


def record_stop_committed(step: int) -> None:
    """Note that the stop checkpoint at ``step`` committed (no-op outside the launch wrapper)."""
    path = os.environ.get(STOP_COMMITTED_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(f"{step}\n")


class StopFlag:
    """Set once a stop was requested; ``reason`` says by whom (e.g. ``SIGTERM``)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._poller: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def install(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)):
        """Route ``signals`` to this flag (main thread only). Only sets the flag: safe anywhere."""
        for sig in signals:
            signal.signal(sig, lambda signum, _frame: self.request(signal.Signals(signum).name))
        return self

    def watch_notice_url(self, url: str, interval_s: float = 5.0, timeout_s: float = 2.0) -> None:
        """Poll a preemption-notice endpoint in a daemon thread.

        The AWS spot format: ``GET http://169.254.169.254/latest/meta-data/spot/instance-action``
        answers 404 until a notice exists, then 200 with JSON ``{"action": "terminate"|"stop",
        "time": "..."}``. Any 200 whose JSON action is terminate/stop/hibernate sets the flag.
        Connection errors are logged at debug level and polling goes on.
        """
        import requests

        def poll() -> None:
            session = requests.Session()
            while not self._event.wait(interval_s):
                try:
                    response = session.get(url, timeout=timeout_s)
                except requests.RequestException as e:
                    log.debug("preemption notice poll %s failed: %s", url, e)
                    continue
                if response.status_code != 200:
                    continue
                try:
                    action = response.json().get("action")
                except ValueError:
                    action = None
                if action in ("terminate", "stop", "hibernate"):
                    self.request(f"preemption notice ({action}) from {url}")

        self._poller = threading.Thread(target=poll, name="preemption-notice", daemon=True)
        self._poller.start()
