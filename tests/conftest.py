"""Shared fixtures: telemetry off, the demo dataset pulled once per session, run-spec helpers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DVC_NO_ANALYTICS"] = "1"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Without PREFECT_HOME, Stoker's commands use the one local Prefect server of the user, in the
# user's state folder ($XDG_STATE_HOME/stoker): a test never reaches the real one. Each worker
# gets a folder of its own; the servers started there are stopped at the end (_state_home).
STATE_HOME = Path(tempfile.mkdtemp(prefix="stoker-tests-state-"))
os.environ["XDG_STATE_HOME"] = str(STATE_HOME)

# Prefect sets up its logging (a console handler on the sys.stderr of that moment) when
# prefect.main is first imported. First imported inside a test with capsys, the handler wrote to
# that test's stream once it was closed, and every later flow of the worker failed
# (ValueError: I/O operation on closed file, then a RecursionError through Prefect's print
# patch): set up here, on the stream pytest keeps for the whole session.
import prefect.main  # noqa: E402,F401
from local_servers import stop_local_servers  # noqa: E402

pytest_plugins = ["image_fixtures"]  # the training image, shared by image and docker tests

from stoker.config import TrainConfig  # noqa: E402
from stoker.data.demo import ensure_demo_repo  # noqa: E402
from stoker.data.pull import pull_dataset  # noqa: E402
from stoker.runtime.spec import RunSpec  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """No test, nor a module's fixture, inherits MLFLOW_TRACKING_URI (the default of
    ``tracking.tracking_uri`` and of ``stoker predict``'s store): neither a developer's nor the
    one ``mlflow.set_tracking_uri`` leaves in this worker's environment for an earlier test's
    store. Dropped before each test's fixtures are set up; a test sets it where it means to."""
    os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session", autouse=True)
def _state_home():
    """The worker's stand-in for the user's state folder (STATE_HOME): its servers stopped and
    the folder removed when the session ends."""
    yield STATE_HOME
    stop_local_servers(STATE_HOME)
    shutil.rmtree(STATE_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_local_server_left(request):
    """A test that ran `stoker run` or `stoker cost-guard` without PREFECT_API_URL started the
    long-lived local server of its tmp work folder: stopped here, so none leaks from the suite."""
    root = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if root is not None:
        stop_local_servers(root)


@pytest.fixture(autouse=True)
def _no_parked_launcher_left():
    """A test that ran attempts through ``LocalLauncher.run`` directly (no ``train`` task to
    discard it) may leave a launcher parked for a retry: ended here, so the next test in this
    worker starts from nothing (the ``train`` task and ``stoker run`` discard their own)."""
    yield
    from stoker.launch.local import discard_standby

    discard_standby()


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stoker")
    os.environ.setdefault("PREFECT_HOME", str(path / "prefect-home"))
    return path


@pytest.fixture(scope="session")
def demo_repo(session_dir):
    return ensure_demo_repo(session_dir / "demo-data")


@pytest.fixture(scope="session")
def dataset(demo_repo, session_dir):
    return pull_dataset(str(demo_repo.repo), "v1", "data/digits", session_dir / "datasets")


@pytest.fixture
def make_spec(dataset, tmp_path):
    """Write a run spec for a small job in tmp_path and return its path."""

    def make(job: str = "job", tracking: bool = True, tracking_uri: str | None = None,
             **train) -> Path:
        fields = {"epochs": 2, "checkpoint_every_steps": 10, "keep_latest_k": 2, **train}
        job_dir = tmp_path / job
        job_dir.mkdir(parents=True, exist_ok=True)
        spec = RunSpec(
            train=TrainConfig(**fields), data_dir=dataset.local_path, job_dir=str(job_dir),
            tracking_uri=(tracking_uri or f"sqlite:///{tmp_path / 'mlflow.db'}") if tracking
            else None,
            artifact_location=(tmp_path / "mlartifacts").as_uri(), run_name=job,
            tags={"dvc.md5": dataset.md5},
        )
        spec.dump(job_dir / "spec.yaml")
        return job_dir / "spec.yaml"

    return make


def events(job_dir: Path) -> list[dict]:
    """The job's progress events so far. Tests poll this while ranks append: a last line without
    its newline is a record still being written and is left for the next poll; every whole line
    must parse (our writers end a torn line before appending, so a bad whole line is a bug)."""
    path = Path(job_dir) / "progress.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    whole = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def process_gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether process ``pid`` ends (gone, or a zombie) within ``timeout_s`` seconds."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def rank_of(proc) -> int | None:
    """The rank a training process runs, from the name it gives itself (``stoker-rank<N>``,
    both when exec'd and when forked from the launcher), else None (torchrun, data workers,
    anything else). A process that is gone reads as None."""
    import psutil

    try:
        name = proc.name()
    except psutil.Error:
        return None
    return int(name[len("stoker-rank"):]) if name.startswith("stoker-rank") and \
        name[len("stoker-rank"):].isdigit() else None


def rank_processes(parent) -> dict[int, object]:
    """rank -> psutil.Process of the training ranks below ``parent`` (any depth)."""
    import psutil

    try:
        children = parent.children(recursive=True)
    except psutil.Error:
        return {}
    return {rank: p for p in children if (rank := rank_of(p)) is not None}


def launcher_of(root) -> object | None:
    """The launcher (torchrun's process) of the attempt running below ``root`` (a
    psutil.Process, any depth): the parent of its ranks, so neither a rank (a forked rank's
    command line is its launcher's) nor an idle or parked launcher; None while no rank runs."""
    import psutil

    for proc in rank_processes(root).values():
        try:
            return proc.parent()
        except psutil.Error:
            continue
    return None


def metric_steps(total_steps: int, every: int = TrainConfig().metrics_every_steps) -> list[int]:
    """The steps at which MLflow gets train_loss, lr and samples_per_s: every ``every`` steps
    (train.metrics_every_steps) and the last."""
    return sorted({*range(every, total_steps + 1, every), total_steps})


def last_step(job_dir: Path) -> int:
    return max((e["step"] for e in events(job_dir) if e["event"] == "step"), default=0)


class Preemptor(threading.Thread):
    """Sends ``sig`` to processes of a running launcher once the job passes ``at_step``.

    ``target`` picks the victims from the launcher's tree: "tree" (torchrun and every worker),
    "agent" (torchrun only) or "rank:N" (one worker, found by its process name).
    """

    def __init__(self, launcher, job_dir: Path, at_step: int, target: str = "tree",
                 sig: int = signal.SIGTERM):
        super().__init__(daemon=True)
        self.launcher, self.job_dir, self.at_step = launcher, Path(job_dir), at_step
        self.target, self.sig = target, sig
        self.fired_at: int | None = None
        self.victims: list[int] = []

    def _victims(self, agent) -> list:
        workers = rank_processes(agent)
        if self.target == "agent":
            return [agent]
        if self.target.startswith("rank:"):
            rank = int(self.target.split(":")[1])
            return [workers[rank]] if rank in workers else []
        return [agent, *workers.values()]

    def run(self) -> None:
        import psutil

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            proc = self.launcher.process
            if proc is not None and proc.poll() is None and last_step(self.job_dir) >= self.at_step:
                try:
                    victims = self._victims(psutil.Process(proc.pid))
                    if not victims:
                        continue
                    self.fired_at = last_step(self.job_dir)
                    for victim in victims:
                        victim.send_signal(self.sig)
                    self.victims = [v.pid for v in victims]
                except psutil.NoSuchProcess:
                    continue
                return
            time.sleep(0.005)


@pytest.fixture
def copy_tree():
    def copy(src: Path, dst: Path) -> Path:
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def mlflow_http(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (sqlite backend, served artifacts), one per session."""
    from mlflow_server import MlflowServer

    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as running:
        yield running


# Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), tests that share an
# expensive fixture share a worker, so it is made once:
# * the session's training image (tests/image_fixtures.py), or the base and wheelhouse a module
#   makes itself: one "docker" group, so the image is built once and two builds never race;
# * a module-scoped fixture (a Prefect test server, a moto server, a trained job): the module's
#   tests go to one worker.
# Other tests go wherever a worker is free.
DOCKER_FIXTURES = {"engine", "standin_base", "wheelhouse", "built", "training_image",
                   "docker_engine"}
DOCKER_MODULES = {"test_image_flow.py"}


def xdist_group(item) -> str | None:
    """The xdist group of a test (see above), or None."""
    names = set(getattr(item, "fixturenames", ()))
    if DOCKER_FIXTURES & names or item.path.name in DOCKER_MODULES:
        return "docker"
    info = getattr(item, "_fixtureinfo", None)  # pytest's record of the fixtures a test uses
    definitions = info.name2fixturedefs.values() if info is not None else ()
    if any(defs and defs[-1].scope == "module" for defs in definitions):
        return item.path.name
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it appends them to nodeids)
def pytest_collection_modifyitems(config, items):
    """xdist groups (above); ``gpu``-marked tests need CUDA: skipped with a reason without it
    (CI has no GPU)."""
    import torch

    for item in items:
        if group := xdist_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
