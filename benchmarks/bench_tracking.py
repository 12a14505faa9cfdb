"""Tracking overhead per step: the same Stoker job with MLflow tracking versus without.

Both sides are ``torchrun -m stoker.runtime SPEC`` with 2 gloo ranks on the demo digits and
Stoker's defaults; they differ only in the spec's ``tracking_uri``:

* Baseline: no tracking URI (no MLflow run at all).
* Candidate: a local sqlite MLflow store (``sqlite:///<work>/mlflow.db``): rank 0 logs
  ``train_loss`` every step and ``lr``, ``samples_per_s`` every 10 steps (queued; a worker
  thread sends them with ``log_batch`` every 2 s), evaluation metrics every epoch, and MLflow's
  system metrics every 10 s (the defaults).

Step time = the mean time per step from the end of the first epoch to the end of training, from
the progress events (evaluation excluded, checkpoints and metric flushes included).
Ratio, per pair = (with - without) / without; target <= 0.01 (1 %). Beside it, the issue's
target in CPU time: rank 0's process CPU per step (every thread) from the first evaluation to the
last once the MLflow run is open (``process_cpu_s`` of the ``eval`` progress events: the steady
state; opening the run in the background is a one-off ~2 CPU-s),
(with - without) / without per pair, <= 1 %.

    python benchmarks/bench_tracking.py [--quick] [--repeats N] [--epochs N]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    Target,
    Workdir,
    alternate,
    check,
    compared,
    emit,
    log,
    options,
    summary,
)
from benchmarks.jobs import (  # noqa: E402
    EPOCHS,
    demo_dataset,
    run_runtime,
    steady_window,
    write_spec,  # noqa: E402
)
from benchmarks.jobs import steps_per_epoch as epoch_steps  # noqa: E402
from stoker.runtime.progress import read_events  # noqa: E402

TARGET = Target("<=", 0.01)
GLOBAL_BATCH = 64
NPROC = 2
TIMEOUT_S = 1800


def main() -> None:
    args = options(__doc__, 5, EPOCHS)
    epochs = args.epochs
    with Workdir(args.workdir, "bench-tracking") as work:
        dataset = demo_dataset(args.data_dir or work, quick=args.quick)
        steps_per_epoch = epoch_steps(dataset, GLOBAL_BATCH)
        first_step = steps_per_epoch
        tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
        medians = {"without": [], "with": []}
        excess = {"without": [], "with": []}  # ms per step spent in steps > 2x the median
        cpu_ms = {"without": [], "with": []}  # rank 0's CPU per step (all its threads)

        def run(i: int, side: str) -> float:
            job = work / f"{side}-{i}"
            spec = write_spec(job, dataset.local_path,
                              tracking_uri=tracking_uri if side == "with" else None,
                              artifact_location=(work / "mlartifacts").as_uri(), epochs=epochs,
                              global_batch_size=GLOBAL_BATCH, nproc_per_node=NPROC)
            run_runtime(spec, NPROC, work / f"{side}-{i}.log", TIMEOUT_S)
            if side == "with" and not (job / "mlflow_run_id").is_file():
                raise RuntimeError(f"{job}: no MLflow run was created; tracking did not run")
            window = steady_window(job, first_step)
            if i >= 0:  # not the warm-up (which also creates the MLflow database)
                medians[side].append(window.median_step_s * 1e3)
                slow = [dt for dt in window.intervals_s if dt > 2 * window.median_step_s]
                excess[side].append(sum(dt - window.median_step_s for dt in slow)
                                    / window.steps * 1e3)
                # From the first evaluation after the run opened (its ~2 CPU-s are a one-off).
                evals = [e for e in read_events(job) if e["event"] == "eval"
                         and e.get("tracking_open", True)]
                if len(evals) < 2:  # a short run (--quick) on a loaded machine: the run opened
                    # late; all evaluations then (the one-off open cost included: an upper bound)
                    evals = [e for e in read_events(job) if e["event"] == "eval"]
                cpu_ms[side].append((evals[-1]["process_cpu_s"] - evals[0]["process_cpu_s"])
                                    / (evals[-1]["step"] - evals[0]["step"]) * 1e3)
            return window.mean_step_s * 1e3

        log(f"{epochs} epochs of {steps_per_epoch} steps per run, timed after step {first_step}")
        pairs = alternate(lambda i: run(i, "without"), lambda i: run(i, "with"), args.repeats,
                          args.warmups)

    result = compared(pairs, lambda b, c: (c - b) / b, TARGET, "without tracking",
                      "with MLflow tracking (sqlite)", "ms/step")
    overhead, step_ms = result["ratio"]["median"], result["baseline"]["median"]
    med_b = summary(medians["without"], "ms", "median step interval, without")
    med_c = summary(medians["with"], "ms", "median step interval, with")
    notes = [f"{epochs} epochs x {steps_per_epoch} steps, global batch {GLOBAL_BATCH}, "
             f"{NPROC} gloo ranks; timed after step {first_step}",
             f"overhead {overhead:+.2%} of a {step_ms:.1f} ms step (per-pair median; "
             "target <= 1 %)",
             f"median single-step interval: {med_b['median']:.1f} ms without, "
             f"{med_c['median']:.1f} ms with tracking (a typical step, which buffers metrics "
             "only; the means include the periodic log_batch flushes)",
             "steps slower than twice the median add "
             f"{statistics.median(excess['without']):.2f} ms per step without tracking and "
             f"{statistics.median(excess['with']):.2f} ms with it (rank 0's worker thread opens "
             "the run, ~2 CPU-s, during the first seconds of training, and sends queued "
             "metrics every 2 s; on 2 CPU cores it competes with both ranks)"]
    cpu_overhead = [(c - b) / b for b, c in zip(cpu_ms["without"], cpu_ms["with"], strict=True)]
    notes.append(f"rank-0 CPU per step: {statistics.median(cpu_ms['without']):.2f} ms without, "
                 f"{statistics.median(cpu_ms['with']):.2f} ms with tracking; per pair "
                 f"{statistics.median(cpu_overhead):+.2%} (target <= 1 %)")
    result["checks"] = [*result.get("checks", []),
                        check("rank-0 CPU per step, (with - without) / without", cpu_overhead,
                              "ratio", TARGET)]
    emit("tracking", metric="(step time with tracking - without) / without",
         quick=args.quick, notes=notes, **result,
         details={"epochs": epochs, "median_interval_without_ms": med_b,
                  "median_interval_with_ms": med_c})


if __name__ == "__main__":
    main()
