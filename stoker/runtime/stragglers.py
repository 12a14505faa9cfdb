"""Slow ranks (stragglers): each rank's own step time and data wait, and rank 0's scores.

In synchronous DDP every rank's step lasts as long as the slowest rank's: the fast ranks wait in
the collectives (the buffer broadcast at the start of the forward pass, the gradient all-reduce
at the end of the backward pass). A rank's **own** step time is its step's wall time less those
waits (:class:`StepClock`), so the slow rank is the one with the longest own time. The figures
ride on the loop's existing agreement collective (no extra collective): each rank adds its sums
since the last agreement to its own slots of the summed vector, and rank 0 gathers them into
windows of ``train.straggler.window_steps`` steps (:class:`StragglerWindows`).

Scores, per window: **relative** = a rank's own step time / the lower median over the ranks
(``statistics.median_low``: 1.0 for the typical rank, 2.0 for a rank twice as slow; with two
ranks it is the faster one's time); **individual** = a rank's own step time / its best window
so far. A rank whose relative score reaches ``train.straggler.threshold`` in
``train.straggler.windows`` consecutive windows is a straggler.

No Prefect, no collectives here: the trainer calls it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("stoker.runtime")

# Per rank, the sums each agreement carries: own step seconds, data-wait seconds.
FIGURES = 2


class StepClock:
    """Timestamps of this rank's own work in a step, from hooks on the inner module (cheap: one
    Python call per forward and per parameter's gradient)."""

    def __init__(self, module: torch.nn.Module):
        self.forward_at: float | None = None  # the first forward pass of the step began
        self.grads_at: float | None = None  # the last gradient of the step was accumulated
        module.register_forward_pre_hook(self._on_forward)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_grad)

    def _on_forward(self, module, args) -> None:
        if self.forward_at is None:
            self.forward_at = time.perf_counter()

    def _on_grad(self, param) -> None:
        self.grads_at = time.perf_counter()

    def waited_s(self, started: float, backward_done: float) -> float:
        """Seconds of the step spent waiting for other ranks, and reset for the next step.

        Args:
            started: when the step's compute began (``time.perf_counter()``, s).
            backward_done: when the last backward pass returned (its gradients synced), s.

        Returns:
            The wait before the first forward pass (DDP's buffer broadcast) plus the wait after
            the last gradient (the all-reduce), s; 0 where a hook did not fire.
        """
        waited = 0.0
        if self.forward_at is not None and self.grads_at is not None:
            waited = max(0.0, self.forward_at - started) + max(0.0, backward_done - self.grads_at)
        self.forward_at = self.grads_at = None
        return waited


def relative_scores(step_s: list[float]) -> list[float]:
    """Each rank's own step time over the ranks' lower median (``statistics.median_low``).

    Args:
        step_s: mean own step time of each rank (index = rank), s.

    Returns:
        One score per rank (1.0: typical; 2.0: twice as slow); all 1.0 when the median is 0.
    """
    median = statistics.median_low(step_s)
    return [s / median if median > 0 else 1.0 for s in step_s]


@dataclass
class StragglerReport:
    """One closed window: per-rank means and scores, and the ranks that just became slow."""

    first_step: int
    last_step: int
    step_s: list[float]  # mean own step time per rank, s
    data_wait_s: list[float]  # mean data wait per rank, s
    relative: list[float]
    individual: list[float]
    new_stragglers: list[int]

    def metrics(self) -> dict[str, float]:
        """MLflow metrics of the window: ``rank_<r>_step_s``, ``rank_<r>_data_wait_s``,
        ``rank_<r>_relative_score``, ``rank_<r>_individual_score`` and ``straggler_score``
        (the highest relative score)."""
        out = {"straggler_score": max(self.relative)}
        for r, values in enumerate(zip(self.step_s, self.data_wait_s, self.relative,
                                       self.individual, strict=True)):
            for name, value in zip(("step_s", "data_wait_s", "relative_score",
                                    "individual_score"), values, strict=True):
                out[f"rank_{r}_{name}"] = value
        return out

    def line(self, rank: int, threshold: float) -> str:
        """The warning about ``rank``: who, how much slower, over which steps, the setting."""
        median = statistics.median_low(self.step_s)
        return (f"straggler: rank {rank} is {self.relative[rank]:.1f}x slower than the median "
                f"rank ({1000 * self.step_s[rank]:.0f} ms vs {1000 * median:.0f} ms of its "
                f"own time per step, {1000 * self.data_wait_s[rank]:.0f} ms of it waiting for "
                f"data) over steps {self.first_step}-{self.last_step} "
                f"(train.straggler.threshold={threshold:g})")


@dataclass
class StragglerWindows:
    """Rank 0's windows of per-rank sums; :meth:`add` returns a report when a window closes."""

    world_size: int
    window_steps: int
    threshold: float
    windows: int = 1
    min_window_s: float = 0.0  # a window also lasts at least this long (wall s, ``clock``)
    clock: Callable[[], float] = time.monotonic
    _sums: list[float] = field(default_factory=list)
    _steps: int = 0
    _first: int | None = None
    _opened: float = 0.0
    _best: list[float] = field(default_factory=list)
    _slow: set[int] = field(default_factory=set)
    _streak: list[int] = field(default_factory=list)  # consecutive windows over, per rank

    def add(self, sums: list[float], steps: int, last_step: int) -> StragglerReport | None:
        """Add the summed figures of ``steps`` steps ending at ``last_step``. A window closes
        once it holds ``window_steps`` steps and lasted ``min_window_s`` seconds.

        Args:
            sums: ``FIGURES`` values per rank, rank-major (own step s, data-wait s).
            steps: how many steps the sums cover.
            last_step: the last of them (1-based step number).

        Returns:
            The report of the window this closes, else None.
        """
        if self._first is None:
            self._first, self._sums = last_step - steps + 1, [0.0] * len(sums)
            self._opened = self.clock()
        self._sums = [a + b for a, b in zip(self._sums, sums, strict=True)]
        self._steps += steps
        if self._steps < self.window_steps or self.clock() - self._opened < self.min_window_s:
            return None
        n = self._steps
        step_s = [self._sums[FIGURES * r] / n for r in range(self.world_size)]
        data_s = [self._sums[FIGURES * r + 1] / n for r in range(self.world_size)]
        self._best = [min(b, s) for b, s in zip(self._best or step_s, step_s, strict=True)]
        relative = relative_scores(step_s)
        individual = [s / b if b > 0 else 1.0 for s, b in zip(step_s, self._best, strict=True)]
        self._streak = [n + 1 if score >= self.threshold else 0
                        for n, score in zip(self._streak or [0] * len(relative), relative,
                                            strict=True)]
        slow = {r for r, n in enumerate(self._streak) if n >= self.windows}
        report = StragglerReport(self._first, last_step, step_s, data_s, relative, individual,
                                 sorted(slow - self._slow))
        self._slow, self._first, self._steps = slow, None, 0
        return report


class StragglerMixin:
    """The Trainer's straggler methods (``self`` is a :class:`stoker.runtime.trainer.Trainer`:
    ``cfg``, ``env``, ``module``, ``_log``, ``_event``)."""

    def _open_straggler_watch(self) -> None:
        """Hook the step clock (every rank) and open rank 0's windows, when the job has more
        than one rank and ``train.straggler.enabled``."""
        self._clock: StepClock | None = None
        self._stragglers: StragglerWindows | None = None
        self._own = [0.0] * FIGURES  # own step s, data-wait s since the last agreement
        self._step_wait_s = 0.0
        settings = self.cfg.straggler
        if not (self.env.distributed and settings.enabled):
            return
        self._clock = StepClock(self.module)
        if self.env.is_main:
            self._stragglers = StragglerWindows(self.env.world_size, settings.window_steps,
                                                settings.threshold, settings.windows,
                                                settings.min_window_s)

    def _count_own_time(self, began: float, data_s: float) -> None:
        """Add the step that began at ``began`` (``perf_counter``, s) less its waits for other
        ranks, and its ``data_s`` seconds of data wait, to this rank's sums."""
        if self._clock is not None:
            self._own[0] += time.perf_counter() - began - self._step_wait_s
            self._own[1] += data_s

    def _own_time_slots(self) -> list[float]:
        """This rank's sums in its slots of the agreement vector (zeros elsewhere), reset; empty
        without a straggler watch."""
        if self._clock is None:
            return []
        slots = [0.0] * (FIGURES * self.env.world_size)
        slots[FIGURES * self.env.rank:FIGURES * (self.env.rank + 1)] = self._own
        self._own = [0.0] * FIGURES
        return slots

    def _report_stragglers(self, sums: list[float], steps: int, last_step: int) -> None:
        """Rank 0: add an agreement's summed slots; when a window closes, log its metrics to
        MLflow, and a warning line and a ``straggler`` progress event per rank that became
        slow."""
        if self._stragglers is None:
            return
        report = self._stragglers.add(sums, steps, last_step)
        if report is None:
            return
        self._log(report.metrics(), last_step)
        threshold = self.cfg.straggler.threshold
        for rank in report.new_stragglers:
            log.warning(report.line(rank, threshold))
            self._event("straggler", at_step=last_step, rank=rank,
                        relative_score=round(report.relative[rank], 3),
                        step_s=round(report.step_s[rank], 6),
                        median_step_s=round(statistics.median_low(report.step_s), 6),
                        data_wait_s=round(report.data_wait_s[rank], 6),
                        first_step=report.first_step, threshold=threshold)
