"""The one decoding rule (stoker.runtime.pixels): training, the folder loader and predict /
the served model see the same upright, range-scaled pixels (issue 46)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from stoker.runtime.data import read_image
from stoker.runtime.imagefolder import open_image
from stoker.tracking.pyfunc import preprocess_images

ORIENTATION = 0x0112
ROTATE_90_CW = 6  # EXIF: the stored pixels must be turned 90 degrees clockwise to display


def _prep(channels: int, height: int, width: int) -> dict:
    return {"layout": "NCHW", "channels": channels, "height": height, "width": width,
            "color_mode": "L" if channels == 1 else "RGB", "scale": 1.0 / 255.0,
            "mean": [0.0] * channels, "std": [1.0] * channels}


def _three_ways(path, channels: int, height: int, width: int) -> list[np.ndarray]:
    """uint8 [H, W, C] pixels of ``path`` as training, the loader and predict decode it."""
    training = np.asarray(open_image(path, channels), dtype=np.uint8).reshape(height, width, -1)
    loader = read_image(path, channels)
    served = preprocess_images([path], _prep(channels, height, width))[0]
    predict = np.rint(served.transpose(1, 2, 0) * 255.0).astype(np.uint8)
    return [training, loader, predict]


def test_exif_rotated_jpeg_is_decoded_upright(tmp_path):
    stored = np.zeros((10, 20, 3), dtype=np.uint8)  # 20 wide, 10 tall, left half white
    stored[:, :10] = 255
    exif = Image.Exif()
    exif[ORIENTATION] = ROTATE_90_CW
    path = tmp_path / "phone.jpg"
    Image.fromarray(stored).save(path, quality=95, exif=exif)

    for pixels in _three_ways(path, 3, 20, 10):  # upright: 10 wide, 20 tall, top half white
        assert pixels.shape == (20, 10, 3)
        assert pixels[:8].mean() > 240 and pixels[12:].mean() < 15


def test_16_bit_png_at_40000_is_scaled_not_clipped(tmp_path):
    path = tmp_path / "depth.png"
    Image.fromarray(np.full((8, 8), 40000, dtype=np.uint16)).save(path)
    expected = round(40000 * 255 / 65535)  # 156; Pillow's own convert clips it to 255

    for pixels in _three_ways(path, 1, 8, 8):
        assert np.all(pixels == expected)


@pytest.mark.parametrize("mode, values, expected", [
    ("I", [0, 65535], [0, 255]),            # how Pillow may open a 16-bit PNG
    ("I", [-100, 100], [0, 255]),           # outside 16 bits: its own range
    ("F", [0.0, 0.5], [0, 128]),            # float in 0..1
    ("F", [-1.0, 3.0], [0, 255]),           # float elsewhere: its own range
])
def test_deep_modes_are_scaled_by_their_range(tmp_path, mode, values, expected):
    path = tmp_path / "deep.tiff"
    dtype = np.int32 if mode == "I" else np.float32
    Image.fromarray(np.asarray([values], dtype=dtype), mode=mode).save(path)
    assert read_image(path, 1)[0, :, 0].tolist() == expected


def test_transparency_is_composited_onto_black(tmp_path):
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[..., :3] = 200      # a colour hidden under full transparency ...
    rgba[0, 0, 3] = 255      # ... except one opaque pixel
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "a.png")
    palette = Image.fromarray(rgba, mode="RGBA").convert("P")
    palette.info["transparency"] = palette.getpixel((1, 1))
    palette.save(tmp_path / "p.png", transparency=palette.getpixel((1, 1)))

    for name in ("a.png", "p.png"):
        pixels = read_image(tmp_path / name, 3)
        assert pixels[0, 0].tolist() == [200, 200, 200], name
        assert pixels[1, 1].tolist() == [0, 0, 0], name


def test_cmyk_and_gray_alpha_decode_to_the_asked_channels(tmp_path):
    Image.new("CMYK", (3, 2), (0, 0, 0, 0)).save(tmp_path / "c.jpg", quality=100)
    Image.new("LA", (3, 2), (120, 255)).save(tmp_path / "la.png")
    assert read_image(tmp_path / "c.jpg", 3).shape == (2, 3, 3)
    assert read_image(tmp_path / "c.jpg", 3).min() > 245  # no ink: white
    assert read_image(tmp_path / "la.png", 1)[..., 0].tolist() == [[120] * 3] * 2
