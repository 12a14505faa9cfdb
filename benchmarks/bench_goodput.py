"""Goodput of the default job: useful step time / billed attempt time, Stoker versus bare torchrun.

* Candidate: ``stoker run`` on the embedded defaults (the demo digits, ``train.*`` as shipped,
  12 epochs), as a user's second ``make run``: a fresh ``work_dir`` (a new job), the dataset
  already pulled, the local Prefect server and the MLflow store reused (started and migrated
  once, untimed). Its figure is the ``goodput`` metric the pipeline logged, **read back from the
  MLflow store**: time in committed training steps / the attempt's billed wall time (launch to
  exit, ``stoker/tracking/cost.py``).
* Baseline: ``torchrun --nproc-per-node N -m stoker.runtime SPEC`` with the same train config
  and dataset, no tracking: the runtime's own ``train_time_s`` (``result.json``) / torchrun's
  wall time from process start to exit. It is the floor any launcher built on torchrun pays
  for this job: Python, torch and its compiler stack imported in every process, rendezvous.

Ratio = Stoker's goodput / bare torchrun's goodput, per pair (informative). Check: Stoker's
goodput >= 0.6. The notes split the billed attempt into start-up (launch to the runtime's
``start`` event), steps, evaluation and checkpoints, and the end (``end`` event to exit).

    python benchmarks/bench_goodput.py [--quick] [--repeats N]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline_overhead import create_experiment, nproc  # noqa: E402
from benchmarks.common import (  # noqa: E402
    PYTHON,
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
from stoker.jobs.attempts import AttemptLog  # noqa: E402
from stoker.local_server import LocalServer  # noqa: E402
from stoker.runtime.progress import read_events  # noqa: E402

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
        RuntimeError: the run has no ``goodput`` metric.
    """
    from mlflow import MlflowClient

    run_id = (job_dir / "mlflow_run_id").read_text().strip()
    metrics = MlflowClient(tracking_uri).get_run(run_id).data.metrics
    if "goodput" not in metrics:
        raise RuntimeError(f"MLflow run {run_id} of {job_dir} has no goodput metric")
    return {k: metrics[k] for k in ("goodput", "billed_s", "useful_train_s") if k in metrics}


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
        timed: dict[str, list] = {"base_parts": [], "cand_parts": [], "cand_pipeline_s": []}

        def keep(i: int, key: str, value) -> None:
            if i >= 0:  # warm-up runs are not counted
                timed[key].append(value)

        def baseline(i: int) -> float:
            job = runs / f"torchrun-{i}"
            spec = write_spec(job, dataset.local_path, **({"epochs": 1} if args.quick else {}))
            launched = time.time()
            wall = run_timed(torchrun(world, "-m", "stoker.runtime", str(spec)),
                             runs / f"torchrun-{i}.log", TIMEOUT_S)
            useful = float(json.loads((job / "result.json").read_text())["train_time_s"])
            keep(i, "base_parts", parts(job, launched, launched + wall, useful))
            return useful / wall

        def candidate(i: int) -> float:
            work_dir = runs / f"pipeline-{i}"
            work_dir.mkdir()
            os.symlink(Path(dataset.local_path).parent, work_dir / "datasets")
            wall = run_timed([PYTHON, "-m", "stoker.cli", "run", f"--work-dir={work_dir}",
                              *overrides], runs / f"pipeline-{i}.log", TIMEOUT_S,
                             extra_env={"PREFECT_HOME": str(stores / "prefect")}, cwd=work_dir)
            (job,) = (work_dir / "jobs").iterdir()
            cost = mlflow_goodput(tracking_uri, job)
            (attempt,) = AttemptLog(job).history()
            keep(i, "cand_parts", parts(job, attempt["started"],
                                        attempt["started"] + attempt["duration_s"],
                                        cost["useful_train_s"]))
            keep(i, "cand_pipeline_s", wall)
            return cost["goodput"]

        server = LocalServer(stores / "prefect", startup_timeout_s=300)
        log("the local Prefect server: started once, untimed (the runs reuse it)")
        server.ensure()
        try:
            pairs = alternate(baseline, candidate, args.repeats, args.warmups)
        finally:
            server.stop()

    result = compared(pairs, lambda b, c: c / b, f"Stoker goodput {GOODPUT_TARGET}",
                      "bare torchrun (train_time_s / wall)", "stoker run (MLflow goodput)",
                      "ratio")
    goodput = check("goodput of the default job (MLflow metric)", pairs.values("candidate"),
                    "ratio", GOODPUT_TARGET)
    emit("goodput", metric="Stoker goodput / bare torchrun goodput", quick=args.quick,
         checks=[goodput], **result, **explain(timed, world, dataset.nfiles, args))


def explain(timed: dict[str, list], world: int, nfiles: int, args) -> dict:
    """Notes and details: the billed attempt split into its parts, both sides."""
    medians = {side: {k: round(statistics.median(p[k] for p in timed[key]), 3) for k in PARTS}
               for side, key in (("bare torchrun", "base_parts"),
                                 ("stoker attempt", "cand_parts"))}
    notes = [f"{'1 epoch' if args.quick else 'the default 12 epochs'} of {nfiles} images, "
             f"{world} processes; Stoker tracks to MLflow (every 10 steps, system metrics) and "
             "runs the flow process beside the ranks"]
    for side, m in medians.items():
        total = sum(m.values())
        notes.append(f"{side} (median s): start-up {m['start_up_s']:.2f}, steps "
                     f"{m['steps_s']:.2f}, evaluation and checkpoints "
                     f"{m['eval_and_checkpoints_s']:.2f}, end {m['end_s']:.2f} "
                     f"(steps = {m['steps_s'] / total:.0%} of {total:.1f} s)")
    base, cand = medians["bare torchrun"], medians["stoker attempt"]
    notes.append(f"the same steps took {cand['steps_s']:.1f} s inside the pipeline and "
                 f"{base['steps_s']:.1f} s bare (tracking, the flow process and the machine's "
                 "load share the cores): slower steps raise goodput, so read it beside the "
                 "pipeline-overhead benchmark's training time and the start-up seconds above")
    floor = base["steps_s"] / (base["steps_s"] + base["start_up_s"])
    notes.append(f"the start-up of bare torchrun alone ({base['start_up_s']:.1f} s: torchrun's "
                 "agent imports torch, then every rank imports torch and torch._dynamo, which "
                 "torch.optim and torch.use_deterministic_algorithms load) caps the goodput of "
                 f"this {base['steps_s']:.0f}-second training at {floor:.2f} for any launcher "
                 "that starts fresh torchrun processes")
    pipeline = summary(timed["cand_pipeline_s"], "s", "whole stoker run")
    notes.append(f"the whole stoker run takes {pipeline['median']:.1f} s "
                 f"[{pipeline['min']:.1f}–{pipeline['max']:.1f}]; its attempt is what is billed")
    return {"notes": notes, "details": {"parts_median_s": medians,
                                        "parts_per_run": {"baseline": timed["base_parts"],
                                                          "candidate": timed["cand_parts"]},
                                        "pipeline_wall_s": pipeline}}


if __name__ == "__main__":
    main()
