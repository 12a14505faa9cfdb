"""Issue 44, point 1: ``stoker predict`` checks a model's MLmodel file before anything is loaded,
so a CloudPickle model registered as ``<model>@champion`` is refused and never run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from data_repos import write_images

from stoker.tracking.safe_model import UnsafeModelError, check_mlmodel

BIN = Path(sys.executable).parent


class Payload(mlflow.pyfunc.PythonModel):
    """A pyfunc whose CloudPickle, when loaded, creates ``marker`` (os.system)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))

    def predict(self, context, model_input, params=None):
        return model_input


def test_a_cloudpickle_champion_is_refused_before_it_is_loaded(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    marker = tmp_path / "pwned"
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run():
        info = mlflow.pyfunc.log_model(name="model", python_model=Payload(str(marker)),
                                       metadata={"stoker": {"preprocessing": {}}})
    version = mlflow.register_model(info.model_uri, "evil-data")
    mlflow.MlflowClient(uri).set_registered_model_alias("evil-data", "champion", version.version)
    marker.unlink(missing_ok=True)  # MLflow's log_model loads it back once: not the reader
    write_images(tmp_path / "imgs", {"x": 1}, size=8, mode="RGB")
    image = next((tmp_path / "imgs").rglob("*.png"))
    out = subprocess.run(
        [str(BIN / "stoker"), "predict", str(image), "--model-uri", "models:/evil-data@champion",
         "--tracking-uri", uri], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pickled Python model" in lines[0], out.stderr[-3000:]
    assert lines[0].startswith("error: models:/evil-data@champion: ")
    assert not marker.exists()


@pytest.mark.parametrize(("mlmodel", "says"), [
    ({"flavors": {"python_function": {}, "pytorch": {}}}, "flavors"),
    ({"flavors": {"python_function": {"python_model": "python_model.pkl"}}}, "pickled"),
    ({"flavors": {"python_function": {"model_code_path": "x.py"}}}, "no 'stoker' metadata"),
    ({"flavors": {"python_function": {"model_code_path": "x.py", "artifacts": {
        "weights": {"path": "../../etc/passwd"}, "meta": {"path": "artifacts/s.json"}}}},
      "metadata": {"stoker": {}}}, "'weights'"),
])
def test_check_mlmodel_names_what_is_wrong(mlmodel, says):
    with pytest.raises(UnsafeModelError, match=says):
        check_mlmodel(mlmodel, "models:/m@champion")
