"""The registered pyfunc served by MLflow over HTTP, and ``stoker predict``: class names."""

from __future__ import annotations

import base64
import contextlib
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


@contextlib.contextmanager
def served(tracking_uri: str, model_uri: str, log: Path):
    """A real ``mlflow models serve`` of ``model_uri`` (local environment): yields ``post(body)``,
    which returns (HTTP status, parsed JSON answer) once the server answers."""
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_DISABLE_TELEMETRY": "true",
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "models", "serve", "-m", model_uri,
         "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def post(body: dict) -> tuple[int, dict]:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        raise AssertionError(f"no answer from mlflow models serve: {log.read_text()[-3000:]}")

    try:
        yield post
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)


def test_mlflow_models_serve_answers_class_names(champion, tmp_path):
    uri, name = champion
    body = {"inputs": np.random.default_rng(0).random((2, 3, 8, 8)).tolist()}
    with served(uri, f"models:/{name}@champion", tmp_path / "serve.log") as post:
        status, answer = post(body)
    assert status == 200, answer
    rows = answer["predictions"]
    assert len(rows) == 2 and all(row["class"] in ("daisy", "rose", "tulip") for row in rows)
    assert all(abs(row["p_daisy"] + row["p_rose"] + row["p_tulip"] - 1) < 1e-5 for row in rows)


@pytest.fixture(scope="module")
def gray_champion(tmp_path_factory):
    """A registered gray (1-channel) 3-class model in a store of its own (tracking URI, model
    name): the champion's store keeps its only registered model."""
    tmp = tmp_path_factory.mktemp("serving-gray")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    register(uri, 0.5, name="scans", classes=("low", "mid", "high"), shape=(1, 8, 8), tmp=tmp)
    return uri, "scans"


def _png_files(folder: Path) -> dict[str, Path]:
    """An RGB PNG (16x16, resized by the model), a 16-bit gray PNG at 40000 with a darker
    square (Pillow's own conversion clips it to all white) and an 8-bit gray PNG."""
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / "rgb.png")
    deep = np.full((8, 8), 40000, dtype=np.uint16)
    deep[2:6, 2:6] = 5000
    Image.fromarray(deep).save(folder / "deep.png")  # uint16: mode I;16
    assert Image.open(folder / "deep.png").mode.startswith("I")
    Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(folder / "gray.png")
    return {p.stem: p for p in sorted(folder.iterdir())}


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _stoker_predict(files: list[Path], model_uri: str, uri: str, cwd: Path) -> list[list[str]]:
    """``stoker predict`` of ``files``: its lines split at tabs (path, class, probability)."""
    done = subprocess.run(
        [str(BIN / "stoker"), "predict", *map(str, files), "--model-uri", model_uri,
         "--tracking-uri", uri], capture_output=True, text=True, timeout=300, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split("\t") for line in done.stdout.strip().splitlines()]


def _same_answers(rows: list[dict], lines: list[list[str]]) -> None:
    assert [row["class"] for row in rows] == [line[1] for line in lines]
    for row, line in zip(rows, lines, strict=True):
        assert abs(row["probability"] - float(line[2])) <= 5e-4, (row, line)  # printed: 3 places


def test_served_model_takes_image_files_and_answers_as_stoker_predict(
        champion, gray_champion, tmp_path):
    """Issue 46: serving the registered model needed the user to rebuild the preprocessing by
    hand. A request with the image files (base64) gets `stoker predict`'s answer: an RGB PNG
    on the colour model, a 16-bit PNG on the gray model (decoded by the one rule: scaled, not
    clipped); an unusable value or a gray image on the colour model is a 400 naming its row."""
    uri, name = champion
    png = _png_files(tmp_path / "imgs")
    gray_store, gray_name = gray_champion
    colour_uri, gray_uri = f"models:/{name}@champion", f"models:/{gray_name}@champion"
    with served(uri, colour_uri, tmp_path / "serve.log") as post:
        status, answer = post({"dataframe_records": [{"image": _b64(png["rgb"])}]})
        assert status == 200, answer
        status_split, split = post({"inputs": {"image": [_b64(png["rgb"])]}})
        bad_status, bad = post({"dataframe_records": [{"image": _b64(png["rgb"])},
                                                      {"image": "not base64!"}]})
        gray_status, gray = post({"inputs": {"image": [_b64(png["deep"])]}})
    assert status_split == 200 and split["predictions"] == answer["predictions"], split
    assert bad_status == 400 and "image row 1: not base64" in bad["message"], bad
    assert gray_status == 400 and "image row 0: a gray (1 channel) image" in gray["message"]
    _same_answers(answer["predictions"], _stoker_predict([png["rgb"]], colour_uri, uri, tmp_path))
    with served(gray_store, gray_uri, tmp_path / "serve-gray.log") as post:
        status, answer = post({"inputs": {"image": [_b64(png["deep"]), _b64(png["gray"])]}})
    assert status == 200, answer
    _same_answers(answer["predictions"],
                  _stoker_predict([png["deep"], png["gray"]], gray_uri, gray_store, tmp_path))


def test_loaded_model_decodes_image_files_with_the_training_rule(gray_champion):
    """In process (``mlflow.pyfunc.load_model``): the ``image`` column gives the probabilities
    of the tensor that ``preprocess_images`` (training's rule) makes of the same files; a
    16-bit PNG is not the all-white image Pillow's own conversion makes of it."""
    import tempfile

    import mlflow
    import pandas as pd
    from PIL import Image

    from stoker.tracking.pyfunc import preprocess_images

    uri, name = gray_champion
    png = _png_files(Path(tempfile.mkdtemp()) / "imgs")
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    files = [png["deep"], png["gray"]]
    preprocessing = model.metadata.metadata["stoker"]["preprocessing"]
    by_bytes = model.predict(pd.DataFrame({"image": [_b64(f) for f in files]}))
    by_tensor = model.predict(preprocess_images(files, preprocessing))
    assert list(by_bytes["class"]) == list(by_tensor["class"])
    assert np.allclose(by_bytes["probability"], by_tensor["probability"], atol=1e-6)
    assert set(model.metadata.metadata["stoker"]["inputs"]) == {"tensor", "image"}
    clipped = np.asarray(Image.open(png["deep"]).convert("L"), dtype=np.float32) / 255
    scaled = preprocess_images([png["deep"]], preprocessing)[0, 0] * preprocessing["std"][0] \
        + preprocessing["mean"][0]
    assert clipped.min() == 1.0 and scaled.min() < 0.1 < 0.6 < scaled.max() < 0.7


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
    # An image the model cannot take is refused from its metadata, before torch loads it, and
    # one that is no image before MLflow loads (new-user trial: 9-11 s for a refusal).
    write_images(tmp_path / "gray", {"x": 1}, size=16, mode="L")
    gray = str(next((tmp_path / "gray").rglob("*.png")))
    code, modules = _predict_modules([gray, "--model-uri", f"models:/{name}@champion",
                                      "--tracking-uri", uri], tmp_path)
    assert code == 2 and "mlflow" in modules and not {"torch", "prefect"} & modules, modules
    (tmp_path / "notes.png").write_text("not an image")
    code, modules = _predict_modules([str(tmp_path / "notes.png"), "--tracking-uri", uri],
                                     tmp_path)
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
