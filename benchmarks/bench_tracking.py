"""Tracking's cost: tracking's share of rank 0's CPU per step, in the default configuration.

The target (issue 17, issue 45: including each attempt's one-off, on the default configuration)
is in CPU time: what MLflow tracking costs rank 0 per step, <= 1 % of rank 0's CPU per step.

**The verdict: the default configuration.** ``stoker run`` on the defaults (the demo digits,
``train.*`` as shipped but ``train.epochs``, the local sqlite MLflow store and Prefect server of
a user's second run: reused), as many runs as ``--repeats``. Rank 0 logs ``train_loss`` (the
mean of the steps since), ``lr`` and ``samples_per_s`` every 10 steps
(``train.metrics_every_steps``; queued, a worker thread sends them with ``log_batch`` every
10 s), evaluation metrics every epoch, and MLflow's system metrics every 10 s. Its ranks are
forked from ``stoker run``'s process, which imported MLflow and its sqlite store for its own
use (the job's record, lineage, the model registry) before the fork: rank 0 inherits them.

Tracking's share, per tracked run (the median of the runs and its bootstrap interval decide):

* the tracking threads' CPU per step sent (``tracking_cpu_s`` / ``tracking_sent_step`` of the
  ``eval`` progress events, both as of the last batch MLflow confirmed: the worker that sends the
  batches, every 10 s, and MLflow's system metrics monitor, each from its thread CPU clock),
  over whole batches after the first;
* plus the training thread's part, queueing the metrics: ``BackgroundTracker.log_metrics`` of
  three values timed with ``time.thread_time`` in this process, 200k calls, divided by
  ``metrics_every_steps`` (one call per that many steps);
* plus the attempt's one-off (the tracking threads' CPU before the first batch MLflow
  confirmed: opening the store and the run, its params, tags and dataset, the first batch) and,
  in the default configuration, the CPU of the imports ``stoker run`` makes before the fork
  only for rank 0's tracking (``RANK_ONLY_IMPORTS``, timed in a fresh interpreter that already
  imported what ``stoker run`` uses itself), divided by the attempt's steps, so a short job
  shows the larger share it really pays;

divided by rank 0's process CPU per step between the same evaluations (``process_cpu_s``).

**Beside it, informative: a rank started cold.** Pairs of ``torchrun -m stoker.runtime SPEC``
with 2 gloo ranks on the demo digits, alternated: without a tracking URI (no MLflow run at all)
and with a local sqlite store (``sqlite:///<work>/mlflow.db``). Such a rank 0 (torchrun by hand,
and the ranks Slurm or Kubernetes start) imports MLflow and its store itself (~2-3 CPU-s per
attempt): its share, by the same rule, is reported with that one-off in it. From the pairs, from
a quarter into each run: the step time's (with - without) / without, and rank 0's process CPU
per step (with - without) / without. These also catch indirect costs (a tracking thread taking
a core from a rank shows in wall time), but on 2 shared cores a pair's step time varies by
several percent, far more than the 1 % they would have to resolve.

    python benchmarks/bench_tracking.py [--quick] [--repeats N] [--epochs N]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline_overhead import create_experiment  # noqa: E402
from benchmarks.common import (  # noqa: E402
    PYTHON,
    Sized,
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
    demo_dataset,
    run_runtime,
    steady_window,
    stoker_run,
    write_spec,  # noqa: E402
)
from benchmarks.jobs import steps_per_epoch as epoch_steps  # noqa: E402
from stoker.config import TrainConfig  # noqa: E402
from stoker.local_server import LocalServer  # noqa: E402
from stoker.runtime.background_tracking import BackgroundTracker  # noqa: E402
from stoker.runtime.progress import read_events  # noqa: E402

TARGET = Target("<=", 0.01)
QUEUE_CALLS = 200_000
EVERY = TrainConfig().metrics_every_steps  # steps per train_loss / lr / samples_per_s value
# The run opens and sends its first batch a few seconds in, then one batch every 10 s: at least
# one whole interval must lie between two evaluations' batches. 80 epochs was about 25 s of
# training when chosen; on a machine 1.8x faster (2026-12-08) it was ~14 s, and 1 run in 3 sent
# no second batch before its last evaluation. 100 epochs is ~18 s there. The share at the job's
# own default length (``TrainConfig().epochs``) is reported beside it, from the same figures.
TRACKING_EPOCHS = Sized("--epochs", int, 100, 2, "epochs per run")
DEFAULT_EPOCHS = TrainConfig().epochs
GLOBAL_BATCH = 64
NPROC = 2
TIMEOUT_S = 1800
# What `stoker run` imports before forking its ranks only for rank 0's tracking
# (``stoker.runtime.launch.TRACKING_IMPORTS`` less what it uses itself: MLflow, its sqlite store
# and ``stoker.runtime.tracking`` serve the job's record, lineage and the model registry).
RANK_ONLY_IMPORTS = ("mlflow.system_metrics.system_metrics_monitor",)
OWN_IMPORTS = ("mlflow", "mlflow.store.tracking.sqlalchemy_store", "stoker.runtime.tracking")


def queue_cpu_us(calls: int = QUEUE_CALLS) -> float:
    """CPU microseconds of the training thread per ``BackgroundTracker.log_metrics`` call with
    the three values the trainer sends together (``train_loss``, ``lr``, ``samples_per_s``), on
    a tracker whose run never opens (so the worker sends nothing meanwhile)."""
    gate = threading.Event()

    def never_opens() -> None:
        gate.wait()
        raise ConnectionError("benchmark over")

    tracker = BackgroundTracker(never_opens)
    started = time.thread_time()
    for step in range(calls):
        tracker.log_metrics(step, {"train_loss": 0.5, "lr": 0.01, "samples_per_s": 6400.0})
    spent = time.thread_time() - started
    gate.set()
    return spent / calls * 1e6


def tracking_window(events: list[dict]) -> tuple[dict, dict] | None:
    """(first, last) ``eval`` events between which the tracking threads' CPU per step is read,
    or None when the run sent fewer than two batches before its last evaluation.

    Each ``eval`` event carries the last batch MLflow confirmed: its highest step
    (``tracking_sent_step``) and the tracking threads' CPU once it was confirmed
    (``tracking_cpu_s``). ``first`` is the first evaluation after the first batch (which follows
    the run's opening: importing MLflow and opening the run are a one-off), ``last`` the last
    one; between their batches lie whole batches only, so no send is counted in part.
    """
    evals = [e for e in events if e["event"] == "eval" and e.get("tracking_sent_step", 0) > 0]
    if len(evals) < 2 or evals[-1]["tracking_sent_step"] <= evals[0]["tracking_sent_step"]:
        return None
    return evals[0], evals[-1]


def rank_only_imports_cpu_s(repeats: int = 3) -> float:
    """CPU seconds (user + system, median of ``repeats`` fresh interpreters) of importing
    ``RANK_ONLY_IMPORTS`` after ``OWN_IMPORTS``: what ``stoker run`` spends before the fork
    only so that rank 0 need not import them."""
    code = ("import importlib, time\n"
            f"for m in {OWN_IMPORTS!r}: importlib.import_module(m)\n"
            "t = time.process_time()\n"
            f"for m in {RANK_ONLY_IMPORTS!r}: importlib.import_module(m)\n"
            "print(time.process_time() - t)\n")
    spent = []
    for _ in range(repeats):
        out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True,
                             cwd=ROOT, timeout=300)
        spent.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(spent)


@dataclass
class Share:
    """Tracking's share of rank 0's CPU per step in one tracked run (see the module docstring):
    ``(tracking_ms + queue_ms + one_off_ms) / cpu_ms``."""

    tracking_ms: float  # the tracking threads' CPU per step sent, whole batches after the first
    one_off_s: float  # CPU-s before the first confirmed batch (+ the rank-only imports)
    attempt_steps: int
    cpu_ms: float  # rank 0's process CPU per step over the same batches
    steady_from: int  # the step of the first confirmed batch's evaluation

    def value(self, queue_ms: float) -> float:
        return (self.tracking_ms + queue_ms + self.one_off_ms) / self.cpu_ms

    @property
    def one_off_ms(self) -> float:
        return self.one_off_s * 1e3 / self.attempt_steps


def share_of(job: Path, quick: bool, extra_one_off_s: float = 0.0) -> Share:
    """The :class:`Share` of the tracked run in ``job`` (one attempt), from its progress events.

    Raises:
        RuntimeError: the run confirmed fewer than two batches before its last evaluation (a
            ``--quick`` run takes its first and last evaluations instead).
    """
    events = read_events(job)
    evals = [e for e in events if e["event"] == "eval"]
    pair = tracking_window(events)
    if pair is None:
        if not quick:
            raise RuntimeError(f"{job}: fewer than two MLflow batches before the last "
                               "evaluation; pass more --epochs")
        pair = evals[0], evals[-1]  # a smoke run: whatever there is
    first, last = pair
    (start,) = [e for e in events if e["event"] == "start"]
    return Share(
        tracking_ms=(last.get("tracking_cpu_s", 0.0) - first.get("tracking_cpu_s", 0.0))
        / max(1, last.get("tracking_sent_step", 0) - first.get("tracking_sent_step", 0)) * 1e3,
        one_off_s=first.get("tracking_cpu_s", 0.0) + extra_one_off_s,
        attempt_steps=int(start["total_steps"]),
        cpu_ms=(last["process_cpu_s"] - first["process_cpu_s"])
        / max(1, last["step"] - first["step"]) * 1e3,
        steady_from=int(first["step"]))


def main() -> None:
    args = options(__doc__, 5, TRACKING_EPOCHS)
    epochs = args.epochs
    queue_us = queue_cpu_us()
    queue_ms = queue_us / 1e3 / EVERY
    with Workdir(args.workdir, "bench-tracking") as work:
        dataset = demo_dataset(args.data_dir or work, quick=args.quick)
        steps_per_epoch = epoch_steps(dataset, GLOBAL_BATCH)
        # The pairs' step times and CPU are compared from a quarter into the run (epoch 25 of
        # 100): the MLflow run opened and sent its first batch long before (a one-off reported
        # apart), so they show the steady cost.
        first_step = steps_per_epoch * max(1, epochs // 4)
        tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
        medians = {"without": [], "with": []}
        excess = {"without": [], "with": []}  # ms per step spent in steps > 2x the median
        cpu_ms = {"without": [], "with": []}  # rank 0's CPU per step (all its threads)
        cold: list[Share] = []  # the tracked bare-torchrun runs

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
                evals = [e for e in read_events(job) if e["event"] == "eval"]
                later = [e for e in evals if e["step"] >= first_step] or evals
                cpu_ms[side].append((later[-1]["process_cpu_s"] - later[0]["process_cpu_s"])
                                    / max(1, later[-1]["step"] - later[0]["step"]) * 1e3)
                if side == "with":
                    cold.append(share_of(job, args.quick))
            return window.mean_step_s * 1e3

        log(f"{epochs} epochs of {steps_per_epoch} steps per run, timed after step {first_step}")
        pairs = alternate(lambda i: run(i, "without"), lambda i: run(i, "with"), args.repeats,
                          args.warmups)
        defaults, rank_only_s = default_configuration(work, dataset, args)

    # The target: tracking's share of rank 0's CPU per step, in each tracked run of the default
    # configuration, with the one-off per attempt (opening the run; the imports made for rank 0
    # only) spread over the attempt's steps: a job pays it on every attempt, so it is tracking's.
    share = [s.value(queue_ms) for s in defaults]
    at_default = [dataclasses.replace(s, attempt_steps=DEFAULT_EPOCHS * steps_per_epoch)
                  .value(queue_ms) for s in defaults]
    cold_share = [s.value(queue_ms) for s in cold]
    result = compared(pairs, lambda b, c: (c - b) / b,
                      "tracking's share of rank 0's CPU per step, default configuration, <= "
                      "0.01 (the step time's per-pair ratio of cold ranks is informative)",
                      "without tracking", "with MLflow tracking (sqlite), rank started cold",
                      "ms/step")
    overhead, step_ms = result["ratio"]["median"], result["baseline"]["median"]
    med_b = summary(medians["without"], "ms", "median step interval, without")
    med_c = summary(medians["with"], "ms", "median step interval, with")

    def parts(shares: list[Share], values: list[float]) -> str:
        return (f"{statistics.median(values):.2%} (the tracking threads "
                f"{statistics.median(s.tracking_ms for s in shares):.3f} ms + queueing the "
                f"metrics on the training thread {queue_ms:.4f} ms + the attempt's one-off "
                f"{statistics.median(s.one_off_ms for s in shares):.3f} ms, "
                f"{statistics.median(s.one_off_s for s in shares):.3f} CPU-s spread over its "
                f"{statistics.median(s.attempt_steps for s in shares):.0f} steps, of "
                f"{statistics.median(s.cpu_ms for s in shares):.2f} ms; median of "
                f"{len(shares)} runs, from step "
                f"{statistics.median(s.steady_from for s in shares):.0f}, after the run's "
                "first batch)")

    notes = [f"the default configuration (stoker run, {epochs} epochs, rank 0 forked from "
             "stoker run's process with MLflow imported): tracking's share of rank 0's CPU per "
             f"step {parts(defaults, share)}; the one-off includes {rank_only_s:.3f} CPU-s of "
             f"imports stoker run makes only for rank 0 ({', '.join(RANK_ONLY_IMPORTS)}); "
             "target <= 1 %",
             f"the same figures at the job's default {DEFAULT_EPOCHS} epochs "
             f"({DEFAULT_EPOCHS * steps_per_epoch} steps; informative): the one-off spread "
             f"over them gives a share of {statistics.median(at_default):.2%}: a short "
             "attempt pays most of its tracking when it opens the run",
             "a rank started cold (bare torchrun, as Slurm and Kubernetes start ranks; "
             f"informative): {epochs} epochs x {steps_per_epoch} steps, global batch "
             f"{GLOBAL_BATCH}, {NPROC} gloo ranks: tracking's share {parts(cold, cold_share)}: "
             "its one-off is importing MLflow and its store in rank 0",
             f"cold ranks, step time {overhead:+.2%} of a {step_ms:.1f} ms step (per-pair "
             f"median from step {first_step}, informative: includes indirect costs, but "
             "varies by more than 1 % between pairs on a shared machine)",
             f"cold ranks, median single-step interval: {med_b['median']:.1f} ms without, "
             f"{med_c['median']:.1f} ms with tracking (a typical step, which buffers metrics "
             "only; the means include the periodic log_batch flushes)",
             "cold ranks, steps slower than twice the median add "
             f"{statistics.median(excess['without']):.2f} ms per step without tracking and "
             f"{statistics.median(excess['with']):.2f} ms with it (rank 0's worker thread opens "
             "the run, ~2 CPU-s, during the first seconds of training, and sends queued "
             "metrics every 10 s; on 2 CPU cores it competes with both ranks)"]
    cpu_overhead = [(c - b) / b for b, c in zip(cpu_ms["without"], cpu_ms["with"], strict=True)]
    cpu_pairs = summary(cpu_overhead, "ratio")
    notes.append(f"cold ranks, rank-0 process CPU per step: "
                 f"{statistics.median(cpu_ms['without']):.2f} ms without, "
                 f"{statistics.median(cpu_ms['with']):.2f} ms with tracking; per pair "
                 f"{cpu_pairs['median']:+.2%} [{cpu_pairs['min']:+.2%} to {cpu_pairs['max']:+.2%}]"
                 " (informative: the difference of two noisy totals)")
    result["checks"] = [*result.get("checks", []),
                        check("tracking's share of rank-0 CPU per step, default configuration "
                              "(stoker run): (tracking threads + one-off + queueing) / process",
                              share, "ratio", TARGET)]
    emit("tracking", metric="cold ranks: (step time with tracking - without) / without",
         quick=args.quick, notes=notes, **result,
         details={"epochs": epochs, "median_interval_without_ms": med_b,
                  "median_interval_with_ms": med_c,
                  "queue_us_per_call": queue_us,
                  "rank_only_imports_cpu_s": rank_only_s,
                  "default_configuration": {
                      "share": summary(share, "ratio"),
                      "share_at_default_epochs": summary(at_default, "ratio"),
                      "tracking_threads_ms_per_step": summary(
                          [s.tracking_ms for s in defaults], "ms"),
                      "one_off_cpu_s": summary([s.one_off_s for s in defaults], "s"),
                      "process_cpu_per_step_ms": summary([s.cpu_ms for s in defaults], "ms")},
                  "cold_rank": {
                      "share": summary(cold_share, "ratio"),
                      "tracking_threads_ms_per_step": summary([s.tracking_ms for s in cold],
                                                              "ms"),
                      "one_off_cpu_s": summary([s.one_off_s for s in cold], "s"),
                      "process_cpu_per_step_ms": summary([s.cpu_ms for s in cold], "ms")},
                  "process_cpu_overhead_per_pair": cpu_pairs})


def default_configuration(work: Path, dataset, args) -> tuple[list[Share], float]:
    """``--repeats`` runs of ``stoker run`` on the defaults but ``train.epochs`` (a user's second
    run: a fresh ``work_dir`` with the dataset already pulled, the MLflow store and the local
    Prefect server reused, both made once, untimed); returns each run's :class:`Share` and the
    rank-only imports' CPU-s added to each one-off."""
    rank_only_s = rank_only_imports_cpu_s()
    stores = work / "stores"
    stores.mkdir(exist_ok=True)
    tracking_uri = f"sqlite:///{stores / 'mlflow.db'}"
    create_experiment(tracking_uri, stores / "mlartifacts")
    overrides = [f"data.repo_url={dataset.repo_url}", f"tracking.tracking_uri={tracking_uri}",
                 f"train.epochs={args.epochs}"]
    server = LocalServer(stores / "prefect", startup_timeout_s=300)
    log("the default configuration: stoker run (the local Prefect server started once, untimed)")
    server.ensure()
    shares = []
    try:
        for i in range(args.repeats):
            work_dir = work / f"stoker-run-{i}"
            work_dir.mkdir()
            os.symlink(Path(dataset.local_path).parent, work_dir / "datasets")
            wall, job = stoker_run(work_dir, overrides, work / f"stoker-run-{i}.log",
                                   stores / "prefect", TIMEOUT_S)
            shares.append(share_of(job, args.quick, rank_only_s))
            log(f"stoker run {i + 1}/{args.repeats}: {wall:.1f} s, tracking's share "
                f"{shares[-1].value(0.0):.2%} before queueing")
    finally:
        server.stop()
    return shares, rank_only_s


if __name__ == "__main__":
    main()
