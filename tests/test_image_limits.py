"""Images and requests a model must refuse (issue 46, "right pixels"): one line naming the file
or the request's row or input, exit code 2 or HTTP 400, never a traceback."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from test_registry import register

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent


def big_png(path: Path, width: int, height: int) -> Path:
    """A real 8-bit gray PNG of ``width`` x ``height`` black pixels, compressed row by row
    (a small file whatever its size in pixels: what a decompression bomb is)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    pack = zlib.compressobj(1)
    rows = b"\x00" * (width + 1) * 500  # 500 rows: filter byte 0, then the row's pixels
    idat = b"".join(pack.compress(rows) for _ in range(height // 500)) + pack.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
                     + chunk(b"IEND", b""))
    return path


@pytest.fixture(scope="module")
def gray_model(tmp_path_factory):
    """A registered gray 3-class 8x8 model: (tmp folder, tracking URI, model URI)."""
    tmp = tmp_path_factory.mktemp("limits")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    register(uri, 0.5, name="scans", classes=("low", "mid", "high"), shape=(1, 8, 8), tmp=tmp)
    return tmp, uri, "models:/scans@champion"


def predict(args: list[str], cwd: Path, env: dict | None = None):
    """``stoker predict ARGS`` in a fresh process (its CompletedProcess)."""
    return subprocess.run(
        [str(BIN / "stoker"), "predict", *args], capture_output=True, text=True, timeout=300,
        cwd=cwd, env={**os.environ, **(env or {}), "PYTHONPATH": str(Path(__file__).parents[1])})


def test_predict_refuses_a_decompression_bomb_in_one_line(gray_model, tmp_path):
    """Issue 46.1: a 20000x20000 PNG (0.4 MB) ended in PIL's DecompressionBombError, exit 1."""
    _, uri, model_uri = gray_model
    bomb = big_png(tmp_path / "bomb.png", 20000, 20000)
    done = predict([str(bomb), "--model-uri", model_uri, "--tracking-uri", uri], tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {bomb}: ") and "Traceback" not in done.stderr, line


@pytest.fixture(scope="module")
def large_png(tmp_path_factory) -> Path:
    """A 12000x12000 PNG: 144 M pixels, under Pillow's hard limit (only its warning)."""
    return big_png(tmp_path_factory.mktemp("large") / "large.png", 12000, 12000)


def test_predict_refuses_an_image_over_the_pixel_limit_before_decoding(
        gray_model, large_png, tmp_path):
    """Issue 46.2: a 12000x12000 PNG was decoded (24 s, 1.5 GB), only Pillow's warning said so."""
    _, uri, model_uri = gray_model
    done = predict([str(large_png), "--model-uri", model_uri, "--tracking-uri", uri], tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line == (f"error: {large_png}: 12000x12000 = 144,000,000 pixels, over the limit of "
                    "89,478,485 pixels (too large to decode safely)"), line


@pytest.fixture(scope="module")
def post(gray_model):
    """``post(body) -> (HTTP status, answer)`` to one real ``mlflow models serve`` of the gray
    model, shared by this module's serving cases (a server start costs about 20 s)."""
    from test_serving import served

    tmp, uri, model_uri = gray_model
    with served(uri, model_uri, tmp / "serve.log") as post:
        yield post


def _b64(path: Path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()


def test_served_model_refuses_an_image_over_the_pixel_limit(post, large_png):
    """Issue 46.2: the served model decoded it too."""
    status, answer = post({"inputs": {"image": [_b64(large_png)]}})
    assert status == 400, answer
    assert ("image row 0: 12000x12000 = 144,000,000 pixels, over the limit of 89,478,485 pixels"
            in answer["message"]), answer


def _refused(post, body: dict) -> str:
    """The message of the HTTP 400 answer to ``body``, which must carry no stack trace."""
    status, answer = post(body)
    assert status == 400 and "stack_trace" not in answer, answer
    assert "Traceback" not in answer["message"] and "site-packages" not in answer["message"]
    return answer["message"]


def test_served_model_refuses_malformed_requests_in_one_message(post, large_png):
    """Issue 46.3: each got HTTP 400 with a Python stack trace showing the server's paths."""
    b64 = _b64(large_png)[:40]
    expected = "a float32 [N, 1, 8, 8] tensor"
    assert "column(s) 'picture', but the model takes an \"image\" column" in \
        _refused(post, {"inputs": {"picture": [b64]}})
    for body in ({"inputs": [b64]}, {"instances": [b64]}, {"inputs": "hello"}):
        message = _refused(post, body)
        assert "input: text or objects (<U" in message and expected in message, message
        assert '"image" column' in message, message
    assert f"input: empty, expected {expected}" in _refused(post, {"inputs": []})
    for shape in ((2, 8, 8), (2, 3, 8, 8), (1, 1, 8, 8, 1)):
        message = _refused(post, {"inputs": np.zeros(shape).tolist()})
        assert f"input: a tensor of shape {list(shape)}, but the model takes {expected}" \
            in message, message


def test_served_model_checks_tensor_values_and_size(post):
    """Issue 46.4: a NaN pixel answered probability NaN (not strict JSON), a 0..255 tensor a
    confident wrong class, a 16x16 tensor on an 8x8 model an answer."""
    nan = np.zeros((1, 1, 8, 8))
    nan[0, 0, 3, 4] = np.nan
    for value in (np.nan, None):  # NaN (Python's json writes it), null
        message = _refused(post, {"inputs": np.where(np.isnan(nan), value, nan).tolist()})
        assert "input: a non-finite value (nan) at [0, 0, 3, 4]" in message, message
    pixels = np.random.default_rng(0).integers(0, 256, (2, 1, 8, 8)).astype(float)
    message = _refused(post, {"inputs": pixels.tolist()})
    assert "looks like 0-255 pixels: send normalized values or image files" in message, message
    for size in (4, 16):
        message = _refused(post, {"inputs": np.zeros((1, 1, size, size)).tolist()})
        assert f"shape [1, 1, {size}, {size}], but the model takes a float32 [N, 1, 8, 8]" \
            in message, message
    status, answer = post({"inputs": np.full((1, 1, 8, 8), 0.5).tolist()})  # normalized: fine
    assert status == 200 and len(answer["predictions"]) == 1, answer


def test_the_32_mib_limit_applies_to_the_encoded_value_before_decoding(monkeypatch):
    """Issue 46.6: the doc said "32 MiB encoded", the code measured the decoded bytes (a 40 MiB
    base64 value, 30 MiB of file, passed); now the value as sent is measured, before decoding."""
    import base64

    from stoker.tracking import served_input
    from stoker.tracking.served_input import MAX_IMAGE_BYTES, BadImageInput, decode_base64

    value = "A" * (MAX_IMAGE_BYTES + 4)  # valid base64 of 24 MiB of zero bytes
    decoded, b64decode = [], base64.b64decode
    monkeypatch.setattr(served_input.base64, "b64decode",
                        lambda *a, **k: decoded.append(1) or b64decode(*a, **k))
    with pytest.raises(BadImageInput, match=rf"image row 0: {MAX_IMAGE_BYTES + 4} bytes "
                       rf"encoded, over the limit of {MAX_IMAGE_BYTES} bytes"):
        decode_base64([value])
    assert not decoded
    assert decode_base64(["A" * 8]) == [bytes(6)]  # under the limit: decoded as before


def test_predict_of_an_unknown_alias_reads_as_one_sentence(gray_model, tmp_path):
    """Issue 46.7: 'Registered model alias nope not found.; registered models there: ...'."""
    _, uri, _ = gray_model
    image = big_png(tmp_path / "small.png", 8, 500)
    for model_uri, said in (("models:/scans@nope", "Registered model alias nope not found"),
                            ("models:/x@nope", "Registered Model with name=x not found")):
        done = predict(["--model-uri", model_uri, "--tracking-uri", uri, str(image)], tmp_path)
        assert done.returncode == 2, done.stderr[-3000:]
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"error: {model_uri}: {said}; registered models there: scans; "
                               "e.g. --model-uri models:/scans@champion ("), line
        assert ".;" not in line, line


def test_predict_reads_the_store_of_mlflow_tracking_uri(gray_model, tmp_path):
    """Issue 46.8: serve-model.md has the user export MLFLOW_TRACKING_URI; `stoker predict`
    from another folder then said `no MLflow store at work/mlflow.db`. --work-dir still wins."""
    _, uri, model_uri = gray_model
    image = big_png(tmp_path / "small.png", 8, 500)
    done = predict([str(image), "--model-uri", model_uri], tmp_path,
                   env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{image}\t"), done.stdout
    by_folder = predict([str(image), "--model-uri", model_uri, "-w", str(tmp_path / "none")],
                        tmp_path, env={"MLFLOW_TRACKING_URI": uri})
    assert by_folder.returncode == 2 and "no MLflow store at" in by_folder.stderr
