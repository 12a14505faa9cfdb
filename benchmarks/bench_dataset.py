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

With ``--quick`` (or ``--files N``) the repository holds N small random RGB PNGs (16x16 px) in
10 classes with word names (``apple/``, ``bicycle/``, ...) instead of the digits, the folder
added with one ``dvc add`` and pushed to a local remote (same layout, same tag); made once under
the data folder. ``--files 20000`` is the real-size cold pull; ``--quick`` (50 files) a smoke run.

Beside the pulls, the pull step's validation of the pulled folder is timed: the first (every
header read and structure-checked by a thread pool, no pixel decoded) and the warm one (the
verdict cached under the dataset's DVC hash: no file read).

    python benchmarks/bench_dataset.py [--quick] [--repeats N] [--files N]
    python benchmarks/bench_dataset.py --quick --files 20000   # real size, one pair
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
from stoker.data.demo import DEMO_PATH, DEMO_TAG, ensure_demo_repo  # noqa: E402
from stoker.data.git import git  # noqa: E402
from stoker.data.pull import pull_dataset  # noqa: E402
from stoker.data.validate import validate_image_folder  # noqa: E402

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


def validation_s(ref) -> dict[str, float]:
    """Seconds of the pull step's validation of ``ref``: first (no verdict yet), then warm."""
    root = Path(ref.local_path)
    times = {}
    for name in ("first", "warm"):
        started = time.perf_counter()
        validate_image_folder(root, ref.md5)
        times[name] = time.perf_counter() - started
    return times


def main() -> None:
    args = options(__doc__, 7, Sized("--files", int, 0, 50, "use a repository of N small "
                                     "random RGB files instead of the 1,797 digits (0: the "
                                     "digits)"))
    with Workdir(args.workdir, "bench-dataset") as work:
        log("making the data repository (once)")
        started = time.perf_counter()
        repo, expected = source_repo(args.data_dir or work, args.files)
        log(f"data repository ready in {time.perf_counter() - started:.1f} s")
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

        # the warm-up pair pays DVC's imports and the git and file caches
        cold = alternate(baseline, candidate, args.repeats, args.warmups)

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

        warm = alternate(warm_raw, warm_stoker, max(args.repeats, 3))
        log("validation: first, then warm")
        validated = validation_s(pull_dataset(str(repo), DEMO_TAG, DEMO_PATH, datasets))

    result = compared(cold, lambda b, c: b / c, TARGET, "cold: git clone + dvc pull",
                      "cold: Stoker pull_dataset", "s")
    warm_stoker_s = summary(warm.values("candidate"), "s", "warm: Stoker pull_dataset")
    warm_raw_s = summary(warm.values("baseline"), "s", "warm: dvc pull in an up-to-date clone")
    kind = "random 16x16 RGB PNGs, 10 word-named classes" if args.files else "the demo digits"
    notes = [f"data: {expected} files ({kind})",
             f"validation of the pulled folder: first {validated['first']:.2f} s (headers + "
             f"structure, no pixel decoded), warm {validated['warm']:.4f} s (verdict cached by "
             "the DVC hash)",
             f"warm pull {warm_stoker_s['median']:.3f} s (target <= 0.5 s); a no-op dvc pull "
             f"in an up-to-date raw clone takes {warm_raw_s['median']:.3f} s",
             "Stoker's cold pull copies the local remote's objects straight into a staging "
             "folder renamed into place (no checkout into the clone, no DVC index build; "
             "training never sees a partial dataset) and checks every file's md5 against the "
             ".dvc manifest in the same read, which the raw dvc pull does not"]
    emit("dataset", metric="raw git clone + dvc pull time / Stoker cold pull time",
         quick=args.quick, notes=notes, **result,
         checks=[check("warm pull", warm.values("candidate"), "s", WARM_TARGET)],
         details={"warm_stoker_s": warm_stoker_s, "warm_raw_dvc_pull_s": warm_raw_s,
                  "validation_s": validated, "files": expected})


WORDS = ("apple", "bicycle", "cloud", "dolphin", "ember", "forest", "granite", "harbor", "iris",
         "jasmine")


def source_repo(base: Path, files: int) -> tuple[Path, int]:
    """The repository to pull and its file count: ``files`` random RGB PNGs (rounded down to
    a multiple of 10), or the demo digits when ``files`` is 0."""
    if not files:
        return ensure_demo_repo(base / "demo-data").repo, 1797
    per_class = max(1, files // 10)
    return word_image_repo(base / f"rgb-data-{per_class * 10}", per_class), per_class * 10


def word_image_repo(base: Path, per_class: int) -> Path:
    """``base/repo``: ``data/digits/<word>/<i>.png`` (16x16 random RGB), added by one
    ``dvc add`` of the folder, pushed to the local remote ``base/remote``, tagged ``v1``.
    Made once (the ``.dvc`` file marks it done)."""
    import numpy as np
    from dvc.repo import Repo
    from PIL import Image

    repo = base / "repo"
    if (repo / f"{DEMO_PATH}.dvc").is_file():
        return repo
    shutil.rmtree(base, ignore_errors=True)  # a leftover of an interrupted attempt
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    rng = np.random.default_rng(0)
    for k, word in enumerate(WORDS):
        folder = repo / DEMO_PATH / word
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(
                folder / f"{word}-{k * per_class + i:06d}.png", compress_level=1)
    with Repo.init(str(repo)) as dvc:
        with dvc.config.edit() as conf:
            conf["remote"]["local"] = {"url": str(base / "remote")}
            conf["core"]["remote"] = "local"
        dvc.add(str(repo / DEMO_PATH))  # one entry for the folder, never one per file
        dvc.push(jobs=4)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "word-named RGB image dataset")
    git(repo, "tag", DEMO_TAG)
    return repo


if __name__ == "__main__":
    main()
