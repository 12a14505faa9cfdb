"""The served model's input checks, without a server (stoker.tracking.served_input)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from stoker.tracking.pyfunc import preprocess_images
from stoker.tracking.served_input import (
    BadImageInput,
    decode_base64,
    encoded_images,
    images_to_batch,
)

GRAY = {"channels": 1, "height": 4, "width": 4, "color_mode": "L", "scale": 1 / 255,
        "mean": [0.0], "std": [1.0]}


def _png(mode: str, value) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (4, 4), value).save(out, format="PNG")
    return out.getvalue()


def test_the_image_column_is_found_in_a_frame_or_a_dict_and_a_tensor_passes():
    assert encoded_images(pd.DataFrame({"image": ["a", "b"]})) == ["a", "b"]
    assert encoded_images({"image": np.asarray(["a"])}) == ["a"]
    assert encoded_images(np.zeros((1, 1, 4, 4), np.float32)) is None


def test_base64_text_and_raw_file_bytes_decode_and_anything_else_names_its_row():
    png = _png("L", 7)
    assert decode_base64([base64.b64encode(png).decode(), png]) == [png, png]
    for bad, words in (("not base64!", "image row 1: not base64"), (3, "image row 1: a int"),
                       ("", "image row 1: empty")):
        with pytest.raises(BadImageInput, match=words):
            decode_base64([base64.b64encode(png).decode(), bad])


def test_a_16_bit_file_is_scaled_as_in_training_and_a_colour_one_is_refused_by_a_gray_model():
    deep = _png("I;16", 40000)
    batch = images_to_batch([deep], GRAY, preprocess_images)
    assert batch.shape == (1, 1, 4, 4) and np.allclose(batch, 156 / 255)  # not clipped to 1
    with pytest.raises(BadImageInput, match=r"image row 1: a colour \(3 channels\) image"):
        images_to_batch([deep, _png("RGB", (1, 2, 3))], GRAY, preprocess_images)
    with pytest.raises(BadImageInput, match="image row 0: not a readable image"):
        images_to_batch([b"\x89PNG but not"], GRAY, preprocess_images)
