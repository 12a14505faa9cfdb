"""Where a job resumes: rank 0 chooses the checkpoint, every rank loads and confirms that step.

Each rank deciding on its own can split the job: a folder committed while ranks list the
directory (an orphaned trainer still writing), or a file only one rank fails to read, puts the
ranks on different steps, and the next collective hangs. Here rank 0 proposes the newest
committed step, every rank verifies and loads it, and all agree (one all-reduce) before anyone
uses it; a step any rank cannot load is skipped for the next one, and moved aside.

When step folders exist but none is usable the job either restarts from step 0 with a loud
warning naming every skipped folder and why (``train.on_no_usable_checkpoint=restart``), or
refuses with a ``CheckpointError`` and changes nothing (``refuse``). A file that tries to
build a type outside the data-only allow-list (``stoker.runtime.safe_load``) is never skipped:
every rank stops with ``UnsafeCheckpointError`` (exit 2), whatever ``on_no_usable_checkpoint``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stoker.runtime.checkpoint import UNFINISHED, Checkpointer, CheckpointError, Loaded
from stoker.runtime.distributed import DistEnv, all_reduce_min, broadcast_from_main
from stoker.runtime.safe_load import UnsafeCheckpointError

log = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """The checkpoint every rank loaded (None: start at step 0) and what was skipped on the way:
    ``skipped`` holds one ``"<folder>: <reason>"`` per folder passed over (rank 0's view)."""

    loaded: Loaded | None
    skipped: list[str] = field(default_factory=list)

    @property
    def restarted_from_zero(self) -> bool:
        return self.loaded is None and bool(self.skipped)

    def tags(self) -> dict[str, str]:
        """MLflow tags recording what was skipped ({} when nothing was)."""
        if not self.skipped:
            return {}
        tags = {"stoker.checkpoints_skipped": "; ".join(self.skipped)[:5000]}
        if self.restarted_from_zero:
            tags["stoker.restarted_from_step_0"] = "true"
        return tags


def _agree_int(value: int, env: DistEnv) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=env.device)
    return int(broadcast_from_main(tensor, env)[0])


def _all_ranks(ok: bool, step: int, env: DistEnv) -> tuple[bool, int, int]:
    """(every rank ok, min step, max step) over all ranks."""
    tensor = torch.tensor([int(ok), step, -step], dtype=torch.int64, device=env.device)
    all_reduce_min(tensor, env)
    return bool(tensor[0]), int(tensor[1]), -int(tensor[2])


def _agree_any(flag: bool, env: DistEnv) -> bool:
    """True on every rank when ``flag`` is true on any rank."""
    tensor = torch.tensor([int(not flag)], dtype=torch.int64, device=env.device)
    all_reduce_min(tensor, env)
    return not bool(tensor[0])


def resume_point(ckpt: Checkpointer, env: DistEnv, on_none: str = "restart",
                 map_location: str | torch.device = "cpu",
                 warn: Callable[[str], None] = log.warning) -> ResumePoint:
    """Choose (rank 0), load (every rank) and confirm the checkpoint to resume from.

    Every rank must call it. Args: ``on_none`` is ``train.on_no_usable_checkpoint``.

    Raises:
        CheckpointError: the ranks ended on different steps (a bug), or no folder is usable and
            ``on_none == "refuse"`` (the message names every folder and why).
        UnsafeCheckpointError: a file of the chosen step names a type that is not allowed
            (a planted pickle): refused on every rank, never skipped for an older step.
    """
    steps = ckpt.step_folders() if env.is_main else []
    skipped: list[str] = []
    failed: list[tuple[int, str]] = []
    candidates = []
    for step, committed in reversed(steps):
        if committed:
            candidates.append(step)
        elif not candidates:  # an interrupted save newer than any commit
            skipped.append(f"{ckpt.step_dir(step)}: no COMMITTED marker ({UNFINISHED})")
    result: Loaded | None = None
    index = 0
    while True:  # every rank loops until rank 0 proposes -1 (only rank 0 knows candidates)
        step = _agree_int(candidates[index] if index < len(candidates) else -1, env)
        index += 1
        if step < 0:
            break
        refused: UnsafeCheckpointError | None = None
        try:
            loaded, reason = ckpt.load_step(step, map_location), ""
        except UnsafeCheckpointError as e:
            loaded, reason, refused = None, str(e), e
        except CheckpointError as e:
            loaded, reason = None, str(e)
        if _agree_any(refused is not None, env):  # a planted payload stops every rank
            raise refused or UnsafeCheckpointError(
                f"checkpoint {ckpt.step_dir(step)}: refused on another rank (see its log)")
        ok, low, high = _all_ranks(loaded is not None, step if loaded else -1, env)
        if ok:
            if low != step or high != step:
                raise CheckpointError(f"ranks loaded steps {low}..{high}, rank 0 chose {step}")
            result = loaded
            break
        if env.is_main:
            reason = reason or "unreadable on another rank"
            failed.append((step, reason))
            skipped.append(f"{ckpt.step_dir(step)}: {reason}")
    return _conclude(ckpt, env, ResumePoint(result, skipped), failed, on_none, warn)


def _conclude(ckpt: Checkpointer, env: DistEnv, point: ResumePoint,
              failed: list[tuple[int, str]], on_none: str,
              warn: Callable[[str], None]) -> ResumePoint:
    """Warn about skipped folders, refuse or move unusable ones aside (rank 0 decides)."""
    nothing = _agree_int(int(point.loaded is None and bool(point.skipped)), env)
    if nothing and on_none == "refuse":
        detail = "; ".join(point.skipped) if env.is_main else "see rank 0"
        raise CheckpointError(
            f"no usable checkpoint in {ckpt.root} ({detail}); refusing to restart from step 0 "
            "(train.on_no_usable_checkpoint=refuse): repair or remove these folders, or set "
            "train.on_no_usable_checkpoint=restart")
    if not env.is_main:
        return point
    for step, reason in failed:
        ckpt.set_aside(step, reason)
    if nothing:
        warn("no usable checkpoint: restarting this job from step 0; skipped "
             f"{len(point.skipped)} folder(s): " + "; ".join(point.skipped)
             + " (set train.on_no_usable_checkpoint=refuse to stop instead)")
    elif point.skipped:
        warn(f"resuming from {point.loaded.path}; skipped newer: " + "; ".join(point.skipped))
    return point
