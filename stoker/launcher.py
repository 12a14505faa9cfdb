"""Launch the training runtime, classify how each attempt ended, and retry what is worth retrying.

No Prefect here: the ``train`` task wraps these functions. The exit-code contract is the runtime's
(see ``stoker.runtime.launch``): 0 done, 75 preempted, 137 killed (infrastructure), else a bug.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import psutil
from tenacity import Retrying, retry_if_result, stop_never, wait_exponential

from stoker.config import RetryConfig
from stoker.runtime import EXIT_OK, EXIT_PREEMPTED
from stoker.runtime.preemption import die_with_parent

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    COMPLETED = "completed"
    PREEMPTED = "preempted"
    INFRASTRUCTURE = "infrastructure_failure"
    USER_ERROR = "user_error"


def classify_exit(code: int) -> Outcome:
    """Map an attempt's exit code to its outcome (negative codes: killed by that signal)."""
    if code == EXIT_OK:
        return Outcome.COMPLETED
    if code == EXIT_PREEMPTED:
        return Outcome.PREEMPTED
    if code in (137, -signal.SIGKILL):
        return Outcome.INFRASTRUCTURE
    return Outcome.USER_ERROR


@dataclass(frozen=True)
class Attempt:
    """One launch of the runtime. Times are Unix seconds; ``duration_s`` in seconds."""

    number: int
    exit_code: int
    outcome: Outcome
    started: float
    duration_s: float

    def to_dict(self) -> dict:
        return {**asdict(self), "outcome": str(self.outcome)}


def terminate_tree(pid: int, grace_s: float) -> list[int]:
    """SIGTERM ``pid`` and all its descendants, SIGKILL whatever is left after ``grace_s``.

    Also kills the process group ``pid`` leads (the launcher starts torchrun in its own session),
    which catches processes that re-parented away from the tree. Returns the pids signalled.
    """
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)
    _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    return [p.pid for p in procs]


class LocalLauncher:
    """torchrun as a child process in its own session, rendezvous on 127.0.0.1.

    Args:
        nproc_per_node: worker processes (ranks) to start.
        shutdown_grace_s: seconds workers get to checkpoint after SIGTERM before SIGKILL
            (torchrun ``--shutdown-timeout``; the tree kill waits a little longer).
        python: interpreter that has Stoker and torch installed.
        env: extra environment variables for the workers.
    """

    def __init__(self, nproc_per_node: int, shutdown_grace_s: float = 25.0,
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 rdzv_host: str = "127.0.0.1"):
        self.nproc_per_node = nproc_per_node
        self.shutdown_grace_s = shutdown_grace_s
        self.python = python
        self.env = env or {}
        self.rdzv_host = rdzv_host
        self.process: subprocess.Popen | None = None

    def command(self, spec_path: Path) -> list[str]:
        """The command line: torchrun (with the exit-code contract) running the runtime."""
        return [
            self.python, "-m", "stoker.runtime.launch",
            "--nnodes=1", f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.rdzv_host}:0",
            f"--rdzv-id={uuid.uuid4().hex[:12]}", f"--local-addr={self.rdzv_host}",
            "--max-restarts=0", f"--shutdown-timeout={int(self.shutdown_grace_s)}",
            "-m", "stoker.runtime", str(spec_path),
        ]

    def run(self, spec_path: Path, on_line: Callable[[str], None] = print,
            timeout_s: float | None = None) -> int:
        """Run one attempt to its end and return its exit code.

        Output (stdout and stderr, merged) is passed line by line to ``on_line``. If the call is
        interrupted (timeout, cancellation, KeyboardInterrupt, any exception) the whole process
        tree is terminated before the exception propagates: no worker outlives the call.

        Raises:
            subprocess.TimeoutExpired: the attempt ran longer than ``timeout_s``.
        """
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            self.command(spec_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True, preexec_fn=die_with_parent,
        )
        reader = threading.Thread(target=_pump, args=(self.process.stdout, on_line), daemon=True)
        reader.start()
        try:
            code = self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                terminate_tree(self.process.pid, self.shutdown_grace_s + 5)
                self.process.wait()
            else:  # torchrun is gone; make sure nothing it started is left either
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
            reader.join(timeout=5)
        return code


def _pump(stream, on_line: Callable[[str], None]) -> None:
    for line in stream:
        on_line(line.rstrip("\n"))


RETRYABLE = {Outcome.PREEMPTED, Outcome.INFRASTRUCTURE, Outcome.USER_ERROR}


def budget_for(policy: RetryConfig, outcome: Outcome) -> int:
    """How many attempts ending with ``outcome`` may be retried."""
    return {Outcome.PREEMPTED: policy.max_preemptions,
            Outcome.INFRASTRUCTURE: policy.max_infra_failures,
            Outcome.USER_ERROR: policy.max_user_errors}.get(outcome, 0)


def run_with_retries(launch: Callable[[int], int], policy: RetryConfig,
                     on_attempt: Callable[[Attempt], None] = lambda a: None,
                     sleep: Callable[[float], None] = time.sleep) -> list[Attempt]:
    """Call ``launch(attempt_number)`` until it completes or a retry budget is spent.

    Each outcome has its own budget (``policy``). A preempted attempt is resumed at once; after
    failures the wait grows exponentially from ``policy.backoff_s`` up to
    ``policy.backoff_max_s`` seconds.

    Returns:
        All attempts, oldest first; the last one's outcome is the job's.
    """
    attempts: list[Attempt] = []

    def once() -> Attempt:
        started = time.time()
        code = launch(len(attempts) + 1)
        attempt = Attempt(len(attempts) + 1, code, classify_exit(code), started,
                          round(time.time() - started, 3))
        attempts.append(attempt)
        on_attempt(attempt)
        return attempt

    def should_retry(attempt: Attempt) -> bool:
        if attempt.outcome not in RETRYABLE:
            return False
        used = sum(1 for a in attempts if a.outcome == attempt.outcome)
        return used <= budget_for(policy, attempt.outcome)

    backoff = wait_exponential(multiplier=policy.backoff_s, max=policy.backoff_max_s)

    def wait(state) -> float:
        # A preempted attempt committed its checkpoint: resume at once. Failures back off.
        if state.outcome.result().outcome == Outcome.PREEMPTED:
            return 0.0
        return backoff(state)

    retrying = Retrying(retry=retry_if_result(should_retry), stop=stop_never, sleep=sleep,
                        wait=wait)
    retrying(once)
    return attempts
