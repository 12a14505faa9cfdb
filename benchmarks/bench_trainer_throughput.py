"""Trainer throughput: Stoker's Trainer versus a minimal hand-written DDP loop.

Both run under torchrun with 2 gloo ranks on CPU (2 CUDA ranks would need 2 GPUs), on the same
model (SmallCNN), the same tensors (the demo digits, split by seed 0), the same global batch (64)
and AdamW with the same one-cycle schedule.

* Baseline: ``benchmarks/baseline_ddp_loop.py``, the torchrun tutorial pattern (no evaluation,
  no checkpoint, no logging); it times its own steps.
* Candidate: ``torchrun -m stoker.runtime SPEC`` with Stoker's defaults: tracking off (no
  tracking URI), a committed checkpoint every 50 steps (synchronous, as by default: part of
  Stoker's cost), deterministic kernels, one small all-reduce for about 0.1 s of steps
  (losses, stop flag; read a step later), progress events every step. Timed from its progress
  events; the per-epoch evaluation, which the baseline does not do, is taken out and reported
  separately.

Both are timed from the end of the first epoch to the end of training (start-up excluded).
Ratio = Stoker samples/s / baseline samples/s; target >= 0.98.

A third arm in every pair attributes the periodic checkpoints' share: the same Stoker job
without them (``train.checkpoint_every_steps`` beyond the job's length; the last step is still
saved). Reported beside the verdict, pair by pair: Stoker without periodic checkpoints / the
loop, and the share of throughput the checkpoints every 50 steps cost (1 - default / without).

    python benchmarks/bench_trainer_throughput.py [--quick] [--repeats N] [--epochs N]
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    Sized,  # noqa: E402
    Target,
    Workdir,
    alternate,
    compared,
    describe,
    emit,
    log,
    options,
    ratio_summary,
    run_timed,
    summary,
    torchrun,
    until_decided,
)
from benchmarks.jobs import (  # noqa: E402
    demo_dataset,
    run_runtime,
    steady_window,
    write_spec,  # noqa: E402
)
from benchmarks.jobs import steps_per_epoch as epoch_steps  # noqa: E402

TARGET = Target(">=", 0.98)
NO_PERIODIC = "Stoker without periodic checkpoints"
# 40 epochs (a ~10 s window): with 15 (~3.7 s) the machine's load moved single pairs by 10-20 %.
EPOCHS = Sized("--epochs", int, 40, 2, "epochs per run (40: about 10 s timed on 2 CPU cores)")
GLOBAL_BATCH = 64
NPROC = 2
TIMEOUT_S = 1800


def main() -> None:
    args = options(__doc__, 8, EPOCHS)
    epochs = args.epochs
    with Workdir(args.workdir, "bench-throughput") as work:
        dataset = demo_dataset(args.data_dir or work, quick=args.quick)
        steps_per_epoch = epoch_steps(dataset, GLOBAL_BATCH)
        first_step = steps_per_epoch  # skip the first epoch: start-up, first-touch costs
        evals, profiles, all_in = [], [], []

        def baseline(i: int) -> float:
            out = work / f"loop-{i}.json"
            run_timed(torchrun(NPROC, str(ROOT / "benchmarks/baseline_ddp_loop.py"),
                               dataset.local_path, f"--epochs={epochs}",
                               f"--global-batch-size={GLOBAL_BATCH}",
                               f"--first-step={first_step}", f"--out={out}"),
                      work / f"loop-{i}.log", TIMEOUT_S)
            return json.loads(out.read_text())["samples_per_s"]

        def candidate(i: int, name: str = "stoker", **train: int) -> float:
            job = work / f"{name}-{i}"
            spec = write_spec(job, dataset.local_path, epochs=epochs,
                              global_batch_size=GLOBAL_BATCH, nproc_per_node=NPROC, **train)
            run_runtime(spec, NPROC, work / f"{name}-{i}.log", TIMEOUT_S)
            window = steady_window(job, first_step)
            if train:  # the attribution arm: its figure only
                return window.samples_per_s(GLOBAL_BATCH)
            if i >= 0:  # not the warm-up
                evals.append(window.eval_s / (window.train_s + window.eval_s))
                all_in.append(window.steps * GLOBAL_BATCH / (window.train_s + window.eval_s))
                profiles.append(json.loads((job / "result.json").read_text())["profile"])
            return window.samples_per_s(GLOBAL_BATCH)

        log(f"{epochs} epochs of {steps_per_epoch} steps per run, timed after step {first_step}")
        # No periodic checkpoint: a step count past the job's end (the last step still saves).
        no_periodic = functools.partial(candidate, name="stoker-no-periodic-ckpt",
                                        checkpoint_every_steps=epochs * steps_per_epoch + 1)
        # An interval that straddles the target gets more pairs (up to twice the planned).
        pairs = alternate(baseline, candidate, args.repeats, args.warmups,
                          extra={NO_PERIODIC: no_periodic},
                          decided=until_decided(lambda b, c: c / b, TARGET),
                          max_repeats=2 * args.repeats)

    result = compared(pairs, lambda b, c: c / b, TARGET, "hand-written DDP loop",
                      "Stoker Trainer (evaluation excluded)", "samples/s")
    cand = pairs.values("candidate")
    profile = profiles[cand.index(sorted(cand)[len(cand) // 2])]
    wall = profile["wall_s"]
    shares = ", ".join(f"{k.removesuffix('_s')} {profile[k] / wall:.1%}"
                       for k in ("data_s", "forward_backward_s", "optimizer_s", "sync_s",
                                 "checkpoint_s", "eval_s") if k in profile)
    notes = [f"{epochs} epochs x {steps_per_epoch} steps, global batch {GLOBAL_BATCH}, "
             f"{NPROC} gloo ranks; timed after step {first_step}",
             "Stoker's figure includes its checkpoints (every 50 steps, synchronous by "
             "default), the per-step all-reduce and progress events; tracking is off",
             f"Stoker's per-epoch evaluation is excluded; it takes {statistics.median(evals):.1%} "
             f"of the window (with it: {statistics.median(all_in):.0f} samples/s)",
             f"where Stoker's time went (median run, whole attempt): {shares}"]
    without = ratio_summary(pairs.values("baseline"), pairs.values(NO_PERIODIC),
                            lambda b, x: x / b)
    ckpt_share = ratio_summary(pairs.values(NO_PERIODIC), pairs.values("candidate"),
                               lambda x, c: 1 - c / x)
    notes += [f"attribution, per pair: Stoker without periodic checkpoints / the loop = "
              f"{describe(without)}; the checkpoints every 50 steps (every "
              f"{50 * profile['wall_s'] / max(profile.get('steps', 1), 1):.2g} s here) cost "
              f"{describe(ckpt_share)} of Stoker's throughput"]
    emit("trainer_throughput", metric="Stoker samples/s / hand-written DDP loop samples/s",
         quick=args.quick, notes=notes, **result,
         details={"epochs": epochs, "steps_per_epoch": steps_per_epoch,
                  "first_step": first_step, "stoker_profile": profile,
                  "without_periodic_checkpoints_vs_loop": without,
                  "periodic_checkpoint_share": ckpt_share,
                  "stoker_with_eval_samples_per_s": summary(all_in, "samples/s",
                                                            "Stoker incl. evaluation")})


if __name__ == "__main__":
    main()
