"""The registered pyfunc served by MLflow over HTTP, and ``stoker predict``: class names."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from data_repos import write_images
from test_registry import register

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    """A registered RGB 3-class model (tracking URI, model name)."""
    tmp = tmp_path_factory.mktemp("serving")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    register(uri, 0.5, name="flowers-data-images", classes=("daisy", "rose", "tulip"),
             shape=(3, 8, 8), tmp=tmp)
    return uri, "flowers-data-images"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_models_serve_answers_class_names(champion, tmp_path):
    uri, name = champion
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true",
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{name}@champion",
         "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    body = json.dumps({"inputs": np.random.default_rng(0).random((2, 3, 8, 8)).tolist()})
    try:
        deadline, answer = time.monotonic() + 120, None
        while answer is None and time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations", data=body.encode(),
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    answer = json.loads(response.read())
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
    assert answer is not None, (tmp_path / "serve.log").read_text()[-3000:]
    rows = answer["predictions"]
    assert len(rows) == 2 and all(row["class"] in ("daisy", "rose", "tulip") for row in rows)
    assert all(abs(row["p_daisy"] + row["p_rose"] + row["p_tulip"] - 1) < 1e-5 for row in rows)


def test_stoker_predict_prints_class_names(champion, tmp_path):
    uri, name = champion
    write_images(tmp_path / "imgs", {"x": 2}, size=16, mode="RGB")  # resized to 8x8
    files = sorted(str(p) for p in (tmp_path / "imgs").rglob("*.png"))
    out = subprocess.run(
        [str(BIN / "stoker"), "predict", *files, "--model-uri", f"models:/{name}@champion",
         "--tracking-uri", uri, "--logits"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    for line, file in zip(lines, files, strict=True):
        path, label, probability, *logits = line.split("\t")
        assert path == file and label in ("daisy", "rose", "tulip")
        assert 0 < float(probability) <= 1 and len(logits) == 3
    # A folder stands for its image files and those of its subfolders, in name order.
    whole = subprocess.run(
        [str(BIN / "stoker"), "predict", str(tmp_path), "--model-uri", f"models:/{name}@champion",
         "--tracking-uri", uri], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert [line.split("\t")[0] for line in whole.stdout.strip().splitlines()] == files
    # Without --model-uri: the store's only registered model (new-user trial: the demo's name
    # was the default, so a user's own model always needed the flag).
    alone = subprocess.run(
        [str(BIN / "stoker"), "predict", *files, "--tracking-uri", uri], capture_output=True,
        text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert [line.split("\t")[:2] for line in alone.stdout.strip().splitlines()] == \
        [line.split("\t")[:2] for line in lines]
    assert f"model: models:/{name}@champion (the store's only registered model)" in alone.stderr
    # --work-dir: the store `stoker run` wrote in that folder (<work-dir>/mlflow.db)
    by_folder = subprocess.run(
        [str(BIN / "stoker"), "predict", *files, "-w",
         str(Path(uri.removeprefix("sqlite:///")).parent)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert by_folder.returncode == 0, by_folder.stderr[-3000:]
    assert by_folder.stdout == alone.stdout


def _predict_modules(args: list[str], cwd: Path) -> tuple[int, set[str]]:
    """Run ``stoker predict ARGS`` in a fresh interpreter: its exit code and the top-level
    modules it imported."""
    code = ("import sys\nfrom stoker.cli import app\ntry:\n    app(sys.argv[1:])\n"
            "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "print('MODULES', code, ' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code, "predict", *args], capture_output=True,
                         text=True, timeout=300, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    line = next(x for x in out.stdout.splitlines() if x.startswith("MODULES"))
    _, exit_code, *modules = line.split()
    return int(exit_code), set(modules)


def test_stoker_predict_imports_no_prefect_and_a_bad_path_no_torch(champion, tmp_path):
    """New-user finding: `stoker predict` took 87-231 s for one image. It imports no Prefect
    (and starts no server); a path that does not exist is refused before torch and MLflow
    load (in well under a second)."""
    uri, name = champion
    write_images(tmp_path / "imgs", {"x": 1}, size=16, mode="RGB")
    image = str(next((tmp_path / "imgs").rglob("*.png")))
    code, modules = _predict_modules([image, "--model-uri", f"models:/{name}@champion",
                                      "--tracking-uri", uri], tmp_path)
    assert code == 0 and "torch" in modules and "prefect" not in modules
    code, modules = _predict_modules(["no-such.png", "--tracking-uri", uri], tmp_path)
    assert code == 2 and not {"torch", "mlflow", "prefect"} & modules, modules
def test_predict_refuses_colour_images_on_a_gray_model_and_names_the_answering_version(
        tmp_path):
    """Issue 46: RGB shapes on a 1-channel digits model printed confident digit labels, exit 0,
    without saying which model answered."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register(uri, 0.5, name="digits", classes=tuple("0123456789"), shape=(1, 8, 8), tmp=tmp_path)
    write_images(tmp_path / "shapes", {"circle": 1, "square": 1}, size=8, mode="RGB")
    write_images(tmp_path / "gray", {"3": 1}, size=8, mode="L")
    write_images(tmp_path / "pets", {"cat": 1, "dog": 1}, size=8, mode="L")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}

    def predict(*args):
        return subprocess.run([str(BIN / "stoker"), "predict", *args, "--tracking-uri", uri,
                               "--model-uri", "models:/digits@champion"], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path, env=env)

    colour = predict(*sorted(str(p) for p in (tmp_path / "shapes").rglob("*.png")))
    assert colour.returncode == 2 and colour.stdout == "", colour.stderr[-3000:]
    [line] = colour.stderr.strip().splitlines()
    assert "colour (3 channels) image" in line and "1 channel" in line, line
    assert "--model-uri" in line, line
    classes = predict(str(tmp_path / "pets"))
    assert classes.returncode == 2, classes.stderr
    assert "class folders cat, dog are none of the classes" in classes.stderr, classes.stderr
    fine = predict(str(tmp_path / "gray"))
    assert fine.returncode == 0, fine.stderr[-3000:]
    assert re.search(r"^model: digits version 1 \(alias (.*, )?champion(, .*)?\), run [0-9a-f]{32} "
                     r"\(models:/digits@champion\)$", fine.stderr, re.M), fine.stderr
