"""Stoker training jobs for the benchmarks: the demo dataset, run specs, steady-state timing."""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import PYTHON, Sized, run_timed, torchrun
from stoker.config import TrainConfig
from stoker.data.demo import DEMO_PATH, DEMO_TAG, ensure_demo_repo
from stoker.data.git import git
from stoker.data.pull import DatasetRef, pull_dataset
from stoker.runtime.progress import read_events
from stoker.runtime.spec import RunSpec

EPOCHS = Sized("--epochs", int, 15, 2, "epochs per run (15: about 10 s of training on 2 CPU cores)")
RUNTIME_TIMEOUT_S = 1800


def run_runtime(spec: Path, nproc: int, log_path: Path,
                timeout_s: float = RUNTIME_TIMEOUT_S) -> float:
    """``torchrun -m stoker.runtime SPEC`` with ``nproc`` ranks to its end; returns wall seconds.

    Raises:
        RuntimeError: it exited non-zero (the message names ``log_path``).
    """
    return run_timed(torchrun(nproc, "-m", "stoker.runtime", str(spec)), log_path, timeout_s)


def stoker_run(work_dir: Path, overrides: list[str], log_path: Path, prefect_home: Path,
               timeout_s: float = RUNTIME_TIMEOUT_S) -> tuple[float, Path]:
    """``stoker run --work-dir WORK_DIR OVERRIDES`` from ``work_dir`` to its exit, with the local
    Prefect server of ``prefect_home``; returns (wall seconds, the job folder it made).

    Raises:
        RuntimeError: it exited non-zero (the message names ``log_path``).
    """
    wall = run_timed([PYTHON, "-m", "stoker.cli", "run", f"--work-dir={work_dir}", *overrides],
                     log_path, timeout_s, extra_env={"PREFECT_HOME": str(prefect_home)},
                     cwd=work_dir)
    (job,) = (work_dir / "jobs").iterdir()
    return wall, job


def demo_dataset(base: Path, quick: bool = False) -> DatasetRef:
    """The demo digits repository under ``base/demo-data``, pulled into ``base/datasets``.

    With ``quick``, a tiny repository of the same shape instead (``tiny_image_repo``), which
    takes a second to make rather than many: for smoke runs only.
    """
    repo = tiny_image_repo(base / "tiny-data") if quick else \
        ensure_demo_repo(base / "demo-data").repo
    return pull_dataset(str(repo), DEMO_TAG, DEMO_PATH, base / "datasets")


def tiny_image_repo(base: Path, per_class: int = 32, classes: int = 10) -> Path:
    """A git + DVC repository shaped like the demo one: ``data/digits/<class>/<i>.png``
    (random 8x8 grayscale images), tagged ``v1``, pushed to the local DVC remote
    ``base/remote``. Made once; returns ``base/repo``."""
    import numpy as np
    from dvc.repo import Repo
    from PIL import Image

    repo = base / "repo"
    if (repo / f"{DEMO_PATH}.dvc").is_file():
        return repo
    shutil.rmtree(repo, ignore_errors=True)  # a leftover of an interrupted attempt
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    rng = np.random.default_rng(0)
    with Repo.init(str(repo)) as dvc:
        with dvc.config.edit() as conf:
            conf["remote"]["local"] = {"url": str(base / "remote")}
            conf["core"]["remote"] = "local"
        for i in range(per_class * classes):
            path = repo / DEMO_PATH / str(i % classes) / f"{i:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode="L").save(path)
        dvc.add(str(repo / DEMO_PATH))
        dvc.push()
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "tiny image dataset")
    git(repo, "tag", DEMO_TAG)
    return repo


def steps_per_epoch(dataset: DatasetRef, global_batch_size: int,
                    val_fraction: float = 0.2) -> int:
    """Optimizer steps per epoch on ``dataset`` as the runtime computes them."""
    return (dataset.nfiles - round(dataset.nfiles * val_fraction)) // global_batch_size


def write_spec(job_dir: Path, data_dir: str, tracking_uri: str | None = None,
               artifact_location: str | None = None, **train) -> Path:
    """Write ``job_dir/spec.yaml`` for a job on ``data_dir`` with ``TrainConfig(**train)``."""
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(train=TrainConfig(**train), data_dir=data_dir, job_dir=str(job_dir),
                   tracking_uri=tracking_uri, artifact_location=artifact_location,
                   run_name=job_dir.name)
    spec.dump(job_dir / "spec.yaml")
    return job_dir / "spec.yaml"


@dataclass(frozen=True)
class Window:
    """Rank 0's timing of the steps after ``first_step`` of one attempt.

    Attributes:
        steps: optimizer steps in the window.
        train_s: wall seconds of those steps, checkpoints included, evaluation excluded.
        eval_s: wall seconds of the evaluations inside the window.
        intervals_s: seconds between consecutive step events (evaluations excluded).
    """

    steps: int
    train_s: float
    eval_s: float
    intervals_s: tuple[float, ...]

    def samples_per_s(self, global_batch_size: int) -> float:
        return self.steps * global_batch_size / self.train_s

    @property
    def mean_step_s(self) -> float:
        return self.train_s / self.steps

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.intervals_s)


def steady_window(job_dir: Path, first_step: int) -> Window:
    """Time the steps after ``first_step`` from the job's progress events (Unix time, ms).

    The window runs from the ``step`` event of ``first_step`` to the last ``step`` event. Each
    evaluation runs between a step's event and its ``eval`` event; that stretch is taken out
    (the baselines do not evaluate). Checkpoint saves stay in: they are part of Stoker's cost.

    Raises:
        RuntimeError: the job has no step events beyond ``first_step``.
    """
    events = read_events(job_dir)
    steps = {e["step"]: e["time"] for e in events if e["event"] == "step"}
    evals = {e["step"]: e["time"] for e in events if e["event"] == "eval"}
    last = max(steps, default=0)
    if first_step not in steps or last <= first_step:
        raise RuntimeError(f"{job_dir}: no step events after step {first_step} "
                           f"(last step {last})")
    intervals, eval_s = [], 0.0
    for step in range(first_step + 1, last + 1):
        dt = steps[step] - steps[step - 1]
        if step - 1 in evals:
            spent = evals[step - 1] - steps[step - 1]
            eval_s += spent
            dt -= spent
        intervals.append(dt)
    return Window(len(intervals), sum(intervals), eval_s, tuple(intervals))
