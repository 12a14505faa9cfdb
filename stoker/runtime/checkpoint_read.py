"""Reading committed checkpoints: verify every file against the commit marker's digests, load
data only, set an unusable step aside, and pick the best step by a metric."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stoker.runtime import CheckpointError, digest, private
from stoker.runtime.safe_load import UnsafeCheckpointError, load_data_only

log = logging.getLogger("stoker.runtime.checkpoint")

MARKER = "COMMITTED"
# Why a step folder has no marker: a killed process, or a save the storage refused (a full
# disk), which the reader cannot tell apart.
UNFINISHED = "its save did not finish: interrupted, or refused by the storage"


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint: ``shared`` for every rank, ``rank_state`` for this rank or None
    when the checkpoint was written at another world size."""

    step: int
    world_size: int
    shared: dict[str, Any]
    rank_state: dict[str, Any] | None
    path: str


class CheckpointReader:
    """The reading methods of :class:`stoker.runtime.checkpoint.Checkpointer` (``self`` has
    ``fs``, ``root``, ``rank``, ``world_size``, ``keep_best``, ``_verified``, ``step_dir``,
    ``_steps`` and ``committed_steps``)."""

    def _usable(self, step: int) -> bool:
        """Whether committed ``step`` verifies (each step hashed once per process); an
        unusable one is moved aside."""
        if step in self._verified:
            return True
        try:
            self._verify_and_read(step)
        except Exception as e:  # unreadable marker or files: not a checkpoint to count on
            self.set_aside(step, f"{type(e).__name__}: {e}")
            return False
        self._verified.add(step)
        return True

    def set_aside(self, step: int, reason: str) -> str:
        """Move step folder ``step`` to ``corrupt-step-<step>-<unix time>`` with a ``REASON``
        file, so it is neither loaded nor counted again (and nothing is deleted). Returns the
        new path."""
        target = f"{self.root}/corrupt-step-{step:09d}-{int(time.time())}"
        self.fs.mv(self.step_dir(step), target, recursive=True)
        with private.fs_open(self.fs, f"{target}/REASON", "wb") as f:
            f.write((reason + "\n").encode())
        self._verified.discard(step)
        log.warning("checkpoint %s unusable (%s): moved aside to %s", self.step_dir(step),
                    reason, target)
        return target

    def best_step(self, committed: list[int] | None = None) -> int | None:
        """The committed step with the best ``keep_best`` metric (None: not configured/none)."""
        if self.keep_best is None:
            return None
        metric, direction = self.keep_best
        scored = []
        for step in committed if committed is not None else self.committed_steps():
            try:
                with self.fs.open(f"{self.step_dir(step)}/{MARKER}", "rb") as f:
                    value = json.loads(f.read()).get("metrics", {}).get(metric)
            except (OSError, ValueError, AttributeError):
                continue  # an unreadable marker is no candidate
            if isinstance(value, int | float):
                scored.append((value if direction == "max" else -value, step))
        return max(scored)[1] if scored else None

    def _verify_and_read(self, step: int) -> tuple[dict, dict[str, bytes]]:
        folder = self.step_dir(step)
        with self.fs.open(f"{folder}/{MARKER}", "rb") as f:
            marker = json.loads(f.read())
        blobs = {}
        # Every rank verifies every file, so all ranks reach the same verdict on the same step.
        try:
            algorithm = digest.known(marker.get("hash", digest.LEGACY))
        except ValueError as e:
            raise CheckpointError(f"{folder}/{MARKER}: {e}") from e
        for name, recorded in marker["files"].items():
            with self.fs.open(f"{folder}/{name}", "rb") as f:
                blobs[name] = f.read()
            if digest.of(blobs[name], algorithm) != recorded:
                raise CheckpointError(f"{folder}/{name}: its bytes do not match their {algorithm} "
                                      f"digest in {MARKER}")
        return marker, blobs

    def load_step(self, step: int, map_location: str | torch.device = "cpu") -> Loaded:
        """Verify and load committed checkpoint ``step`` for this rank.

        Raises:
            CheckpointError: it is not committed, or a file is missing, corrupt or unreadable.
            UnsafeCheckpointError: a file names a type outside the data-only allow-list.
        """
        folder = self.step_dir(step)
        if not self.fs.exists(f"{folder}/{MARKER}"):
            raise CheckpointError(f"checkpoint {folder}: no {MARKER} marker ({UNFINISHED})")
        try:
            marker, blobs = self._verify_and_read(step)
            shared = load_data_only(blobs["shared.pt"], f"{folder}/shared.pt", map_location)
            own_name = f"rank-{self.rank:05d}.pt"
            own = blobs.get(own_name)
            same_world = marker["world_size"] == self.world_size
            rank_state = (
                load_data_only(own, f"{folder}/{own_name}")
                if own is not None and same_world else None
            )
        except UnsafeCheckpointError:
            raise  # a planted payload is refused, never skipped for an older step
        except Exception as e:  # any unreadable file makes the whole checkpoint unusable
            raise CheckpointError(f"checkpoint {folder}: unusable ({type(e).__name__}: {e})") \
                from e
        self._verified.add(step)
        return Loaded(step, marker["world_size"], shared, rank_state, folder)

    def load_latest(self, map_location: str | torch.device = "cpu",
                    warn: Callable[[str], None] = log.warning) -> Loaded | None:
        """The newest committed checkpoint that verifies, or None if there is none.

        Uncommitted folders are skipped (with a warning when newer than the result); a committed
        one whose files are missing, corrupt or unreadable is skipped with a warning naming why.
        One process only: under torchrun use ``stoker.runtime.resume.resume_point`` so every
        rank loads the step rank 0 chose.
        """
        for step, committed in reversed(self._steps()):
            folder = self.step_dir(step)
            if not committed:
                warn(f"checkpoint {folder}: no {MARKER} marker ({UNFINISHED}); skipped")
                continue
            try:
                return self.load_step(step, map_location)
            except UnsafeCheckpointError:
                raise
            except CheckpointError as e:
                warn(f"{e}; falling back to the previous committed checkpoint")
        return None
