"""Fresh clone to trained demo: ``git clone`` of this checkout's HEAD, then ``make run`` as the
README says, timed from the clone to ``make run``'s exit.

Each run is a new user's first: a clone of the committed HEAD in a new folder, **an empty uv
cache** (``UV_CACHE_DIR`` new: every locked package is downloaded from the package index),
pip's cache off, **a new state folder** (``XDG_STATE_HOME``: the machine's Prefect server has its
database prepared and starts), the embedded demo data made and pulled, a new MLflow store.
Parts: the clone, ``make install`` (the virtual environment, the CPU build of torch from what
pip is configured with, then the locked set with uv), and ``make run`` after it (``stoker run``
on the defaults, to its exit). The model it registered is read back from the clone's MLflow store.

Check: clone to trained demo <= 240 s, every run (its worst). No baseline: the figure is what a
new user waits for. Downloads depend on the network to the package index: the notes give the
install's share. ``--quick``: no clone or install (this checkout, its ``.venv``), one epoch: a
smoke run of the script only.

    python benchmarks/bench_first_run.py [--quick] [--repeats N]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    TELEMETRY_OFF,
    Target,
    Workdir,
    check,
    emit,
    log,
    options,
    run_timed,
)

TARGET = Target("<=", 240.0)
TIMEOUT_S = 1800
MODEL = "stoker-digits"  # what the default job registers
# A new user's shell has none of these: this process's would point the clone elsewhere.
NOT_INHERITED = ("PREFECT_HOME", "PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PYTHONPATH",
                 "VIRTUAL_ENV", "XDG_STATE_HOME", "UV_CACHE_DIR")


def registered_versions(tracking_uri: str) -> int:
    """How many versions of the demo's registered model the store at ``tracking_uri`` holds."""
    from mlflow import MlflowClient

    return len(MlflowClient(tracking_uri).search_model_versions(f"name = '{MODEL}'"))


def first_run(work: Path, i: int, quick: bool) -> dict[str, float]:
    """One new user's first ``make run`` (see the module docstring); seconds per part."""
    base = work / f"user-{i}"
    clone = base / "stoker"
    base.mkdir()
    env = {"XDG_STATE_HOME": str(base / "state"), "UV_CACHE_DIR": str(base / "uv-cache"),
           "PIP_NO_CACHE_DIR": "1"}
    started = time.perf_counter()
    if quick:  # this checkout and its environment: no clone, no install
        clone, make = ROOT, ["make", "-o", ".venv/.installed", "run",
                             f"ARGS=train.epochs=1 --work-dir={base / 'work'}"]
        parts = {"clone_s": 0.0, "install_s": 0.0}
    else:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
        parts = {"clone_s": time.perf_counter() - started}
        parts["install_s"] = run_timed(["make", "install"], base / "install.log", TIMEOUT_S,
                                      env, clone, NOT_INHERITED)
        make = ["make", "run"]
    parts["run_s"] = run_timed(make, base / "run.log", TIMEOUT_S, env, clone, NOT_INHERITED)
    parts["total_s"] = time.perf_counter() - started
    work_dir = base / "work" if quick else clone / "work"
    versions = registered_versions(f"sqlite:///{work_dir / 'mlflow.db'}")
    if versions != 1:
        raise RuntimeError(f"{work_dir}: {versions} registered version(s) of {MODEL}, not 1")
    stop_server(env, clone)
    if not quick:
        shutil.rmtree(base / "uv-cache", ignore_errors=True)
    return {k: round(v, 2) for k, v in parts.items()}


def stop_server(env: dict[str, str], clone: Path) -> None:
    """End the user's machine Prefect server (it outlives ``make run``, as for a user)."""
    python = clone / ".venv" / "bin" / "python" if (clone / ".venv").is_dir() else sys.executable
    keep = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    subprocess.run([str(python), "-m", "stoker.cli", "server", "stop"], cwd=clone, check=False,
                   timeout=120, env=keep | TELEMETRY_OFF | env, capture_output=True)


def main() -> None:
    args = options(__doc__, 1)
    with Workdir(args.workdir, "bench-first-run") as work:
        runs = []
        for i in range(args.repeats):
            log(f"first run {i + 1}/{args.repeats}: clone, make install, make run")
            runs.append(first_run(work, i, args.quick))
            log(f"run {i + 1}: {runs[-1]}")
    medians = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    emit("first_run", metric="seconds from git clone to the exit of the first make run",
         quick=args.quick, target=f"clone to trained demo {TARGET} s (every run)",
         # A quick run installs nothing: its figure decides nothing (no interval, undecided).
         checks=[check("clone to trained demo", [r["total_s"] for r in runs], "s", TARGET,
                       statistic="median" if args.quick else "max")],
         notes=["parts (median s): " + ", ".join(f"{k.removesuffix('_s')} {v}"
                                                 for k, v in medians.items()),
                "an empty uv cache: every locked package downloaded from the package index; "
                "the CPU torch wheel comes from pip's configured source"
                + (" (quick: no clone or install)" if args.quick else "")],
         details={"runs": runs, "parts_median_s": medians})


if __name__ == "__main__":
    main()
