"""The ranks' agreement on the steps they trained: one background all-reduce every few steps
(about ``AGREE_EVERY_S`` of them) carrying each step's summed loss, the stop votes, whether a
time-based checkpoint is due, the steps until the next agreement and each rank's own time for
the straggler report. The Trainer's part is :class:`AgreementMixin`. No Prefect."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# The per-step agreement (loss, stop, time-due) is one collective for the steps of about this
# long: at 12 ms steps a collective per step cost 7-10 % of the wall time on 2 CPU cores (its
# gloo thread competes with the ranks' compute), while a stop still lands within ~0.1 s.
AGREE_EVERY_S = 0.1
MAX_AGREE_STEPS = 16


def agreement_interval(mean_step_s: float) -> int:
    """Steps until the next agreement for steps of ``mean_step_s`` seconds: about
    ``AGREE_EVERY_S`` of them, at least 1 (slow steps: one each), at most ``MAX_AGREE_STEPS``."""
    if not math.isfinite(mean_step_s) or mean_step_s <= 0:
        return 1
    return min(MAX_AGREE_STEPS, max(1, int(AGREE_EVERY_S / mean_step_s)))


@dataclass
class Step:
    """A trained step not yet agreed on: its local loss (0-d tensor), when it ended."""

    step: int
    epoch: int
    lr: float
    loss: torch.Tensor
    step_s: float
    ended: float  # Unix seconds


@dataclass
class Agreement:
    """One collective in flight for ``steps``: ``flags`` = [summed loss of each step ...,
    stop votes, time-due, the steps until the next agreement (rank 0's proposal), then each
    rank's own time and data wait in its slots (:mod:`stoker.runtime.stragglers`)]."""

    steps: list[Step]
    flags: torch.Tensor
    work: Any  # torch.distributed Work, None on one process

    @property
    def step(self) -> int:
        return self.steps[-1].step


class AgreementMixin:
    """The Trainer's agreement methods (``self`` is a :class:`stoker.runtime.trainer.Trainer`:
    ``cfg``, ``env``, ``stop``, ``timings``, ``agreements``, ``_last_save``, ``_log_step`` and
    the straggler slots)."""

    def _agree(self, steps: list[Step]) -> Agreement:
        """Start the collective for ``steps`` (the steps trained since the last one), in the
        background: each step's summed loss, whether any rank wants to stop, whether rank 0's
        time-based checkpoint is due, and rank 0's proposal for the steps until the next one
        (about ``AGREE_EVERY_S`` of its steps, 1 to ``MAX_AGREE_STEPS``). Read it with
        :meth:`_settle` (every rank starts and settles every agreement at the same steps)."""
        time_due = (self.env.is_main and self.cfg.checkpoint_every_s is not None
                    and time.monotonic() - self._last_save >= self.cfg.checkpoint_every_s)
        interval = 0
        if self.env.is_main:
            interval = agreement_interval(sum(s.step_s for s in steps) / len(steps))
        self.agreements += 1
        # On the losses' device, without a host sync (read in _settle).
        flags = torch.cat([torch.stack([s.loss for s in steps]).to(torch.float64),
                           torch.tensor([float(self.stop.requested), float(time_due),
                                         float(interval), *self._own_time_slots()],
                                        dtype=torch.float64, device=self.env.device)])
        work = None
        if self.env.distributed:  # (one process has nothing to wait for: settled at once)
            work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True)
        return Agreement(steps, flags, work)

    def _settle(self, agreed: Agreement) -> tuple[bool, bool, int]:
        """Wait for ``agreed``, check its losses, report its steps; returns (stop, time-due,
        the step at which the next agreement starts).

        Raises:
            FloatingPointError: a step's mean loss over the ranks is not finite (diverged).
        """
        t0 = time.perf_counter()
        if agreed.work is not None:
            agreed.work.wait()
        self.timings["sync"] += time.perf_counter() - t0
        flags = agreed.flags.tolist()
        n = len(agreed.steps)
        for s, summed in zip(agreed.steps, flags[:n], strict=True):
            mean_loss = summed / self.env.world_size
            if not math.isfinite(mean_loss):
                raise FloatingPointError(
                    f"train loss is {mean_loss} at step {s.step}: training diverged (check "
                    f"train.lr={self.cfg.lr}, train.precision={self.cfg.precision})")
            self._log_step(s.step, s.epoch, mean_loss, s.lr, s.step_s, s.ended)
        stop, due, interval = flags[n:n + 3]
        self._report_stragglers(flags[n + 3:], n, agreed.step)
        return stop > 0, due > 0, agreed.step + max(1, int(interval))
