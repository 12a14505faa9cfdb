"""Dataset pulls: Stoker's cold pull versus raw git clone + dvc pull, and its warm pull.

Data: the demo digits repository (git + DVC, 1,797 PNG files, local DVC remote), pulled at tag
``v1``. Both sides run in this process with DVC already imported (a warm-up pull of each comes
first), so neither pays DVC's import time.

* Cold, baseline: ``git clone`` into a fresh folder, ``git checkout v1``, then
  ``dvc.repo.Repo.pull()`` (the default cache inside the clone). What a user types by hand.
* Cold, candidate: ``stoker.data.pull.pull_dataset`` into a fresh datasets folder (clone, resolve
  the revision, read the local DVC remote's objects straight into a staging folder, checking each
  md5 against the ``.dvc`` manifest in the same read, rename into place; a remote that is not a
  local folder is fetched into the DVC cache and hard-linked instead).
  Ratio = baseline time / Stoker time; target >= 1.5 (no checkout into the clone, no copy).
* Warm: ``pull_dataset`` again on the already-pulled hash (one ``git fetch`` of the clone, the
  ``.dvc`` file read, no DVC call). Target <= 0.5 s. For comparison the notes give a no-op
  ``dvc pull`` in an up-to-date raw clone.

With ``--quick`` (or ``--files N``) the repository holds N small random PNG files instead of the
digits (same layout, same tag), so that a smoke run takes seconds.

    python benchmarks/bench_dataset.py [--quick] [--repeats N] [--files N]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    Target,
    Workdir,
    alternate,
    check,
    emit,
    log,
    parser,
    ratio_range,
    repeats_of,
    stats,
)
from benchmarks.jobs import tiny_image_repo  # noqa: E402
from stoker.data.demo import DEMO_PATH, DEMO_TAG, ensure_demo_repo  # noqa: E402
from stoker.data.pull import pull_dataset  # noqa: E402

TARGET = Target(">=", 1.5)
WARM_TARGET = Target("<=", 0.5)


def raw_pull(repo: Path, dest: Path) -> Path:
    """git clone + checkout of the tag + dvc pull, as by hand; returns the clone."""
    from dvc.repo import Repo

    subprocess.run(["git", "clone", "-q", str(repo), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", DEMO_TAG], check=True)
    with Repo(str(dest)) as dvc:
        dvc.pull()
    return dest


def raw_warm_pull(clone: Path) -> None:
    from dvc.repo import Repo

    with Repo(str(clone)) as dvc:
        dvc.pull()


def count_files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file())


def main() -> None:
    p = parser(__doc__.splitlines()[0], repeats=5)
    p.add_argument("--files", type=int, default=None,
                   help="use a repository of N small files (default: the 1,797 digits; "
                        "50 with --quick)")
    args = p.parse_args()
    repeats = repeats_of(args)
    nfiles = args.files or (50 if args.quick else None)
    with Workdir(args.workdir, "bench-dataset") as work:
        if nfiles:
            per_class = max(1, nfiles // 10)
            repo = tiny_image_repo(work / f"small-data-{per_class}", per_class=per_class)
            nfiles = per_class * 10
        else:
            repo = ensure_demo_repo(work / "demo-data").repo
        expected = nfiles or 1797
        scratch = work / "scratch"

        def fresh(name: str) -> Path:
            path = scratch / name
            shutil.rmtree(path, ignore_errors=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            return path

        def baseline(i: int) -> float:
            dest = fresh(f"raw-{i}")
            started = time.perf_counter()
            raw_pull(repo, dest)
            elapsed = time.perf_counter() - started
            if count_files(dest / DEMO_PATH) != expected:
                raise RuntimeError(f"{dest / DEMO_PATH}: raw dvc pull is incomplete")
            shutil.rmtree(dest)
            return elapsed

        def candidate(i: int) -> float:
            dest = fresh(f"stoker-{i}")
            started = time.perf_counter()
            ref = pull_dataset(str(repo), DEMO_TAG, DEMO_PATH, dest)
            elapsed = time.perf_counter() - started
            if count_files(Path(ref.local_path)) != ref.nfiles:
                raise RuntimeError(f"{ref.local_path}: Stoker's pull is incomplete")
            shutil.rmtree(dest)
            return elapsed

        if not args.quick:
            log("warm-up: one pull of each (DVC imports, git and file caches)")
            baseline(-1), candidate(-1)
        base, cand = alternate(baseline, candidate, repeats)

        log("warm pulls")
        datasets = fresh("warm-stoker")
        pull_dataset(str(repo), DEMO_TAG, DEMO_PATH, datasets)
        raw_clone = raw_pull(repo, fresh("warm-raw"))

        def warm_raw(i: int) -> float:
            started = time.perf_counter()
            raw_warm_pull(raw_clone)
            return time.perf_counter() - started

        def warm_stoker(i: int) -> float:
            started = time.perf_counter()
            pull_dataset(str(repo), DEMO_TAG, DEMO_PATH, datasets)
            return time.perf_counter() - started

        warm_base, warm_cand = alternate(warm_raw, warm_stoker, max(repeats, 3))

    b = stats(base, "s", "cold: git clone + dvc pull")
    c = stats(cand, "s", "cold: Stoker pull_dataset")
    warm = stats(warm_cand, "s", "warm: Stoker pull_dataset (same hash)")
    warm_raw_s = stats(warm_base, "s", "warm: dvc pull in an up-to-date clone")
    ratio = b["median"] / c["median"]
    notes = [f"data: {expected} files ({'random 8x8 PNGs' if nfiles else 'the demo digits'})",
             f"warm pull {warm['median']:.3f} s (target <= 0.5 s); a no-op dvc pull in an "
             f"up-to-date raw clone takes {warm_raw_s['median']:.3f} s",
             "Stoker's cold pull copies the local remote's objects straight into a staging "
             "folder renamed into place (no checkout into the clone, no DVC index build; "
             "training never sees a partial dataset) and checks every file's md5 against the "
             ".dvc manifest in the same read, which the raw dvc pull does not"]
    emit("dataset", metric="raw git clone + dvc pull time / Stoker cold pull time", baseline=b,
         candidate=c, ratio=ratio, target=TARGET, quick=args.quick, notes=notes,
         checks=[check("warm pull", warm["median"], "s", WARM_TARGET,
                       spread=(warm["min"], warm["max"]))],
         spread=ratio_range(lambda x, y: x / y, b, c),
         details={"warm_stoker_s": warm, "warm_raw_dvc_pull_s": warm_raw_s})


if __name__ == "__main__":
    main()
