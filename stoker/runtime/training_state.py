"""The Trainer's state: what a checkpoint holds (shared by all ranks, and each rank's RNG),
saving it, and restoring it strictly for an exact continuation."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np
import torch

from stoker.runtime import hang
from stoker.runtime.checkpoint import CheckpointError, Loaded
from stoker.runtime.distributed import barrier
from stoker.runtime.spec import TRAJECTORY_FIELDS

log = logging.getLogger("stoker.runtime")

SHARED_KEYS = {"model", "optimizer", "scheduler", "scaler", "step", "config", "run_id",
               "world_size"}


class TrainingStateMixin:
    """The Trainer's state methods (``self`` is a :class:`stoker.runtime.trainer.Trainer`:
    ``module``, ``optimizer``, ``scheduler``, ``scaler``, ``ckpt``, ``step``, ...)."""

    def _restore(self, loaded: Loaded | None) -> None:
        if loaded is None:
            self._seed_rank()
            return
        missing = SHARED_KEYS - loaded.shared.keys()
        if missing:
            raise CheckpointError(f"{loaded.path}: missing keys {sorted(missing)}")
        self._check_trajectory(loaded)
        try:
            self.module.load_state_dict(loaded.shared["model"], strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"{loaded.path}: model state does not match "
                                  f"train.model={self.cfg.model!r}: {e}") from None
        self.optimizer.load_state_dict(loaded.shared["optimizer"])
        self.scheduler.load_state_dict(loaded.shared["scheduler"])
        self.scaler.load_state_dict(loaded.shared["scaler"])
        self.step = int(loaded.shared["step"])
        self.run_id = loaded.shared["run_id"]
        self.metrics = dict(loaded.shared.get("metrics", {}))
        self.train_time_s = float(loaded.shared.get("train_time_s", 0.0))
        self._tracking_backlog = list(loaded.shared.get("tracking_backlog", []))
        self._metrics_window = list(loaded.shared.get("metrics_window", [0.0, 0, 0.0]))
        if loaded.rank_state is not None:
            self._set_rng(loaded.rank_state["rng"])
        else:
            log.warning("checkpoint %s was written at world size %d, now %d: per-rank RNG "
                        "reseeded from (seed, rank, step); the data order is unchanged",
                        loaded.path, loaded.world_size, self.env.world_size)
            self._seed_rank()
        if self.env.is_main:
            log.info("resumed from %s (step %d of %d)", loaded.path, self.step, self.total_steps)

    def _check_trajectory(self, loaded: Loaded) -> None:
        saved = loaded.shared["config"]
        now = self.cfg.model_dump(mode="json")
        # A field newer than the checkpoint was, in effect, at its default when it was written.
        defaults = type(self.cfg)().model_dump(mode="json")
        changed = [f for f in TRAJECTORY_FIELDS if saved.get(f, defaults[f]) != now.get(f)]
        if changed:
            detail = ", ".join(f"train.{f}: {saved.get(f)!r} -> {now.get(f)!r}" for f in changed)
            raise CheckpointError(
                f"{loaded.path}: cannot resume with a changed trajectory ({detail}); restore "
                "these values or start a new job")

    def _seed_rank(self) -> None:
        seed = self.cfg.seed + 1 + self.env.rank + 7919 * self.step
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _rng_state(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def _set_rng(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def state_dict(self) -> dict[str, Any]:
        """Everything shared by all ranks that an exact continuation needs."""
        epoch, step_in_epoch = divmod(self.step, self.steps_per_epoch)
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "step": self.step, "epoch": epoch,
                "data_position": {"epoch": epoch, "step_in_epoch": step_in_epoch},
                "config": self.cfg.model_dump(mode="json"), "run_id": self._run_id(),
                "world_size": self.env.world_size, "metrics": self.metrics,
                "train_time_s": self.train_time_s,
                "metrics_window": list(self._metrics_window),
                "tracking_backlog": self.tracker.backlog() if self.tracker is not None else []}

    def save(self) -> None:
        """Save a checkpoint at the current step (every rank calls this)."""
        hang.mark("checkpoint", self.step)
        t0 = time.perf_counter()
        # Metrics up to a checkpoint must survive a crash (steps before it are never re-run):
        # what MLflow has not confirmed yet is saved in it (tracking_backlog), not waited for.
        shared = self.state_dict() if self.env.is_main else None
        if shared is not None and self.ckpt.async_save:
            shared["model"] = self._freeze_buffers(shared["model"])
        # Async: the host copy runs in the background, overlapping the next forward/backward;
        # train_step waits for it before the next optimizer.step (the weights change there).
        self.ckpt.save(self.step, shared, {"rng": self._rng_state(),
                                           "world_size": self.env.world_size},
                       metrics={k: v for k, v in self.metrics.items() if k != "epoch"},
                       defer_copy=self.ckpt.async_save)
        self._last_save = time.monotonic()
        self.timings["checkpoint"] += time.perf_counter() - t0
        self._event("checkpoint", path=self.ckpt.step_dir(self.step),
                    blocking_s=round(self.ckpt.last_blocking_s, 4))

    def _freeze_buffers(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``model_state`` with the module's buffers cloned: a forward pass changes them in place
        (BatchNorm statistics, DDP's buffer broadcast) before the background copy may reach them;
        they are small. Parameters change only in ``optimizer.step``."""
        for name, _ in self.module.named_buffers():
            if name in model_state:  # in place: the OrderedDict keeps its _metadata
                model_state[name] = model_state[name].clone()
        return model_state

    def _finish_attempt(self) -> None:
        """Make the last checkpoint durable and committed before any rank exits."""
        self.ckpt.wait()
        barrier(self.env)
