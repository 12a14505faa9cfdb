"""Run torchrun on this host as one attempt, and terminate process trees that must not outlive it.

No Prefect here. ``LocalLauncher.run`` has the launcher interface of :mod:`stoker.launch.factory`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from stoker.runtime.preemption import die_with_parent


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
        # OMP_NUM_THREADS=1 is what torchrun sets for several processes per node; set here, it
        # skips torchrun's four-line banner about it at every attempt. A user's value wins.
        omp = {"OMP_NUM_THREADS": "1"} if self.nproc_per_node > 1 else {}
        env = {**omp, **os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
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
