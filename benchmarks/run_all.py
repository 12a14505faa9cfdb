"""Run every benchmark (``benchmarks/bench_*.py``) one after another and write a results table.

Each script runs in its own process; its last output line is its JSON result. The table, the
machine description (CPU, cores, memory, GPUs, versions, date, load) and every script's notes
go to ``benchmarks/RESULTS.md`` (``benchmarks/out/RESULTS-quick.md`` with ``--quick``, so a
smoke run never overwrites the published figures); all results also go to a JSON file beside
it, and each script's output to ``benchmarks/out/logs/``. A measure whose script is absent is
listed as "not present"; a script without ``--quick`` is skipped in a quick run.

A results file of ``benchmarks/gpu_check.sh`` saved as ``benchmarks/GPU_CHECK.json`` is added as a
section. The published table is written only from a clean checkout: with uncommitted changes (``git
status --porcelain``) a full run stops before it starts, unless ``--allow-dirty``, which marks
the table. A quick run's table is marked the same way.

    python benchmarks/run_all.py                 # full size: about an hour on 2 CPU cores
    python benchmarks/run_all.py --quick         # smoke run: every script once, tiny
    python benchmarks/run_all.py --only bench_checkpoint,bench_dataset
    python benchmarks/run_all.py --only bench_cost_guard --merge   # update one row in place

``--merge`` (with ``--only``) keeps every other measure's result from the existing JSON file
beside the table; the machine table then names the commit and date of each part, and, where
the parts differ, each part's CPU, packages, load and the other machine rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import DATA_DIR_ENV, PYTHON, checkout, env  # noqa: E402
from benchmarks.report import render  # noqa: E402

HERE = ROOT / "benchmarks"

# The measures of the benchmark issue, in its order: (script stem, title, target as stated).
MEASURES = (
    ("bench_pipeline_overhead", "Pipeline overhead: whole flow vs bare torchrun",
     "ratio <= 1.05"),
    ("bench_goodput", "Default job, command to exit: stoker run vs bare torchrun",
     "wall <= 1.3; CPU <= 1.2; end-to-end goodput >= 0.6"),
    ("bench_first_run", "First run: git clone -> make run exits (empty uv cache, new state)",
     "<= 240 s"),
    ("bench_trainer_throughput", "Trainer throughput vs a hand-written DDP loop",
     "ratio >= 0.98"),
    ("bench_checkpoint", "Checkpoint: training thread held per save vs synchronous torch.save",
     "ratio <= 0.2 (CPU), <= 0.05 (GPU)"),
    ("bench_checkpoint_e2e", "Checkpoint end to end: step time with the default saves every 50 "
     "steps vs without; time to durable", "ratio <= 1.05 (CPU, 150 MB state)"),
    ("bench_recovery", "Preemption recovery: SIGTERM -> first resumed step",
     "median <= 5 s, 0 steps lost"),
    ("bench_image_decision", "Image: unchanged-image decision vs cached docker build",
     "median <= 1 s, no build"),
    ("bench_dataset", "Dataset: cold pull vs raw dvc pull; warm pull",
     "ratio >= 0.9; warm <= 0.5 s"),
    ("bench_loader", "Loader: streaming image_folder vs a plain DataLoader; RSS 20k/200k files",
     "ratio >= 0.95; 200k RSS <= 1.1 x 20k"),
    ("bench_train_memory", "Training memory per rank: 20k vs 200k listed files",
     "200k peak <= 1.1 x 20k + the extra file list"),
    ("bench_tracking", "Tracking: its share of rank 0's CPU per step (step time: informative)",
     "share <= 1 % (0.01)"),
    ("bench_gpu_resnet", "GPU: ResNet-50 images/s (bf16, channels-last), scaling",
     "none set (reported)"),
    ("bench_cancel", "Prefect cancel on a process worker: -> ranks stopped; -> Cancelled",
     "median <= 2 s; <= 5 s"),
    ("bench_cost_guard", "Cost guard: one sweep's own overhead, in process and from the CLI",
     "<= 3 s each"),
    ("bench_end_of_run", "End of stoker run: last training step -> process exit, by part",
     "median <= 5 s"),
    ("bench_server_start", "Local Prefect server for a new work folder: reused vs its own new",
     "ratio <= 0.25"),
)


def scripts(only: set[str] | None) -> list[tuple[str, str, str, Path | None]]:
    """(stem, title, target, path or None when absent) for the known measures, then any other
    ``bench_*.py`` present."""
    known = {stem for stem, _, _ in MEASURES}
    rows = [(stem, title, target, HERE / f"{stem}.py" if (HERE / f"{stem}.py").is_file()
             else None) for stem, title, target in MEASURES]
    rows += [(p.stem, p.stem, "see script", p) for p in sorted(HERE.glob("bench_*.py"))
             if p.stem not in known]
    return [r for r in rows if only is None or r[0] in only]


def supports(path: Path, option: str) -> bool:
    """Whether a script takes ``option``: the common parser's, or its own literal."""
    text = path.read_text()
    return ("benchmarks.common import" in text and "options(" in text) or f'"{option}"' in text


def parse_result(stdout: str) -> dict | None:
    """The last JSON object line with a ``benchmark`` key, or None."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if isinstance(result, dict) and "benchmark" in result:
                return result
    return None


def unstructured(stdout: str) -> dict:
    """A result for a script that prints text only: its last ``ratio ...: <number>`` line."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    ratio = None
    for line in reversed(lines):
        found = re.search(r"ratio[^:]*:\s*([-+0-9.eE]+)", line)
        if found:
            ratio = float(found.group(1))
            break
    return {"status": "ok" if ratio is not None else "no result", "ratio": ratio,
            "verdict": None, "target_met": None, "baseline": None, "candidate": None,
            "checks": [],
            "notes": ["no JSON result line; its last lines: " + " / ".join(lines[-3:])]}


def run_one(stem: str, path: Path, args: argparse.Namespace, logs: Path,
            data_dir: str) -> dict:
    cmd = [PYTHON, str(path)]
    if args.quick:
        if not supports(path, "--quick"):
            return {"status": "skipped", "reason": "the script has no --quick option (it "
                    "would run at full size)"}
        cmd.append("--quick")
    notes = []
    if args.repeats is not None:
        if supports(path, "--repeats"):
            cmd += ["--repeats", str(args.repeats)]
        else:
            notes.append("run with its own number of repetitions (it has no --repeats option)")
    log_path = logs / f"{stem}.log"
    print(f"== {stem}: {' '.join(cmd[1:])} (progress: {log_path})", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:  # progress (stderr) lands here as it happens
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                                  check=False, env=env({DATA_DIR_ENV: data_dir}),
                                  timeout=args.timeout_s)
            stdout, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            code = None
        log.write(f"--- stdout ---\n{stdout}")
    wall_s = time.perf_counter() - started
    result = parse_result(stdout) if code == 0 else None
    if code != 0:
        reason = "timed out" if code is None else f"exit {code}"
        result = {"status": "failed", "reason": f"{reason}; see {log_path}"}
    elif result is None:
        result = unstructured(stdout)
    result["notes"] = notes + (result.get("notes") or [])
    result["wall_s"] = round(wall_s, 1)
    print(f"   {result.get('status')} in {wall_s:.0f} s: per-pair ratio {result.get('ratio')}, "
          f"verdict {result.get('verdict')}", flush=True)
    return result


# The machine table's rows that a merge keeps per measure (besides the commit and the date): a
# row run again on another machine must not take the others' CPU, packages or load with it.
MACHINE_FIELDS = ("CPU", "cores", "memory", "GPUs", "OS", "Python", "packages",
                  "load average (1 min) at start", "load average (1 min) at end")


def measured_at(previous: dict) -> dict[str, dict[str, str]]:
    """stem -> {"commit", "date", and each of ``MACHINE_FIELDS``} of each result in an earlier
    results file: its ``measured`` map, or (a file written before there was one) the machine
    table's commit and date. A field the file did not keep per measure is taken from its
    machine table."""
    before = previous.get("machine", {})
    if isinstance(previous.get("measured"), dict):
        found = {stem: dict(at) for stem, at in previous["measured"].items()
                 if isinstance(at, dict)}
    else:
        found = {stem: {"commit": before.get("Stoker commit", "unknown"),
                        "date": before.get("date", "?")} for stem in previous.get("results", {})}
    for at in found.values():
        for field in MACHINE_FIELDS:
            if field not in at and field in before:
                at[field] = before[field]
    return found


def per_part(values: dict[str, str]) -> str:
    """One machine-table cell for measures that may differ: the value when every measure
    shares it, else ``value for a, b; other for the other N`` (the largest group last)."""
    groups: dict[str, list[str]] = {}
    for stem, value in values.items():
        groups.setdefault(value, []).append(stem)
    if len(groups) == 1:
        return next(iter(groups))
    ordered = sorted(groups, key=lambda v: len(groups[v]))
    parts = [f"{v} for {', '.join(sorted(groups[v]))}" for v in ordered[:-1]]
    return "; ".join([*parts, f"{ordered[-1]} for the other {len(groups[ordered[-1]])}"])


def rows_wall_s(rows: list[tuple[str, str, str, dict]]) -> float:
    """Seconds the measures of ``rows`` took, each as its own run timed it (``wall_s``): what
    a merged table cost. (Adding the earlier file's total counted every merge before it again:
    a table of one hour's measures said 361 minutes.)"""
    return sum(result.get("wall_s") or 0.0 for *_, result in rows)


def merged(rows: list[tuple[str, str, str, dict]], previous: dict, info: dict[str, str]
           ) -> tuple[list[tuple[str, str, str, dict]], dict[str, str], dict[str, dict]]:
    """The rows of this run with every other known measure's result taken from ``previous``
    (an earlier run's JSON file), in the order of ``scripts``; the machine table with the commit
    and date of each part (this run's first; the largest other part is "the other N" and "the
    rest"); and the ``measured`` map (stem -> commit and date) for the new file, so that a later
    merge names every part again.

    Raises:
        ValueError: ``previous`` holds no results.
    """
    if not previous.get("results"):
        raise ValueError("--merge: the existing results file holds no results")
    new = {row[0]: row for row in rows}
    out = [new.get(stem) or (stem, title, target, previous["results"][stem])
           for stem, title, target, _ in scripts(None)
           if stem in new or stem in previous["results"]]
    measured = measured_at(previous)
    measured.update({stem: at_this_run(info) for stem in new})
    measured = {row[0]: measured[row[0]] for row in out}
    parts: dict[tuple[str, str], list[str]] = {}
    for stem, at in measured.items():
        parts.setdefault((at["commit"], at["date"]), []).append(stem)
    this = (info["Stoker commit"], info["date"])
    others = sorted((key for key in parts if key != this), key=lambda k: -len(parts[k]))
    rest = others[0] if others else None  # the largest other part: named by count only
    others = others[1:]
    commits = [f"{this[0]} for {', '.join(sorted(parts[this]))}"]
    dates = [f"{this[1]} ({', '.join(sorted(parts[this]))})"]
    for key in others:
        commits.append(f"{key[0]} for {', '.join(sorted(parts[key]))}")
        dates.append(f"{key[1]} ({', '.join(sorted(parts[key]))})")
    if rest is not None:
        commits.append(f"{rest[0]} for the other {len(parts[rest])}")
        dates.append(f"{rest[1]} (the rest)")
    info = dict(info)
    info["Stoker commit"] = "; ".join(commits) + " (merged with --merge)"
    info["date"] = "; ".join(dates)
    for field in MACHINE_FIELDS:
        values = {stem: at[field] for stem, at in measured.items() if field in at}
        if values:
            info[field] = per_part(values)
    return out, info, measured


def at_this_run(info: dict[str, str]) -> dict[str, str]:
    """The ``measured`` entry of a measure run now: the commit, the date and the machine."""
    return {"commit": info["Stoker commit"], "date": info["date"],
            **{field: info[field] for field in MACHINE_FIELDS if field in info}}


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)
        cpu = names[0] if names else cpu
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if torch.cuda.is_available():
        gpus = ", ".join(
            f"{torch.cuda.get_device_name(i)} "
            f"({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count()))
        gpus += f"; CUDA {torch.version.cuda}"
    else:
        gpus = "none (torch.cuda.is_available() is False)"
    versions = ", ".join(f"{name} {_version(name)}" for name in
                         ("torch", "prefect", "mlflow", "dvc", "torchvision"))
    state = checkout()
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "CPU": cpu,
        "cores": f"{psutil.cpu_count(logical=False)} physical, {os.cpu_count()} logical"
                 + (f", {usable} usable by this process" if usable else ""),
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "GPUs": gpus,
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "packages": versions,
        "Stoker commit": (state["commit"] or "unknown")
                         + (" (**uncommitted changes**)" if state["dirty"] else ""),
        "load average (1 min) at start": f"{os.getloadavg()[0]:.2f}",
    }


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every script once at a tiny size")
    p.add_argument("--repeats", type=int, default=None,
                   help="pass --repeats N to every script (default: each script's own)")
    p.add_argument("--only", default=None, help="comma-separated script names to run")
    p.add_argument("--output", type=Path, default=None,
                   help="results table (default benchmarks/RESULTS.md; "
                        "benchmarks/out/RESULTS-quick.md with --quick)")
    p.add_argument("--logs", type=Path, default=HERE / "out" / "logs",
                   help="folder for each script's output")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="per script (default 3600; 600 with --quick)")
    p.add_argument("--gpu-results", type=Path, default=HERE / "GPU_CHECK.json",
                   help="results file of benchmarks/gpu_check.sh to add as a section, if it "
                        "exists (default benchmarks/GPU_CHECK.json)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="write the published table even with uncommitted changes (marked)")
    p.add_argument("--merge", action="store_true",
                   help="with --only: keep the other measures' results from the existing "
                        "results file and update only these rows")
    args = p.parse_args()
    if args.merge and not args.only:
        p.error("--merge needs --only (the measures to run again)")
    args.timeout_s = args.timeout_s or (600 if args.quick else 3600)
    output = args.output or (HERE / "out" / "RESULTS-quick.md" if args.quick
                             else HERE / "RESULTS.md")
    only = set(args.only.split(",")) if args.only else None
    args.logs.mkdir(parents=True, exist_ok=True)
    output.parent.mkdir(parents=True, exist_ok=True)

    previous = None
    if args.merge:
        try:
            previous = json.loads(output.with_suffix(".json").read_text())
        except (OSError, ValueError) as e:
            p.error(f"--merge: cannot read {output.with_suffix('.json')}: {e}")
        if not previous.get("results"):
            p.error(f"--merge: {output.with_suffix('.json')} holds no results")
        if bool(previous.get("quick")) != args.quick:
            p.error(f"--merge: {output.with_suffix('.json')} is from a "
                    f"{'quick' if previous.get('quick') else 'full'} run; this one is not")
    info = machine()
    state = checkout()
    if state["dirty"] and not (args.quick or args.allow_dirty):
        print("the checkout has uncommitted changes; commit them (benchmarks run at a "
              "commit) or pass --allow-dirty to write a marked table:\n  "
              + "\n  ".join(state["changes"]), file=sys.stderr)
        sys.exit(2)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="stoker-bench-data-") as tmp:
        data_dir = os.environ.get(DATA_DIR_ENV) or tmp
        for stem, title, target, path in scripts(only):
            result = (run_one(stem, path, args, args.logs, data_dir) if path is not None
                      else {"status": "not present",
                            "reason": f"benchmarks/{stem}.py is not in this checkout"})
            rows.append((stem, title, target, result))
    wall_s = time.perf_counter() - started
    info["load average (1 min) at end"] = f"{os.getloadavg()[0]:.2f}"
    measured = {stem: at_this_run(info) for stem, _, _, _ in rows}
    if previous is not None:
        rows, info, measured = merged(rows, previous, info)
        wall_s = rows_wall_s(rows)
    gpu = json.loads(args.gpu_results.read_text()) if args.gpu_results.is_file() else None
    output.write_text(render(rows, info, args.quick, wall_s, gpu) + "\n")
    results = {"machine": info, "checkout": state, "quick": args.quick,
               "wall_s": round(wall_s, 1),
               "results": {stem: result for stem, _, _, result in rows}, "measured": measured}
    output.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {output} and {output.with_suffix('.json')} ({wall_s:.0f} s)")


if __name__ == "__main__":
    main()
