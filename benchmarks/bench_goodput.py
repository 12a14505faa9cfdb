"""The default job as the user waits for it: ``stoker run`` against a bare torchrun of the same
job, from the command to its exit: wall time, CPU time and goodput.

* Baseline: ``torchrun --nproc-per-node N -m stoker.runtime SPEC`` with the same train config and
  dataset, no tracking: the floor any launcher built on torchrun pays for this job (Python,
  torch and its compiler stack imported in every process, rendezvous).
* Candidate: ``stoker run`` on the embedded defaults (the demo digits, ``train.*`` as shipped,
  12 epochs) as a user's second ``make run``: a fresh ``work_dir`` (a new job), the dataset
  already pulled, the local Prefect server and the MLflow store reused (started and migrated
  once, untimed). Its CPU is the whole process tree's **plus what the reused Prefect server
  spent during the run** (its process's CPU time before and after): all the CPU the pipeline
  costs on the machine.

Figure, per pair: stoker run's wall / bare torchrun's wall, target <= 1.3. Checks, per pair:
the CPU ratio (the same sides) <= 1.2; the **end-to-end goodput** of the warm run >= 0.6: the
job's useful step time at bare-runtime speed (the same pair's bare ``train_time_s``, the
runtime's committed step time) / stoker run's wall from the command to its exit.

Reported beside them (no target): ``command_goodput`` and ``goodput`` as the run logged them,
**read back from the MLflow store** (its own step time over the command's wall, and over the
billed attempt), the parts of the attempt (start-up, steps, evaluation and checkpoints, end), and
**the first run on a fresh machine state**, once, after the pairs: a new Prefect home (the
database prepared and the server started), a new work folder with the demo repository made and
pulled there, a new MLflow store; its wall and end-to-end goodput. (A fresh clone also installs:
``make install`` is not timed here.)

    python benchmarks/bench_goodput.py [--quick] [--repeats N]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import jobs  # noqa: E402
from benchmarks.bench_pipeline_overhead import create_experiment, nproc  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Pairs,
    Target,
    Workdir,
    alternate,
    check,
    compared,
    emit,
    log,
    options,
    run_timed,
    summary,
    torchrun,
)
from benchmarks.jobs import demo_dataset, write_spec  # noqa: E402
from benchmarks.stats import UNDECIDED, median_interval, per_pair  # noqa: E402
from stoker.jobs.attempts import AttemptLog  # noqa: E402
from stoker.local_server import LocalServer  # noqa: E402
from stoker.runtime.progress import read_events  # noqa: E402

WALL_TARGET = Target("<=", 1.3)
CPU_TARGET = Target("<=", 1.2)
GOODPUT_TARGET = Target(">=", 0.6)
TIMEOUT_S = 1800
PARTS = ("start_up_s", "steps_s", "eval_and_checkpoints_s", "end_s")


def parts(job_dir: Path, launched: float, exited: float, useful_s: float) -> dict[str, float]:
    """Where one attempt's wall time went, in seconds (Unix times in, the progress events'
    clock): launch to the ``start`` event, the steps (``useful_s``), the rest of the runtime's
    start-to-end span (evaluation, checkpoints, the final model save), ``end`` event to exit."""
    events = read_events(job_dir)
    start = next(e["time"] for e in events if e["event"] == "start")
    end = next(e["time"] for e in reversed(events) if e["event"] == "end")
    return {"start_up_s": round(start - launched, 3), "steps_s": round(useful_s, 3),
            "eval_and_checkpoints_s": round(end - start - useful_s, 3),
            "end_s": round(exited - end, 3)}


def mlflow_goodput(tracking_uri: str, job_dir: Path) -> dict[str, float]:
    """The job's cost metrics as the pipeline logged them, read back from the MLflow store.

    Raises:
        RuntimeError: the run has no ``goodput`` or ``command_goodput`` metric.
    """
    from mlflow import MlflowClient

    run_id = (job_dir / "mlflow_run_id").read_text().strip()
    metrics = MlflowClient(tracking_uri).get_run(run_id).data.metrics
    missing = {"goodput", "command_goodput"} - set(metrics)
    if missing:
        raise RuntimeError(f"MLflow run {run_id} of {job_dir} has no {sorted(missing)} metric")
    return {k: metrics[k] for k in ("goodput", "command_goodput", "command_wall_s", "billed_s",
                                    "useful_train_s") if k in metrics}


def server_cpu_s(server: LocalServer) -> float:
    """CPU seconds (user + system) the recorded local Prefect server's process has used."""
    record = server.record()
    if record is None:
        raise RuntimeError(f"the local Prefect server of {server.home} is not running")
    times = psutil.Process(record["pid"]).cpu_times()
    return times.user + times.system


def stoker_run(work_dir: Path, overrides: list[str], log_path: Path, prefect_home: Path,
               tracking_uri: str) -> tuple[float, Path, dict[str, float]]:
    """``stoker run`` in ``work_dir`` to its exit; returns (wall s, its job folder, the cost
    metrics read back from ``tracking_uri``)."""
    wall, job = jobs.stoker_run(work_dir, overrides, log_path, prefect_home, TIMEOUT_S)
    return wall, job, mlflow_goodput(tracking_uri, job)


def first_run(work: Path, args, bare_steps_s: float) -> dict:
    """The first ``stoker run`` on a fresh machine state (see the module docstring), once."""
    fresh = work / "first-run"
    work_dir, home = fresh / "work", fresh / "prefect"
    work_dir.mkdir(parents=True)
    tracking_uri = f"sqlite:///{work_dir / 'mlflow.db'}"  # the default store of that folder
    overrides = ["train.epochs=1", f"data.repo_url={demo_dataset(work, quick=True).repo_url}"] \
        if args.quick else []
    log("the first run on a fresh machine state: a new Prefect home, work folder and store")
    try:
        wall, _job, cost = stoker_run(work_dir, overrides, fresh / "run.log", home,
                                      tracking_uri)
    finally:
        LocalServer(home).stop()
    return {"wall_s": round(wall, 3), "goodput_at_bare_speed": round(bare_steps_s / wall, 4),
            "mlflow": cost}


def main() -> None:
    args = options(__doc__, 3)
    with Workdir(args.workdir, "bench-goodput") as work:
        dataset = demo_dataset(args.data_dir or work, quick=args.quick)
        stores = work / "stores"
        stores.mkdir(exist_ok=True)
        tracking_uri = f"sqlite:///{stores / 'mlflow.db'}"
        create_experiment(tracking_uri, stores / "mlartifacts")
        overrides = [f"data.repo_url={dataset.repo_url}", f"tracking.tracking_uri={tracking_uri}",
                     *(["train.epochs=1"] if args.quick else [])]
        world = nproc()
        runs = work / "runs"
        runs.mkdir(exist_ok=True)
        server = LocalServer(stores / "prefect", startup_timeout_s=300)
        timed: dict[str, dict[int, object]] = {k: {} for k in (
            "base_parts", "cand_parts", "base_steps_s", "server_cpu_s", "mlflow")}

        def baseline(i: int) -> float:
            job = runs / f"torchrun-{i}"
            spec = write_spec(job, dataset.local_path, **({"epochs": 1} if args.quick else {}))
            launched = time.time()
            wall = run_timed(torchrun(world, "-m", "stoker.runtime", str(spec)),
                             runs / f"torchrun-{i}.log", TIMEOUT_S)
            useful = float(json.loads((job / "result.json").read_text())["train_time_s"])
            timed["base_parts"][i] = parts(job, launched, launched + wall, useful)
            timed["base_steps_s"][i] = useful
            return wall

        def candidate(i: int) -> float:
            work_dir = runs / f"pipeline-{i}"
            work_dir.mkdir()
            os.symlink(Path(dataset.local_path).parent, work_dir / "datasets")
            server_before = server_cpu_s(server)
            wall, job, cost = stoker_run(work_dir, overrides, runs / f"pipeline-{i}.log",
                                         stores / "prefect", tracking_uri)
            timed["server_cpu_s"][i] = server_cpu_s(server) - server_before
            (attempt,) = AttemptLog(job).history()
            timed["cand_parts"][i] = parts(job, attempt["started"],
                                           attempt["started"] + attempt["duration_s"],
                                           cost["useful_train_s"])
            timed["mlflow"][i] = cost
            return wall

        log("the local Prefect server: started once, untimed (the runs reuse it)")
        server.ensure()
        try:
            pairs = alternate(baseline, candidate, args.repeats, args.warmups,
                              decided=lambda so_far: decided(so_far, timed["server_cpu_s"]))
        finally:
            server.stop()
        pairs = with_server_cpu(pairs, timed["server_cpu_s"])
        bare_steps = [timed["base_steps_s"][i] for i in range(len(pairs.baseline))]
        first = first_run(work, args, statistics.median(bare_steps))

    result = compared(pairs, lambda b, c: c / b, WALL_TARGET, "bare torchrun (wall)",
                      "stoker run, warm (wall)", "s")
    cpu = check("CPU: stoker run (process tree + Prefect server) / bare torchrun, per pair",
                result["cpu_ratio"]["values"], "ratio", CPU_TARGET)
    goodput = check("end-to-end goodput of the warm run: bare step time / stoker run wall",
                    [s / c for s, c in zip(bare_steps, pairs.values("candidate"), strict=True)],
                    "ratio", GOODPUT_TARGET)
    emit("goodput", metric="stoker run wall / bare torchrun wall", quick=args.quick,
         checks=[cpu, goodput], **result,
         **explain(timed, world, dataset.nfiles, args, first, statistics.median(
             s / w for s, w in zip(bare_steps, pairs.values("baseline"), strict=True))))


def decided(pairs: Pairs, server_cpu: dict[int, float]) -> bool:
    """For ``alternate(decided=...)``: whether the wall ratio's and the CPU check's intervals
    both decide their targets (the goodput check is far from its own). Until they do, more
    pairs run (up to 3 x ``--repeats``)."""
    if len(pairs.baseline) < 2:
        return False
    pairs = with_server_cpu(pairs, server_cpu)
    return all(
        target.verdict(median_interval(per_pair(
            pairs.values("baseline", field), pairs.values("candidate", field),
            lambda b, c: c / b))) != UNDECIDED
        for field, target in (("value", WALL_TARGET), ("cpu_s", CPU_TARGET)))


def with_server_cpu(pairs: Pairs, server_cpu: dict[int, float]) -> Pairs:
    """``pairs`` with each candidate run's CPU time raised by what the Prefect server used."""
    candidate = tuple(replace(run, cpu_s=run.cpu_s + server_cpu[i])
                      for i, run in enumerate(pairs.candidate))
    return Pairs(pairs.baseline, candidate, pairs.extra)


def explain(timed: dict[str, dict], world: int, nfiles: int, args, first: dict,
            bare_goodput: float) -> dict:
    """Notes and details: the attempt split into its parts, the MLflow figures, the first run."""
    counted = sorted(i for i in timed["cand_parts"] if i >= 0)
    medians = {side: {k: round(statistics.median(timed[key][i][k] for i in counted), 3)
                      for k in PARTS}
               for side, key in (("bare torchrun", "base_parts"),
                                 ("stoker attempt", "cand_parts"))}
    logged = {k: summary([timed["mlflow"][i][k] for i in counted], "ratio", k)
              for k in ("command_goodput", "goodput")}
    server = summary([timed["server_cpu_s"][i] for i in counted], "s", "Prefect server CPU")
    notes = [f"{'1 epoch' if args.quick else 'the default 12 epochs'} of {nfiles} images, "
             f"{world} processes; Stoker tracks to MLflow (every 10 steps, system metrics) and "
             "runs the flow process beside the ranks; its CPU includes the reused Prefect "
             f"server's, {server['median']:.2f} s per run (median)"]
    for name, m in medians.items():
        total = sum(m.values())
        notes.append(f"{name} (median s): start-up {m['start_up_s']:.2f}, steps "
                     f"{m['steps_s']:.2f}, evaluation and checkpoints "
                     f"{m['eval_and_checkpoints_s']:.2f}, end {m['end_s']:.2f} "
                     f"(of {total:.1f} s)")
    notes.append("as logged to MLflow and read back (informative): command_goodput "
                 f"{logged['command_goodput']['median']:.2f} (the run's own step time over the "
                 f"command's wall), goodput {logged['goodput']['median']:.2f} (over the billed "
                 "attempt only)")
    notes.append(f"bare torchrun's own goodput (its step time over its wall) is "
                 f"{bare_goodput:.2f}: any launcher that starts fresh torchrun processes for "
                 "this short job pays their imports and rendezvous first")
    notes.append(f"first run on a fresh machine state (once): {first['wall_s']:.1f} s, "
                 f"end-to-end goodput {first['goodput_at_bare_speed']:.2f} (command_goodput "
                 f"logged {first['mlflow']['command_goodput']:.2f}); make install not included")
    return {"notes": notes, "details": {"parts_median_s": medians, "mlflow_logged": logged,
                                        "prefect_server_cpu_s": server, "first_run": first,
                                        "parts_per_run": {
                                            "baseline": [timed["base_parts"][i] for i in counted],
                                            "candidate": [timed["cand_parts"][i]
                                                          for i in counted]}}}


if __name__ == "__main__":
    main()
