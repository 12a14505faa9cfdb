"""Peak memory per rank of a real training on a large listed ImageFolder: 20,000 vs 200,000 files.

Each size runs ``torchrun -m stoker.runtime SPEC`` (2 gloo ranks, ``num_workers`` DataLoader
workers per rank, 16 px RGB crops, small_cnn, global batch 32, tracking off) for ``--steps``
optimizer steps; then SIGTERM (the preemption path: a stop checkpoint, exit 75) ends it. Every
file exists (hard links of 64 distinct 16x16 RGB PNGs, so 200,000 files cost seconds and no
disk), and the folder looks like a pulled, validated dataset (``<md5>/`` with its file list
``<md5>.files.json`` beside it, as the pull step writes it): the training lists nothing.

Memory: this process polls (psutil, every 0.1 s) each rank's process tree: the rank and its
DataLoader workers. Per rank it records the peak of the tree's summed RSS (which counts pages
shared by fork once per process: an upper bound) and of its summed PSS (shared pages split
between their holders: the fair sum). The figure is the larger rank's peak.
Target: peak PSS at 200k <= 1.1 x peak at 20k + the extra file list (180,000 more names and
labels, counted once per process of the tree).

    python benchmarks/bench_train_memory.py [--quick] [--steps N] [--files N] [--workers N]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    Sized,
    Target,
    Workdir,
    check,
    emit,
    env,
    log,
    options,
    torchrun,
)
from benchmarks.jobs import write_spec  # noqa: E402

NPROC, DISTINCT, SIDE = 2, 64, 16
CLASSES = ("apple", "bicycle", "cloud", "dolphin", "ember", "forest", "granite", "harbor",
           "iris", "jasmine")


def listed_folder(base: Path, files: int) -> tuple[Path, int]:
    """``base/<32 hex>/<class>/<i>.png``: ``files`` hard links of 64 PNGs, and the file list
    beside the folder. Made once. Returns (folder, bytes of one file-list entry)."""
    import numpy as np
    from PIL import Image

    root = base / f"{files:032x}"
    listing = base / f"{files:032x}.files.json"
    names = [[f"{c}-{i:07d}.png" for i in range(k, files, len(CLASSES))]
             for k, c in enumerate(CLASSES)]
    if not listing.is_file():
        rng = np.random.default_rng(0)
        sources = base / "sources"
        sources.mkdir(parents=True, exist_ok=True)
        for j in range(DISTINCT):
            Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(
                sources / f"{j}.png")
        for c, files_of in zip(CLASSES, names, strict=True):
            (root / c).mkdir(parents=True, exist_ok=True)
            for i, name in enumerate(files_of):
                target = root / c / name
                if not target.exists():
                    os.link(sources / f"{i % DISTINCT}.png", target)
        listing.write_text(json.dumps({
            "version": 1, "probed": True, "size": [SIDE, SIDE], "colour": True,
            "classes": [{"name": c, "files": n} for c, n in zip(CLASSES, names, strict=True)]}))
    entry = max(len(f"{c}/{n[0]}".encode()) for c, n in zip(CLASSES, names, strict=True)) + 8
    return root, entry


def _tree_memory(rank) -> tuple[int, int]:
    """(summed RSS, summed PSS) in bytes of ``rank`` and its descendants (gone ones skipped)."""
    import psutil

    rss = pss = 0
    try:
        tree = [rank, *rank.children(recursive=True)]
    except psutil.Error:  # the rank is gone (or a zombie): nothing of it to count
        return 0, 0
    for proc in tree:
        try:
            info = proc.memory_full_info()
        except psutil.Error:  # gone, a zombie, not ours
            continue
        rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
    return rss, pss


def _cmdline(proc) -> str:
    """``proc``'s command line, or "" once it is gone or a zombie (a rank that just exited)."""
    import psutil

    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _steps_done(job: Path) -> int:
    try:
        lines = (job / "progress.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if event.get("event") == "step":
            steps.append(int(event["step"]))
    return max(steps)


def peak_memory(root: Path, job: Path, steps: int, workers: int, timeout_s: float) -> dict:
    """Train on ``root`` for ``steps`` steps; the peak memory per rank tree (MB)."""
    import psutil

    spec = write_spec(job, str(root), epochs=1, global_batch_size=32, num_workers=workers,
                      image_size=SIDE, channels=3, checkpoint_every_steps=10_000,
                      nproc_per_node=NPROC)
    started = time.monotonic()
    with open(job / "torchrun.log", "w") as out:
        proc = subprocess.Popen(torchrun(NPROC, "-m", "stoker.runtime", str(spec)), env=env(),
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    peaks: dict[int, list[int]] = {}
    first_step_s = None
    try:
        top = psutil.Process(proc.pid)
        while proc.poll() is None and time.monotonic() - started < timeout_s:
            try:
                children = top.children()
            except psutil.Error:  # torchrun just exited
                children = []
            ranks = [p for p in children if "stoker.runtime" in _cmdline(p)]
            for rank in ranks:
                rss, pss = _tree_memory(rank)
                old = peaks.setdefault(rank.pid, [0, 0])
                peaks[rank.pid] = [max(old[0], rss), max(old[1], pss)]
            done = _steps_done(job)
            if done and first_step_s is None:
                first_step_s = time.monotonic() - started
            if done >= steps:
                # The preemption path ends it (the ranks save and exit 75; torchrun itself
                # exits 1 on a SIGTERM: its code says nothing then).
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.1)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if _steps_done(job) < min(steps, 1) or len(peaks) != NPROC or code not in (0, 1):
        raise RuntimeError(f"training on {root} exited {code} after {_steps_done(job)} step(s) "
                           f"with {len(peaks)} rank(s) seen; log {job / 'torchrun.log'}")
    return {"peak_rss_mb": max(p[0] for p in peaks.values()) / 2**20,
            "peak_pss_mb": max(p[1] for p in peaks.values()) / 2**20,
            "first_step_s": first_step_s, "steps": _steps_done(job)}


def main() -> None:
    args = options(__doc__, 1, Sized("--steps", int, 10, 3, "optimizer steps per training"),
                   Sized("--files", int, 20_000, 200, "files of the smaller folder (the larger "
                         "holds 10 times as many)"),
                   extra=lambda p: p.add_argument("--workers", type=int, default=2))
    sizes = (args.files, 10 * args.files)
    with Workdir(args.workdir, "bench-train-memory") as work:
        data = (args.data_dir or work) / "listed-images"
        figures, entry = {}, 0
        for files in sizes:
            log(f"folder of {files} listed files (hard links, made once)")
            root, entry = listed_folder(data, files)
            log(f"training {args.steps} steps on {files} files")
            figures[files] = peak_memory(root, work / f"job-{files}", args.steps, args.workers,
                                         timeout_s=900)
            log(f"{files} files: {figures[files]}")
    small, large = figures[sizes[0]], figures[sizes[1]]
    list_mb = (sizes[1] - sizes[0]) * entry * (1 + args.workers) / 2**20
    bound = 1.1 * small["peak_pss_mb"] + list_mb
    n, m = (f"{k // 1000}k" if k >= 1000 else str(k) for k in sizes)
    notes = [f"{NPROC} ranks x {args.workers} workers, {args.steps} steps, global batch 32, "
             f"{SIDE} px RGB, small_cnn; peak per rank tree (rank + its workers)",
             f"peak PSS {small['peak_pss_mb']:.0f} MB at {n} files, {large['peak_pss_mb']:.0f} "
             f"MB at {m} (bound 1.1 x {n} + {list_mb:.1f} MB of extra file list = "
             f"{bound:.0f} MB)",
             f"peak RSS (shared pages counted per process) {small['peak_rss_mb']:.0f} MB at "
             f"{n}, {large['peak_rss_mb']:.0f} MB at {m}",
             f"first step after {small['first_step_s']:.1f} s ({n}) and "
             f"{large['first_step_s']:.1f} s ({m}) from the torchrun start"]
    emit("train_memory", metric=f"peak PSS per rank at {m} files vs at {n} files",
         quick=args.quick, notes=notes,
         target=f"{m} <= 1.1 x {n} + {list_mb:.1f} MB",
         checks=[check(f"peak PSS per rank at {m} files", [large["peak_pss_mb"]], "MB",
                       Target("<=", round(bound, 1)), statistic="max")],
         details={"pss_ratio": large["peak_pss_mb"] / small["peak_pss_mb"],
                  **{str(k): v for k, v in figures.items()}})


if __name__ == "__main__":
    main()
