"""Promotion gate against a real MLflow store (sqlite) and registry."""

from __future__ import annotations

import uuid
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from PIL import Image

from stoker.runtime.models import build_model
from stoker.tracking.registry import (
    CHALLENGER,
    CHAMPION,
    CLASSES_TAG,
    SHAPE_TAG,
    LineageError,
    beats,
    log_and_register,
    pip_requirements,
)

pytestmark = pytest.mark.integration


def test_beats():
    assert beats(0.9, None, "max") and beats(0.9, 0.8, "max") and not beats(0.8, 0.8, "max")
    assert beats(0.1, 0.2, "min") and not beats(0.3, 0.2, "min")


def test_requirements_have_no_local_version_suffix():
    assert all("+" not in r and "==" in r for r in pip_requirements())


MODEL = f"gate-model-{uuid.uuid4().hex[:6]}"


def trained_result(folder, classes=("cat", "dog"), shape=(1, 8, 8)) -> dict:
    """A result.json as the trainer writes it, with untrained small_cnn weights."""
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model("small_cnn", len(classes), shape[0])
    torch.save(model.state_dict(), folder / "model.pt")
    return {"model": "small_cnn", "num_classes": len(classes), "input_shape": list(shape),
            "classes": list(classes), "model_path": str(folder / "model.pt")}


def register(uri: str, value: float, direction: str = "max", artifacts: str | None = None,
             name: str = MODEL, classes=("cat", "dog"), shape=(1, 8, 8), tmp=None):
    import tempfile
    from pathlib import Path

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("gate") or client.get_experiment(
        client.create_experiment("gate", artifact_location=artifacts))
    run = client.create_run(experiment.experiment_id)
    client.log_metric(run.info.run_id, "val_accuracy", value)
    client.set_terminated(run.info.run_id, "FINISHED")
    result = trained_result(Path(tmp or tempfile.mkdtemp()) / run.info.run_id, classes, shape)
    example = np.zeros((2, *shape), dtype=np.float32)
    return log_and_register(uri, run.info.run_id, name, result, example,
                            {"dvc.rev": "v1"}, "val_accuracy", value, direction), client


@pytest.fixture(params=["sqlite", "http"])
def store(request, tmp_path):
    """(tracking URI, artifact location for new experiments)."""
    if request.param == "http":
        return request.getfixturevalue("mlflow_http").uri, None  # the server serves artifacts
    return f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri()


def test_champion_moves_only_when_better(store, monkeypatch):
    uri, artifacts = store
    first, client = register(uri, 0.90, artifacts=artifacts)
    assert first.version == "1" and first.promoted and first.previous_champion is None
    worse, _ = register(uri, 0.85, artifacts=artifacts)
    assert not worse.promoted and worse.previous_champion == "1"
    tie, _ = register(uri, 0.90, artifacts=artifacts)
    assert not tie.promoted
    # The store filters the versions a registration reads: none of this run's yet, then those
    # newer than the champion it compared against (2-4), never every version of the model
    # (2.4 ms each on sqlite, twice per registration).
    reads = []
    real = MlflowClient.search_model_versions
    monkeypatch.setattr(MlflowClient, "search_model_versions",
                        lambda self, *a, **k: reads.append(found := real(self, *a, **k)) or found)
    better, _ = register(uri, 0.93, artifacts=artifacts)
    assert better.promoted and better.previous_value == pytest.approx(0.90)
    assert [sorted(int(v.version) for v in found) for found in reads] == [[], [2, 3, 4]]
    assert str(client.get_model_version_by_alias(MODEL, CHAMPION).version) == "4"
    assert str(client.get_model_version_by_alias(MODEL, CHALLENGER).version) == "4"
    version = client.get_model_version(MODEL, "2")
    assert version.tags["dvc.rev"] == "v1" and version.tags["val_accuracy"] == "0.85"
    # The run that produced a version keeps its final status.
    assert client.get_run(version.run_id).info.status == "FINISHED"


def test_a_champion_whose_run_the_store_lost_is_compared_by_its_version_tag(tmp_path):
    """The champion's run is gone from the store (hard-deleted by `mlflow gc`, as a store
    lost with a node leaves it): the gate reads the value the version carries, not a
    traceback, and a worse model is not promoted."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first, client = register(uri, 0.90, artifacts=(tmp_path / "artifacts").as_uri(), tmp=tmp_path)
    run_id = client.get_model_version(MODEL, first.version).run_id
    client.delete_run(run_id)
    gc = subprocess.run([str(Path(sys.executable).with_name("mlflow")), "gc",
                         "--backend-store-uri", uri, "--run-ids", run_id],
                        capture_output=True, text=True, timeout=300)
    assert gc.returncode == 0, gc.stderr[-2000:]
    with pytest.raises(mlflow.exceptions.MlflowException, match="not found"):
        client.get_run(run_id)
    worse, _ = register(uri, 0.85, artifacts=(tmp_path / "artifacts").as_uri(), tmp=tmp_path)
    assert not worse.promoted and worse.previous_value == pytest.approx(0.90)
    assert str(client.get_model_version_by_alias(MODEL, CHAMPION).version) == first.version


def test_a_new_version_is_created_with_its_tags(tmp_path, monkeypatch):
    """One write with the version, not one per tag (about 20 round trips to a server): a new
    version never exists untagged. Finishing an interrupted registration still tags it."""
    from mlflow import MlflowClient as Client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    calls = []
    real = Client.set_model_version_tag
    monkeypatch.setattr(Client, "set_model_version_tag",
                        lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    done, client = register(uri, 0.9, artifacts=(tmp_path / "artifacts").as_uri(), tmp=tmp_path)
    assert calls == []
    tags = client.get_model_version(MODEL, done.version).tags
    assert tags["dvc.rev"] == "v1" and tags["val_accuracy"] == "0.9"
    assert {CLASSES_TAG, SHAPE_TAG} <= set(tags)
    # A registration killed after the version was made (and before its aliases): the next one
    # for the same run finishes that version instead of making another.
    from stoker.tracking.registry import _register, log_model

    run = client.create_run(client.get_experiment_by_name("gate").experiment_id)
    client.log_metric(run.info.run_id, "val_accuracy", 0.95)
    result = trained_result(tmp_path / run.info.run_id)
    example = np.zeros((2, 1, 8, 8), dtype=np.float32)
    mlflow.set_tracking_uri(uri)
    half = _register(log_model(uri, run.info.run_id, result, example), MODEL, {})  # no tags
    finished = log_and_register(uri, run.info.run_id, MODEL, result, example, {"dvc.rev": "v2"},
                                "val_accuracy", 0.95)
    assert finished.version == half and finished.promoted
    tags = client.get_model_version(MODEL, half).tags
    assert tags["dvc.rev"] == "v2" and tags["val_accuracy"] == "0.95" and CLASSES_TAG in tags


def test_another_lineage_is_never_compared_with_the_champion(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first, client = register(uri, 0.50, name="lineage", tmp=tmp_path)
    assert first.promoted
    with pytest.raises(LineageError, match=r"tracking.registered_model 'lineage'.*2 classes "
                                           r"\['cat', 'dog'\], input 1x8x8.*5 classes"):
        register(uri, 0.99, name="lineage", classes=("a", "b", "c", "d", "e"),
                 shape=(3, 32, 32), tmp=tmp_path)
    assert [str(v.version) for v in client.search_model_versions("name = 'lineage'")] == ["1"]
    assert str(client.get_model_version_by_alias("lineage", CHAMPION).version) == "1"


RACER = """
import json, sys, time
from pathlib import Path

from mlflow import MlflowClient
from stoker.tracking.registry import CHAMPION
from test_registry import register

uri, value, folder = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
real_get = MlflowClient.get_model_version_by_alias
real_set = MlflowClient.set_registered_model_alias
waited = []


def get_then_wait(self, name, alias):
    found = real_get(self, name, alias)
    if not waited:  # the first read (the lineage check): wait until the other has read too
        waited.append(True)
        (folder / f"read-{value}").touch()
        deadline = time.monotonic() + 120
        while len(list(folder.glob("read-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    return found


def set_late_if_worse(self, name, alias, version):
    if alias == CHAMPION and value == 0.90:
        time.sleep(1.0)  # the worse model writes last
    return real_set(self, name, alias, version)


MlflowClient.get_model_version_by_alias = get_then_wait
MlflowClient.set_registered_model_alias = set_late_if_worse
registration = register(uri, value, name="race", tmp=folder)[0]
print(json.dumps({"version": registration.version, "promoted": registration.promoted}))
"""


def test_concurrent_registrations_end_with_the_best_champion(tmp_path):
    """Two processes (two flow runs) register at once: both read the 0.50 incumbent before
    either writes, and the worse one writes last. The best version must still end as champion.

    Processes, not threads: that is how two registrations meet in Stoker, and CPython 3.11
    raises a spurious ``SystemError: AST constructor recursion depth mismatch`` when two
    threads of one process parse at once (MLflow parses registry filters with
    ``ast.literal_eval``; python/cpython#106905)."""
    import json
    import os
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register(uri, 0.50, name="race", tmp=tmp_path)
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    # the tests folder (test_registry's register) on the racers' path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    racers = {value: subprocess.Popen(
        [sys.executable, str(script), uri, str(value), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for value in (0.95, 0.90)}
    outcomes = {}
    try:
        for value, racer in racers.items():
            out, err = racer.communicate(timeout=300)
            assert racer.returncode == 0, err[-3000:]
            outcomes[value] = json.loads(out.strip().splitlines()[-1])
    finally:  # a racer that hung (or whose partner failed) is not left running
        for racer in racers.values():
            if racer.poll() is None:
                racer.kill()
                racer.communicate()
    assert sorted(p.name for p in tmp_path.glob("read-*")) == ["read-0.9", "read-0.95"]
    champion = MlflowClient(uri).get_model_version_by_alias("race", CHAMPION)
    assert str(champion.version) == outcomes[0.95]["version"] and outcomes[0.95]["promoted"]
    # (The worse one reports promoted only if it took the promotion lock first, and so held
    # champion when it returned: under the lock that order is the scheduler's, not a fault.)


def test_registered_model_answers_class_names(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register(uri, 0.5, name="names", classes=("four", "one", "zero"), shape=(3, 8, 8),
             tmp=tmp_path)
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/names@champion")
    out = model.predict(np.random.default_rng(0).random((2, 3, 8, 8), dtype=np.float32))
    assert set(out["class"]) <= {"four", "one", "zero"}
    assert np.allclose(out[["p_four", "p_one", "p_zero"]].sum(axis=1), 1.0, atol=1e-5)
    meta = model.metadata.metadata["stoker"]
    assert meta["classes"] == ["four", "one", "zero"]
    assert meta["preprocessing"]["channels"] == 3 and meta["preprocessing"]["height"] == 8
    logits = model.predict(np.zeros((1, 3, 8, 8), np.float32), params={"logits": True})
    assert {"logit_four", "logit_one", "logit_zero"} <= set(logits.columns)


def test_a_champion_registered_before_lineage_tags_is_compared_by_its_signature(tmp_path):
    """The old registry entry: a pytorch-flavor digits model (1x8x8 in, 10 logits out)."""
    import mlflow
    from mlflow.models import infer_signature

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment = client.create_experiment("old", artifact_location=(tmp_path / "a").as_uri())
    model = build_model("small_cnn", 10, 1).eval()
    example = np.zeros((2, 1, 8, 8), dtype=np.float32)
    with mlflow.start_run(experiment_id=experiment):
        mlflow.log_metric("val_accuracy", 0.5)
        signature = infer_signature(example, model(torch.as_tensor(example)).detach().numpy())
        mlflow.pytorch.log_model(model, name="model", signature=signature,
                                 serialization_format="pickle",
                                 registered_model_name="old-digits")
    client.set_registered_model_alias("old-digits", CHAMPION, "1")
    with pytest.raises(LineageError, match=r"champion \(version 1\) has 10 classes"):
        register(uri, 0.99, name="old-digits", classes=("a", "b", "c", "d", "e"),
                 shape=(3, 32, 32), tmp=tmp_path)
    digits = register(uri, 0.9, name="old-digits", classes=tuple(str(i) for i in range(10)),
                      tmp=tmp_path)[0]  # the demo's own lineage still compares and promotes
    assert digits.promoted and digits.previous_champion == "1"


def test_the_classifier_loads_without_mlflow_type_hint_warnings():
    """Every `stoker predict` and registration printed MLflow's yellow "Add type hints to the
    `predict` method" UserWarning (raised under MLflow's own warning filters, so a module-level
    filter did not hide it)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import stoker.tracking.pyfunc"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "type hints" not in done.stderr, done.stderr


def test_registration_skips_mlflow_scan_of_every_installed_package(tmp_path, monkeypatch,
                                                                   caplog):
    """MLflow's requirement check maps every installed distribution to its modules (~1.6 CPU-s
    of a ~2 s registration); the logged requirements are the installed versions, so it is
    skipped, and MLflow's own map is left as it was for anything else in the process. The
    model is logged from code: no CloudPickle warning at every registration."""
    import importlib.metadata

    from mlflow.utils import requirements_utils

    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)
    monkeypatch.setattr(requirements_utils, "_PACKAGES_TO_MODULES", None)
    scans = []
    real = importlib.metadata.packages_distributions
    monkeypatch.setattr(requirements_utils.importlib_metadata, "packages_distributions",
                        lambda: scans.append(1) or real())
    registration, client = register(f"sqlite:///{tmp_path / 'mlflow.db'}", 0.9, tmp=tmp_path,
                                    artifacts=(tmp_path / "artifacts").as_uri())
    assert scans == []
    assert "CloudPickle" not in caplog.text
    assert requirements_utils._MODULES_TO_PACKAGES is None  # MLflow builds it itself if needed
    from mlflow.pyfunc import get_model_dependencies

    requirements = Path(get_model_dependencies(
        f"models:/{MODEL}/{registration.version}")).read_text()
    assert set(pip_requirements()) <= set(requirements.split())


def test_registration_prints_nothing_of_mlflow_on_the_terminal(tmp_path, capfd):
    """MLflow's own lines ("Validating input example ...", "Successfully registered model ...",
    "Created version ...", "Creating initial MLflow database tables...") repeated in another
    format what Stoker says in one line; they go to the debug log now."""
    from stoker.runtime.tracking import ensure_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_store(uri)  # the store's creation, quiet too
    register(uri, 0.9, tmp=tmp_path, artifacts=(tmp_path / "artifacts").as_uri())
    out, err = capfd.readouterr()
    for mlflow_line in ("Successfully registered", "Created version", "Validating input",
                        "pip install -r", "Creating initial"):
        assert mlflow_line not in out + err, (out + err)[-2000:]


LOAD_FROM_SHIPPED_CODE = """
import json, sys
import mlflow, numpy as np
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model(sys.argv[2])
out = model.predict(np.zeros((1, 1, 8, 8), np.float32))
files = sorted({m.__file__ for name, m in sys.modules.items()
                if name.split(".")[0] == "stoker" and getattr(m, "__file__", None)})
print(json.dumps({"classes": list(out["class"]), "files": files}))
"""


def test_the_model_ships_the_modules_its_loader_imports_and_serves_from_them_alone(tmp_path):
    """The model's code is the closure of its loader's ``stoker`` imports, not the whole
    package (133 files, an upload each on every registration); a fresh interpreter outside the
    repository loads and serves the model with that code alone."""
    import json
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registration, _client = register(uri, 0.5, name="shipped", tmp=tmp_path)
    mlflow.set_tracking_uri(uri)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=registration.model_uri,
                                                     dst_path=str(tmp_path / "model")))
    shipped = {p.relative_to(local / "code").as_posix()
               for p in (local / "code").rglob("*") if p.is_file()}
    assert "stoker/tracking/pyfunc.py" in shipped and "stoker/runtime/models.py" in shipped
    assert not any(p.startswith(("stoker/launch/", "stoker/costguard/", "stoker/jobs/"))
                   for p in shipped), sorted(shipped)
    assert "stoker/cli.py" not in shipped and len(shipped) < 30, sorted(shipped)

    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOAD_FROM_SHIPPED_CODE, uri,
                           registration.model_uri], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(answer["classes"]) <= {"cat", "dog"}
    repo = str(Path(__file__).resolve().parents[1] / "stoker")
    assert answer["files"] and not [f for f in answer["files"] if f.startswith(repo)], \
        answer["files"]


def test_a_model_rank_0_logged_is_registered_and_no_other_is_logged(tmp_path):
    """Rank 0 logs the model as the job ends and records its URI in the job folder; the
    orchestrator registers that one (no torch, no input example needed) instead of logging a
    second model to the run. A record it cannot trust (another run's, torn, not a models URI)
    is ignored: the orchestrator logs the model itself."""
    from stoker.runtime.records import write_json
    from stoker.tracking.registry import (
        LOGGED_MODEL_FILE,
        log_model,
        logged_model,
        write_logged_model,
    )

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("gate", (tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment_id).info.run_id
    job = tmp_path / "job"
    result = trained_result(job / "final")
    model_uri = log_model(uri, run_id, result, np.zeros((2, 1, 8, 8), dtype=np.float32))
    assert logged_model(job, run_id) is None  # no record yet
    write_logged_model(job, run_id, model_uri)
    assert logged_model(job, run_id) == model_uri and model_uri.startswith("models:/m-")
    assert logged_model(job, "another-run") is None

    def no_example():
        raise AssertionError("the model was logged again")

    done = log_and_register(uri, run_id, MODEL, result, no_example, {"dvc.rev": "v1"},
                            "val_accuracy", 0.9, logged_model_uri=logged_model(job, run_id))
    assert client.get_model_version(MODEL, done.version).source == model_uri
    assert len(client.search_logged_models([experiment_id])) == 1
    # A record naming a model another run logged: the store says whose it is; logged again.
    other_run = client.create_run(experiment_id).info.run_id
    again = log_and_register(uri, other_run, MODEL, result, lambda: np.zeros(
        (2, 1, 8, 8), dtype=np.float32), {"dvc.rev": "v1"}, "val_accuracy", 0.8,
        logged_model_uri=model_uri)
    assert client.get_model_version(MODEL, again.version).source != model_uri
    assert len(client.search_logged_models([experiment_id])) == 2
    for record in ({"run_id": run_id, "model_uri": "runs:/x/y"}, {"run_id": run_id}, [1]):
        write_json(job / LOGGED_MODEL_FILE, record)
        assert logged_model(job, run_id) is None, record
    (job / LOGGED_MODEL_FILE).write_text('{"run_id": "' + run_id + '", "model_u')  # torn
    assert logged_model(job, run_id) is None


def test_rank_0_that_cannot_log_the_model_warns_and_leaves_no_record(tmp_path, caplog):
    """Rank 0 reaches the model logging through the entry point Stoker installs (the runtime
    imports no orchestration code). The job is done whatever MLflow answers: a failed log is
    one warning naming the hook and the run, no record, and the orchestrator logs the model."""
    from importlib.metadata import entry_points

    from stoker.runtime.reporting import COMPLETED_JOB_HOOKS, ReportingMixin
    from stoker.runtime.spec import RunSpec
    from stoker.tracking.registry import LOGGED_MODEL_FILE, log_completed_model

    [hook] = entry_points(group=COMPLETED_JOB_HOOKS)
    assert hook.load() is log_completed_model
    job = tmp_path / "job"
    data = tmp_path / "data"
    for name in ("cat", "dog"):
        (data / name).mkdir(parents=True)
        Image.new("L", (8, 8)).save(data / name / "0.png")
    trainer = type("Trainer", (ReportingMixin,), {"_run_id": lambda self: "abc123"})()
    trainer.result = trained_result(job / "final")
    (tmp_path / "mlflow.db").write_text("not a database\n" * 100)
    trainer.spec = RunSpec(data_dir=str(data), job_dir=str(job), log_model=True,
                           tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    with caplog.at_level("WARNING", logger="stoker.runtime"):
        trainer._log_model()
    assert not (job / LOGGED_MODEL_FILE).exists()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("the completed-job hook stoker.tracking.registry:log_completed_model "
                           "failed for MLflow run abc123 (")
    assert line.endswith("the orchestrator logs the model")
    caplog.clear()
    import stoker.tracking.registry as registry

    def refused(*_args):  # an MLflow error that quotes a tracking URI with its password
        raise RuntimeError("POST http://alice:s3cret@mlflow.example/api failed")

    registry.log_completed_model, real = refused, registry.log_completed_model
    try:
        with caplog.at_level("WARNING", logger="stoker.runtime"):
            trainer._log_model()
    finally:
        registry.log_completed_model = real
    [line] = [r.getMessage() for r in caplog.records]
    assert "s3cret" not in line and "http://alice:***@mlflow.example" in line
    caplog.clear()
    trainer.spec = trainer.spec.model_copy(update={"log_model": False})  # a training image's
    trainer._log_model()
    assert caplog.records == [] and not (job / LOGGED_MODEL_FILE).exists()


def test_rank_0_logs_the_model_only_where_it_runs_this_environment(tmp_path):
    """Local and Slurm ranks run this Python environment; a training image holds the runtime's
    packages only (no pandas for the pyfunc), so there the orchestrator logs the model."""
    from stoker.config import load_pipeline_config
    from stoker.data.pull import DatasetRef
    from stoker.launch.supervisor import write_spec
    from stoker.runtime.spec import RunSpec

    dataset = DatasetRef("repo", "v1", "c" * 40, "data/digits", "d" * 32 + ".dir", 4, 100,
                         str(tmp_path / "data"))
    for kind, logs in (("local", True), ("slurm", True), ("docker", False),
                       ("kubernetes", False)):
        config = load_pipeline_config(None, [f"work_dir={tmp_path}", f"launcher.kind={kind}",
                                             "tracking.tracking_uri=http://127.0.0.1:5000"])
        spec = write_spec(config, dataset, tmp_path / "jobs" / kind, 2, {})
        assert RunSpec.load(spec).log_model is logs, kind
