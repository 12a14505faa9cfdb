"""What every launcher is: one interface, whatever runs the ranks (local torchrun, Docker
containers, a Kubernetes job, a Slurm batch job)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Launcher(Protocol):
    """Runs one attempt of a job from its run spec.

    ``run`` starts the attempt's processes (the rendezvous, one launcher per node, the ranks),
    waits for them, and stops them (SIGTERM first: the ranks commit a stop checkpoint within
    the shutdown grace) when the wait is interrupted (Ctrl-C, a Prefect cancel, a stop
    request) or ``timeout_s`` passes; nothing it started outlives it. It returns one exit code
    with the runtime's contract, which :func:`stoker.launch.retry.outcome_of` classifies: 0
    completed, 75 preempted (a stop checkpoint committed), 137 an infrastructure failure (a
    node or rank lost), 2 bad input, 3 stopped on request, anything else a failure of the
    user's code. Every line the attempt prints reaches ``on_line``.

    Raises:
        TimeoutError: ``timeout_s`` passed (the attempt's processes are stopped first).
    """

    def run(self, spec_path: Path, on_line: Callable[[str], None] = print,
            timeout_s: float | None = None) -> int: ...
