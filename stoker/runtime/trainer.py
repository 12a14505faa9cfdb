"""The Trainer: a DDP training loop that checkpoints, honours preemption and resumes exactly.

Start (and resume) with ``torchrun ... -m stoker.runtime SPEC.yaml``. Rank 0 alone writes progress,
metrics and results; every rank takes part in every collective.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from stoker.config import ConfigError
from stoker.runtime import EXIT_PREEMPTED, hang
from stoker.runtime.agreement import (  # noqa: F401 - re-exported: the agreement's figures
    AGREE_EVERY_S,
    MAX_AGREE_STEPS,
    Agreement,
    AgreementMixin,
    Step,
    agreement_interval,
)
from stoker.runtime.checkpoint import Checkpointer
from stoker.runtime.data import (
    AttemptBatches,
    AttemptData,
    DataError,
    DataStall,
    DataWatchdog,
    build_splits,
    check_divisible,
    val_batches,
)
from stoker.runtime.distributed import DistEnv, all_reduce_sum
from stoker.runtime.models import build_model
from stoker.runtime.peers import local_peer_gone
from stoker.runtime.preemption import StopFlag, data_worker_init, loader_iter
from stoker.runtime.profiling import ProfilingMixin
from stoker.runtime.progress import ProgressWriter
from stoker.runtime.reporting import ReportingMixin
from stoker.runtime.resume import resume_point
from stoker.runtime.spec import RunSpec
from stoker.runtime.split import batch_exceeds_split, steps_per_epoch
from stoker.runtime.stragglers import StragglerMixin
from stoker.runtime.training_state import TrainingStateMixin

log = logging.getLogger("stoker.runtime")
EPOCH_LINE_EVERY_S = 10.0  # at most one epoch line per this many seconds (first and last: always)


def epoch_line(epoch: int, epochs: int, step: int, metrics: dict[str, float],
               seconds: float) -> str:
    """Rank 0's line after an epoch's evaluation. The loss has 4 significant digits, not 4
    decimals: on easy data it falls below 0.00005, which ``%.4f`` printed as ``0.0000``."""
    return (f"epoch {epoch}/{epochs} step {step}: val_accuracy {metrics['val_accuracy']:.4f} "
            f"val_loss {metrics['val_loss']:.4g} ({seconds:.1f} s)")

class Trainer(TrainingStateMixin, ReportingMixin, ProfilingMixin, StragglerMixin,
              AgreementMixin):
    """Owns the model, optimizer, data order, checkpointer and (rank 0) tracking of one job."""

    def __init__(self, spec: RunSpec, env: DistEnv, stop: StopFlag):
        self.spec, self.cfg, self.env, self.stop = spec, spec.train, env, stop
        self.created = time.time()  # this attempt's start, for who asked it to stop
        self.timings = dict.fromkeys(("data", "forward_backward", "optimizer", "sync", "eval",
                                      "checkpoint"), 0.0)
        self.agreements = 0  # collectives of loss and flags this attempt (see _agree)
        self._configure_backends()
        cfg = self.cfg
        self.splits = build_splits(
            cfg.dataset, spec.data_dir, cfg.seed, cfg.val_fraction, cfg.channels,
            image_size=cfg.image_size, mean=cfg.image_mean, std=cfg.image_std,
            crop_scale=cfg.random_resized_crop, hflip=cfg.horizontal_flip, job_dir=spec.job_dir)
        check_divisible(self.cfg.global_batch_size, self.cfg.grad_accum_steps, env.world_size)
        n_train = len(self.splits.train)
        # Checked again here: the orchestrator's check (after the pull) knew only its own world
        # size, and a custom dataset factory's split only here.
        too_large = batch_exceeds_split(cfg.global_batch_size, cfg.grad_accum_steps, n_train,
                                        env.world_size, spec.data_dir)
        if too_large is not None:
            raise DataError(too_large)
        self.steps_per_epoch = steps_per_epoch(n_train, self.cfg.global_batch_size)
        self.total_steps = self.cfg.epochs * self.steps_per_epoch

        torch.manual_seed(self.cfg.seed)  # same initial weights on every rank
        self.module = build_model(self.cfg.model, self.splits.num_classes,
                                  self.splits.input_shape[0], self.cfg.activation_checkpointing)
        self.module.to(env.device)
        if self.cfg.channels_last:
            self.module.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer, max_lr=self.cfg.lr, total_steps=self.total_steps)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=self.cfg.precision == "fp16")
        self.ckpt = Checkpointer(spec.checkpoint_location, env.rank, env.world_size,
                                 self.cfg.keep_latest_k, self.cfg.async_checkpoint,
                                 commit_timeout_s=max(60.0, self.cfg.preemption_grace_s),
                                 keep_best=(self.cfg.keep_best_metric,
                                            self.cfg.keep_best_direction)
                                 if self.cfg.keep_best_metric else None)
        self.ckpt.peer_gone = local_peer_gone  # rank 0's digest wait ends when a rank is gone
        self.step = 0
        self._step_flops: float | None = None
        self.train_time_s = 0.0  # time in committed training steps, summed over attempts
        self.run_id: str | None = None
        self.metrics: dict[str, float] = {}
        self._tracking_backlog: list = []  # metrics a checkpoint holds that MLflow may not
        # The steps since MLflow's last train_loss: [summed mean loss, steps, seconds]; in every
        # checkpoint, so a resumed job logs the same means as an uninterrupted one.
        self._metrics_window: list = [0.0, 0, 0.0]
        # Rank 0 chooses the checkpoint; every rank loads and confirms the same step.
        self.resume = resume_point(self.ckpt, env, self.cfg.on_no_usable_checkpoint, env.device)
        self._restore(self.resume.loaded)
        self.model = self._wrap()  # load the snapshot before wrapping in DDP
        self._open_straggler_watch()
        # Its workers fork now, before tracking and checkpoint threads exist (see _open_data).
        self._batches = self._open_data()
        self._watchdog = DataWatchdog(self.cfg.data_timeout_s if self.cfg.num_workers else 0)
        self.progress = ProgressWriter(spec.job_dir, env.world_size) if env.is_main else None
        self._epoch_line_at: float | None = None  # when rank 0 last logged an epoch's line
        self.tracker = self._open_tracker() if env.is_main and spec.tracking_uri else None
        if self.tracker is not None:
            self.tracker.replay(self._tracking_backlog)
            if self.resume.skipped:
                self.tracker.set_tags(self.resume.tags())
        self._last_save = time.monotonic()

    # -- setup --------------------------------------------------------------------------------
    def _configure_backends(self) -> None:
        if self.cfg.precision == "fp16" and self.env.device.type != "cuda":
            raise ConfigError("train.precision: fp16 needs CUDA; use bf16 or fp32 on CPU")
        if self.cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        elif self.env.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # autotune conv algorithms per input shape
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _wrap(self) -> torch.nn.Module:
        model: torch.nn.Module = self.module
        if self.env.distributed:
            model = DDP(model, device_ids=[self.env.local_rank]
                        if self.env.device.type == "cuda" else None)
            self._register_comm_hook(model)
        if self.cfg.compile:
            model = torch.compile(model)
        return model

    def _register_comm_hook(self, model: DDP) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hook = self.cfg.ddp_comm_hook
        if hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=10)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    # -- the loop -----------------------------------------------------------------------------
    def _open_data(self) -> Iterator | None:
        """The attempt's one DataLoader iterator: every training micro-batch from this step on
        and each epoch's validation batches (:class:`AttemptBatches`), in the order the loop
        reads them. Its ``num_workers`` workers are forked here, once per attempt: not again
        per epoch and per evaluation, and before the rank starts its other threads (a fork
        while another thread holds an interpreter lock can hang the child: CPython gh-112275).
        A wait for a batch longer than ``train.data_timeout_s`` ends the attempt
        (:class:`DataWatchdog`). None when no step is left."""
        if self.step >= self.total_steps:
            return None
        cfg, env = self.cfg, self.env
        sampler = AttemptBatches(len(self.splits.train), len(self.splits.val), cfg.seed,
                                 self.step, cfg.epochs, cfg.global_batch_size,
                                 cfg.grad_accum_steps, env.rank, env.world_size)
        workers = cfg.num_workers
        # Its own generator: creating an iterator draws a worker seed, which must not advance
        # the global RNG (a resumed run creates one more iterator than an uninterrupted one).
        generator = torch.Generator().manual_seed(cfg.seed * 7919 + self.step)
        loader = DataLoader(AttemptData(self.splits.train, self.splits.val),
                            batch_sampler=sampler, num_workers=workers,
                            pin_memory=env.device.type == "cuda", generator=generator,
                            worker_init_fn=functools.partial(data_worker_init,
                                                             rank_pid=os.getpid()))
        return loader_iter(loader)

    def close_data(self) -> None:
        """End the data workers now (what the iterator does when collected: a worker that
        does not end within 5 s gets SIGTERM). The rank ends with ``os._exit``, and a worker
        left behind would notice only seconds later. Idempotent."""
        self._watchdog.close()
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _next_batch(self):
        return self._watchdog.next_batch(self._batches)

    @property
    def data_stalled(self) -> DataStall | None:
        """The stall that ended this attempt's data (its workers were killed), else None."""
        return self._watchdog.error() if self._watchdog.stalled else None

    def train(self) -> str:
        """Run until done or preempted. Returns ``"completed"`` or ``"preempted"``."""
        self._event("start", total_steps=self.total_steps, resumed=self.step > 0,
                    gpu_model=self.gpu_model(),  # the budget's price, before MLflow has it
                    intra_op_threads=torch.get_num_threads(),
                    restarted_from_zero=self.resume.restarted_from_zero,
                    train_time_s=round(self.train_time_s, 3))  # committed before this attempt
        started, self._cpu_started = time.perf_counter(), time.process_time()
        self._loop_started, self._periodic_saves, self._share_warned = started, 0, False
        self._tracking_cpu_started = self.tracker.cpu_s() if self.tracker is not None else 0.0
        start_step = self.step
        profiler = self._profiler()
        pending: Agreement | None = None  # in flight, read after the next step
        unagreed: list[Step] = []
        next_agreement = start_step + 1
        while self.step < self.total_steps:
            epoch, first = divmod(self.step, self.steps_per_epoch)
            epoch_started = time.perf_counter()
            for _ in range(first, self.steps_per_epoch):
                began = time.perf_counter()  # the rank's own time counts from here (stragglers)
                hang.mark("step", self.step)
                t0 = time.perf_counter()
                micro = [self._next_batch() for _ in range(self.cfg.grad_accum_steps)]
                data_s = time.perf_counter() - t0
                self.timings["data"] += data_s
                lr = self.scheduler.get_last_lr()[0]
                loss = self.train_step(micro)
                self.step += 1
                if self.cfg.fail_at_step == self.step:
                    raise RuntimeError(f"simulated failure at step {self.step} "
                                       "(train.fail_at_step)")
                step_s = time.perf_counter() - t0
                self.train_time_s += step_s
                self._count_own_time(began, data_s)
                unagreed.append(Step(self.step, epoch, lr, loss.detach(), step_s, time.time()))
                if profiler is not None:
                    profiler = self._profiler_step(profiler)
                if self._step_flops is None and self.env.is_main:
                    # Once per attempt, on rank 0 alone (the only rank that reports it).
                    self._step_flops = 0.0
                    self._measure_flops(micro)
                # The steps' agreement (mean loss, stop, time-due) runs in the background: one
                # collective every few steps (AGREE_EVERY_S), read after the next step, or at
                # once where this step may checkpoint or end.
                stop = due = False
                if pending is not None:
                    stop, due, next_agreement = self._settle(pending)
                    pending = None
                end_of_epoch = self.step % self.steps_per_epoch == 0
                every = self.cfg.checkpoint_every_steps
                saving = (stop or due or self.step == self.total_steps
                          or (every is not None and self.step % every == 0))
                now = (saving or end_of_epoch or self.step == start_step + 1
                       or not self.env.distributed)
                if now or self.step >= next_agreement:
                    pending, unagreed = self._agree(unagreed), []
                if now:
                    # Before a checkpoint (never of a diverged step), an evaluation, and after
                    # the attempt's first step (a stop sent during start-up): every step so
                    # far agreed on, which may add a stop or a time-based save.
                    now_stop, now_due, next_agreement = self._settle(pending)
                    pending = None
                    stop, saving = stop or now_stop, saving or now_stop or now_due
                if end_of_epoch:
                    self.evaluate(epoch, time.perf_counter() - epoch_started)
                if saving:
                    self.save()
                    if not stop:
                        self._check_checkpoint_share()
                if stop:
                    self._finish_attempt()
                    log.warning("stop requested (%s): checkpoint committed at step %d; exiting "
                                "with %d", self.stop.describe(self.spec.job_dir, self.created),
                                self.step, EXIT_PREEMPTED)
                    return "preempted"
        self._finish_attempt()
        self.ckpt.drop_spare()  # completed: no more saves to overwrite it
        self._write_result(time.perf_counter() - started, self.step - start_step)
        return "completed"

    def train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over ``grad_accum_steps`` micro-batches; returns the local loss
        (a 0-d tensor, not synced)."""
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.env.device)
        for i, (x, y) in enumerate(micro):
            x, y = self._to_device(x), y.to(self.env.device, non_blocking=True)
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or not self.env.distributed \
                else self.model.no_sync()
            with sync:  # skip the gradient all-reduce on all but the last micro-batch
                with self._autocast():
                    loss = F.cross_entropy(self.model(x), y) / len(micro)
                self.scaler.scale(loss).backward()
            total += loss.detach()
        t1 = time.perf_counter()
        # The last checkpoint's host copy may still be reading the weights (it overlapped the
        # forward/backward above): they must not change under it.
        staged_s = self.ckpt.wait_staged()
        self.timings["checkpoint"] += staged_s
        if self._clock is not None:  # waits for other ranks and checkpoints: not step work
            self._step_wait_s = self._clock.waited_s(t0, t1) + staged_s
        t1 = time.perf_counter()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.timings["forward_backward"] += t1 - t0
        self.timings["optimizer"] += time.perf_counter() - t1
        return total

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.env.device, non_blocking=True)
        if self.cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _autocast(self):
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
        return torch.autocast(self.env.device.type, dtype=dtype)

    def _epoch_line_due(self, epoch: int) -> bool:
        """Whether rank 0 logs epoch ``epoch``'s line (0-based): the first and last epoch of
        an attempt, and otherwise at most one line every :data:`EPOCH_LINE_EVERY_S` seconds
        (a new-user trial's 300 short epochs printed 300 lines). Every epoch's metrics still
        reach MLflow and ``progress.jsonl``."""
        now, last = time.monotonic(), self._epoch_line_at
        if last is None or epoch + 1 == self.cfg.epochs or now - last >= EPOCH_LINE_EVERY_S:
            self._epoch_line_at = now
            return True
        return False

    def evaluate(self, epoch: int, epoch_time_s: float) -> dict[str, float]:
        """Validation over all ranks (each takes every world_size-th sample); logs and returns
        ``val_accuracy`` (0..1) and ``val_loss`` (mean cross-entropy)."""
        hang.mark("eval", self.step)
        t0 = time.perf_counter()
        self.module.eval()
        # This epoch's validation batches follow its last step in the attempt's one iterator.
        n_batches = len(val_batches(len(self.splits.val), self.env.rank, self.env.world_size))
        sums = torch.zeros(3, dtype=torch.float64, device=self.env.device)
        with torch.no_grad(), self._autocast():
            for _ in range(n_batches):
                x, y = self._next_batch()
                logits = self.module(self._to_device(x)).float()
                y = y.to(self.env.device)
                sums[0] += (logits.argmax(1) == y).sum()
                sums[1] += F.cross_entropy(logits, y, reduction="sum")
                sums[2] += len(y)
        all_reduce_sum(sums, self.env)
        self.module.train()
        self.metrics = {"val_accuracy": float(sums[0] / sums[2]),
                        "val_loss": float(sums[1] / sums[2]), "epoch": epoch + 1}
        self.timings["eval"] += time.perf_counter() - t0
        if self.env.is_main and self._epoch_line_due(epoch):
            log.info("%s", epoch_line(epoch + 1, self.cfg.epochs, self.step, self.metrics,
                                      epoch_time_s))
        self._event("eval", epoch=epoch + 1, val_accuracy=self.metrics["val_accuracy"],
                    val_loss=self.metrics["val_loss"], process_cpu_s=round(time.process_time(), 3),
                    **({"tracking_open": self.tracker.opened.is_set(),
                        "tracking_sent_step": self.tracker.sent_step,
                        "tracking_cpu_s": round(self.tracker.sent_cpu_s, 4)}
                       if self.tracker else {}))
        self._log({"val_accuracy": self.metrics["val_accuracy"],
                   "val_loss": self.metrics["val_loss"], "epoch_time_s": epoch_time_s})
        return self.metrics

