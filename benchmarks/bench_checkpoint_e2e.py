"""Checkpoint cost end to end: the training step time with the default configuration's saves
every N steps versus the same steps without them, and each save's time to durable.

The state is ``bench_checkpoint``'s: a stack of square Linear layers with AdamW (model + two
moment buffers, about 150 MB at full size), trained a step at a time on one random batch of 32
rows (the notes give the step time, and so the seconds between saves). Both
sides run the same ``--periods`` x N steps, N = ``train.checkpoint_every_steps``'s default (50):

* baseline: the steps alone;
* candidate: the same steps with a save after the first step of every period, made as
  ``Trainer.save`` makes it with ``TrainConfig()``'s defaults: ``Checkpointer(async_save=
  train.async_checkpoint, keep_latest_k=train.keep_latest_k)`` (off by default: the training
  thread serializes and hashes the live tensors, into the purged step's ``shared.pt`` once
  there is one, then fsync, commit and purge run in a background thread), the model +
  optimizer state shared, the RNG state per rank, and with ``async_checkpoint`` the deferred
  host copy the step waits for before ``optimizer.step``.
  The run ends with ``ckpt.wait()`` (an attempt's end waits for its last commit).

Figure, per run: its wall time per step, saves and background work included; ratio per pair =
candidate / baseline; target <= 1.05 on CPU at a 150 MB state. The CPU time beside it is this
process's, every thread included (the save's background thread too), over the same steps, so the
CPU ratio is like for like. Time to durable, per save: from the save call until its background
thread ended (files fsynced, ``COMMITTED`` written and fsynced, old steps purged), informative.
The last save's step is read back from the store (``COMMITTED`` and the files' digests).
The process collects garbage as a rank does: no cyclic collection during its imports, then
their objects frozen (``stoker.runtime.startup_gc``).

    python benchmarks/bench_checkpoint_e2e.py [--quick] [--repeats N] [--size-mb 150]
        [--batch 32] [--width 1024] [--every-steps 50] [--periods 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# This process stands in for rank 0, so it collects garbage as a rank does
# (stoker.runtime.__main__): no cyclic collection while torch imports, then its objects frozen
# (stoker.runtime.startup_gc), so that a full collection walks what a rank's would.
from stoker.runtime import startup_gc  # noqa: E402

startup_gc.pause()

import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.bench_checkpoint import Job  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Pairs,
    Sized,
    Target,
    Workdir,
    alternate,
    check,
    compared,
    describe,
    emit,
    log,
    options,
    ratio_summary,
    summary,
    until_decided,
)
from benchmarks.stats import per_pair  # noqa: E402
from stoker.config import TrainConfig  # noqa: E402
from stoker.runtime.checkpoint import Checkpointer  # noqa: E402
from stoker.runtime.checkpoint_files import discard, serialize  # noqa: E402
from stoker.runtime.staging import HashingWriter  # noqa: E402

startup_gc.settle()

TARGET = Target("<=", 1.05)  # issue 45: saves at a realistic frequency cost <= 5 % of step time
DEFAULTS = TrainConfig()
OTHER = f"saves with async_checkpoint={not DEFAULTS.async_checkpoint}"


def ratio_of(baseline: float, candidate: float) -> float:
    return candidate / baseline


def positive(cast: type):
    """An argparse type: ``cast(text)``, which must be > 0 (else argparse exits 2 naming the
    option)."""
    def parse(text: str):
        value = cast(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = cast.__name__  # argparse names the type in its message
    return parse


def rng_state() -> dict:
    """A rank's RNG state as the trainer saves it (``Trainer._rng_state``)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class Saver:
    """Saves ``job``'s state as ``Trainer.save`` does with the default configuration (or with
    ``async_save`` given), and times each save: the seconds the training thread is held, and
    to durable."""

    def __init__(self, job: Job, location: Path,
                 async_save: bool = DEFAULTS.async_checkpoint):
        self.job = job
        self.location = location
        self.ckpt = Checkpointer(str(location), rank=0, world_size=1,
                                 keep_latest_k=DEFAULTS.keep_latest_k, async_save=async_save)
        self.step = 0  # the checkpoint's step number, increasing over every run
        self.held_s: list[float] = []  # per run: per save, the save call + the step's waits
        self.durable_s: list[float] = []  # per save: save call -> background thread ended
        # per save: whether a purged step's shared.pt was there for it to overwrite
        self.overwrote: list[bool] = []
        self._watchers: list[threading.Thread] = []

    def save(self) -> float:
        """Save now (right after a step); returns the seconds the call held the caller."""
        self.step += 1
        started = time.perf_counter()
        # The save waits for the previous one's background part (whose purge keeps the spare)
        # first: waited for here, inside the time held, to see the spare this save finds.
        self.ckpt.wait()
        spare = self.ckpt.spare
        self.overwrote.append(spare is not None and Path(spare).is_file())
        shared = {"model": self.job.model.state_dict(),
                  "optimizer": self.job.optimizer.state_dict(), "step": self.step}
        self.ckpt.save(self.step, shared, {"rng": rng_state(), "world_size": 1},
                       defer_copy=self.ckpt.async_save)
        held = time.perf_counter() - started
        self._watch(self.ckpt._pending, started)
        return held

    def _watch(self, pending: threading.Thread | None, started: float) -> None:
        """Record when ``pending`` (the save's background thread) ends; a thread blocked in
        ``join`` takes no CPU."""
        def watch() -> None:
            if pending is not None:
                pending.join()
            self.durable_s.append(time.perf_counter() - started)

        watcher = threading.Thread(target=watch, name=f"watch-ckpt-{self.step}", daemon=True)
        watcher.start()
        self._watchers.append(watcher)

    def settle(self) -> dict:
        """Wait for every save and its watcher (raises a failed save's error), then read the
        last one back with a fresh reader, as a resumed attempt would (``COMMITTED`` and every
        file's digest).

        Returns:
            ``committed_steps`` (ascending) and ``latest_step`` (the step loaded).

        Raises:
            RuntimeError: the last save is not the latest committed step that loads.
        """
        self.ckpt.wait()
        for watcher in self._watchers:
            watcher.join()
        self._watchers.clear()
        reader = Checkpointer(str(self.location), rank=0, world_size=1)
        last = reader.load_latest()
        read_back = {"committed_steps": reader.committed_steps(),
                     "latest_step": None if last is None else int(last.shared["step"])}
        if read_back["latest_step"] != self.step:
            raise RuntimeError(f"{self.location}: the last save (step {self.step}) was not "
                               f"read back committed: {read_back}")
        return read_back


def train(job: Job, steps: int, every: int, saver: Saver | None) -> float:
    """``steps`` training steps, with a save after step 1, 1 + every, ... when ``saver`` is
    given; returns the wall seconds per step (the last save's commit waited for)."""
    held = 0.0
    if saver is not None:
        job.ckpt = saver.ckpt  # a step waits for a deferred host copy before optimizer.step
    started = time.perf_counter()
    for i in range(steps):
        job.step()
        if saver is not None:
            held += job.waited_s  # the deferred host copy's wait (async only)
            if i % every == 0:
                held += saver.save()
    if saver is not None:
        saver.ckpt.wait()
        saver.held_s.append(held / -(-steps // every))
    return (time.perf_counter() - started) / steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The common options, the sizes (full: a 150 MB state, the default cadence) and
    ``--device``; a size that is not > 0 exits 2 naming the option."""
    return options(
        __doc__, 5,
        Sized("--size-mb", positive(float), 150.0, 4.0, "checkpoint size in MB"),
        Sized("--batch", positive(int), 32, 8, "rows per training batch (sets the step time)"),
        Sized("--width", positive(int), 1024, 256, "features of each square Linear layer"),
        Sized("--every-steps", positive(int), DEFAULTS.checkpoint_every_steps, 3,
              "steps between saves (train.checkpoint_every_steps' default)"),
        Sized("--periods", positive(int), 3, 2, "saves per run (each followed by its N-1 "
              "steps)"),
        extra=_extra_options, argv=argv)


def _extra_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the state lives, as in training (default: cuda if available)")
    p.add_argument("--other-arm", action="store_true",
                   help="also run, in every pair, the same saves with train.async_checkpoint "
                        f"set the other way ({not DEFAULTS.async_checkpoint}): informative, "
                        "what that setting would cost here")


def serialization_cpu(job: Job, folder: Path, repeats: int = 5) -> dict:
    """CPU-seconds of the training thread to serialize the state into one file, the least of
    ``repeats`` (``time.thread_time``): as a save does it (``checkpoint_files.serialize``:
    xxh3-128 while writing, no zip CRC-32), and torch.save into a sha256-hashing writer with
    torch's CRC-32 (how a save serialized before issue 45), informative."""
    shared = {"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict()}
    folder.mkdir(parents=True, exist_ok=True)
    fs = fsspec.filesystem("file")

    def stoker() -> None:
        discard(fs, [serialize(fs, str(folder / "now.pt"), shared)])

    def before() -> None:
        with open(folder / "before.pt", "wb") as f:
            torch.save(shared, HashingWriter(f, "sha256"))

    figures = {}
    for name, run in (("now", stoker), ("sha256_and_crc", before)):
        spent = []
        for _ in range(repeats):
            started = time.thread_time()
            run()
            spent.append(time.thread_time() - started)
        figures[name] = round(min(spent), 4)
    return figures


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result (also printed as the last line)."""
    args = parse_args(argv)
    job = Job(args.size_mb, args.device, args.batch, args.width)
    size_bytes = job.size_bytes()
    every, steps = args.every_steps, args.every_steps * args.periods
    log(f"state: {size_bytes / 1e6:.1f} MB on {args.device}; {steps} steps per run, a save "
        f"every {every} (async_checkpoint={DEFAULTS.async_checkpoint}, the default)")

    with Workdir(args.workdir, "bench-checkpoint-e2e") as work:
        saver = Saver(job, work / "checkpoints")
        other = Saver(job, work / "checkpoints-other", not DEFAULTS.async_checkpoint) \
            if args.other_arm else None
        # the warm-up pair pays the page cache, the allocator and the first save's folders
        pairs = alternate(lambda i: train(job, steps, every, None),
                          lambda i: train(job, steps, every, saver), args.repeats, args.warmups,
                          extra={OTHER: lambda i: train(job, steps, every, other)}
                          if other else None,
                          decided=until_decided(ratio_of, TARGET))
        read_back = saver.settle()
        other_read_back = other.settle() if other else None
        serialization = serialization_cpu(job, work / "serialization")
    return emit_result(args, pairs, saver, size_bytes, read_back, other, other_read_back,
                       serialization)


def save_figures(pairs: Pairs, arm: str, saver: Saver, warmups: int,
                 periods: int) -> dict:
    """One saving arm's figures over the counted pairs (warm-ups left out): the seconds held
    per save, to durable per save, and the CPU-seconds added per save over the baseline."""
    return {"held_per_save_s": summary(saver.held_s[warmups:], "s",
                                       "training thread held per save"),
            "durable_s": summary(saver.durable_s[warmups * periods:], "s",
                                 "save call -> committed (background thread ended)"),
            "cpu_added_per_save_s": summary(
                per_pair(pairs.values("baseline", "cpu_s"), pairs.values(arm, "cpu_s"),
                         lambda b, c: (c - b) / periods), "CPU-s",
                "CPU added per save (all threads)")}


def save_notes(label: str, figures: dict, period_s: float, mb: float) -> list[str]:
    """The notes on one saving arm: held per save, to durable, CPU per save."""
    held, durable = figures["held_per_save_s"], figures["durable_s"]
    cpu = figures["cpu_added_per_save_s"]
    return [f"{label}: training thread held per save {held['median']:.3f} s "
            f"[{held['min']:.3f} to {held['max']:.3f}] (held alone would make the ratio "
            f"{1 + held['median'] / period_s:.3f}; the rest is what the background part "
            "takes from the steps); time to durable (save call -> COMMITTED written, "
            f"fsynced, old steps purged) {durable['median']:.2f} s [{durable['min']:.2f} to "
            f"{durable['max']:.2f}] ({mb / durable['median']:.0f} MB/s); CPU added per save, "
            f"every thread of the process: {cpu['median']:.3f} CPU-s [{cpu['min']:.3f} to "
            f"{cpu['max']:.3f}]"]


def serialization_note(cpu: dict) -> str:
    return (f"serializing the state into one file costs the training thread {cpu['now']:.3f} "
            f"CPU-s (xxh3-128 while writing, no zip CRC-32); torch.save into a sha256 writer "
            f"with torch's CRC-32, as before issue 45: {cpu['sha256_and_crc']:.3f} CPU-s "
            "(least of 5 each, informative)")


def emit_result(args: argparse.Namespace, pairs: Pairs, saver: Saver, size_bytes: int,
                read_back: dict, other: Saver | None = None,
                other_read_back: dict | None = None,
                serialization: dict | None = None) -> dict:
    """The result line: the per-pair ratio and its verdict, the notes and the details."""
    every, periods = args.every_steps, args.periods
    figures = save_figures(pairs, "candidate", saver, args.warmups, periods)
    plain = summary(pairs.values("baseline"), "s", "plain step")
    result = compared(pairs, ratio_of, TARGET, "training steps without checkpoints",
                      f"the same steps with a save every {every} (default configuration)",
                      "s per step")
    mb, period_s = size_bytes / 1e6, every * plain["median"]
    notes = [f"state: {mb:.1f} MB of tensors on {args.device} (Linear stack + AdamW moments), "
             f"batch {args.batch}: a plain step takes {plain['median']:.3f} s, so a save every "
             f"{every} steps is one every {period_s:.1f} s; {periods} saves per run",
             f"default configuration: train.async_checkpoint={DEFAULTS.async_checkpoint}, "
             f"keep_latest_k={DEFAULTS.keep_latest_k}, checkpoint_every_steps="
             f"{DEFAULTS.checkpoint_every_steps}",
             *save_notes("default", figures, period_s, mb),
             f"read back from the store: committed steps {read_back['committed_steps']}, the "
             f"latest ({read_back['latest_step']}) verified against its digest"]
    counted = saver.overwrote[args.warmups * periods:]
    notes.append(f"{sum(counted)} of the {len(counted)} counted saves overwrote a purged "
                 "step's shared.pt (the spare) instead of writing a new file; a new checkpoint "
                 f"folder's first {DEFAULTS.keep_latest_k + 1} saves cannot (none is purged "
                 "yet)")
    if serialization is not None:
        notes.append(serialization_note(serialization))
    details = {"size_bytes": size_bytes, "device": args.device, "batch": args.batch,
               "every_steps": every, "periods": periods,
               "async_checkpoint": DEFAULTS.async_checkpoint,
               "seconds_between_saves": round(period_s, 4), "plain_step_s": plain, **figures,
               "saves": len(saver.durable_s), "saves_overwriting_the_spare": sum(counted),
               "median_held_share": round(figures["held_per_save_s"]["median"] / period_s, 4),
               "read_back": read_back, "serialization_cpu_s": serialization}
    if other is not None:
        arm = save_figures(pairs, OTHER, other, args.warmups, periods)
        arm["ratio"] = ratio_summary(pairs.values("baseline"), pairs.values(OTHER), ratio_of)
        notes += [f"informative, {OTHER}: per-pair ratio to the baseline "
                  f"{describe(arm['ratio'])}", *save_notes(OTHER, arm, period_s, mb)]
        details["other_arm"] = arm | {"read_back": other_read_back}
    return emit("checkpoint_e2e", metric="wall time per training step with a save every "
                f"{every} steps (default configuration) / without", quick=args.quick,
                notes=notes, **result, details=details,
                checks=[] if args.quick else [check("state size", [mb], "MB",
                                                    Target(">=", 100), statistic="max")])


if __name__ == "__main__":
    main()
