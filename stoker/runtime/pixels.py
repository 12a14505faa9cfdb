"""The one rule that turns any image file's pixels into ``L`` or ``RGB`` bytes.

Training (:func:`stoker.runtime.imagefolder.open_image`), the whole-folder loader
(:func:`stoker.runtime.data.read_image`), ``stoker predict`` and the served model
(:mod:`stoker.tracking.pyfunc`) all decode through :func:`to_model_mode`, so they cannot disagree:

1. EXIF orientation is applied (``PIL.ImageOps.exif_transpose``): a phone photo is upright.
2. 16-bit modes (``I;16``, ``I;16L``, ``I;16B``, ``I;16N``) are scaled from 0..65535 to 0..255.
   ``I`` (32-bit integer) is scaled the same way when its values lie in 0..65535 (how Pillow
   opens some 16-bit PNGs), else from its own min..max. ``F`` (32-bit float) is scaled from 0..1
   when its values lie there, else from its own min..max. Nothing is clipped.
3. Transparency (``LA``, ``RGBA``, ``PA``, a palette or ``L``/``RGB`` image with a transparent
   colour) is composited onto black: what hides under a transparent pixel is not learned.
4. Palette, CMYK, YCbCr, LAB, HSV and 1-bit images are converted by Pillow.
5. One channel is the ITU-R 601-2 luma of colour (Pillow's ``L``); three channels repeat gray.

No module-level Pillow import: the runtime imports this in every DataLoader worker.
"""

from __future__ import annotations

import numpy as np

SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
MAX_16 = 65535.0


def _scaled(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """``values`` mapped linearly from ``low..high`` to uint8 0..255 (rounded; flat: 0)."""
    if high <= low:
        return np.zeros(values.shape, dtype=np.uint8)
    out = (values.astype(np.float64) - low) * (255.0 / (high - low))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def _deep_to_l(image):
    """A 16-bit, 32-bit integer or float image -> ``L`` scaled by its range (rule 2)."""
    from PIL import Image

    values = np.asarray(image)
    if image.mode in SIXTEEN_BIT:
        low, high = 0.0, MAX_16
    elif values.size == 0:
        low, high = 0.0, 1.0
    else:
        vmin, vmax = float(np.nanmin(values)), float(np.nanmax(values))
        if image.mode == "F" and vmin >= 0.0 and vmax <= 1.0:
            low, high = 0.0, 1.0
        elif image.mode == "I" and vmin >= 0 and vmax <= MAX_16:
            low, high = 0.0, MAX_16
        else:
            low, high = vmin, vmax
    return Image.fromarray(_scaled(np.nan_to_num(values), low, high), mode="L")


def _flattened(image):
    """An image with transparency -> ``RGB`` or ``L`` composited onto black (rule 3)."""
    from PIL import Image

    gray = image.mode in ("LA", "La") or (image.mode == "L" and "transparency" in image.info)
    mode = "L" if gray else "RGB"
    with_alpha = image.convert("LA" if gray else "RGBA")
    flat = Image.new(mode, image.size, 0)
    flat.paste(with_alpha.convert(mode), mask=with_alpha.getchannel("A"))
    return flat


def has_alpha(image) -> bool:
    """Whether ``image`` (a PIL image) carries transparency."""
    return image.mode in ("LA", "La", "RGBA", "RGBa", "PA") or "transparency" in image.info


def to_model_mode(image, channels: int):
    """A freshly opened PIL image -> ``L`` (``channels`` 1) or ``RGB`` (3) by the module's rule.

    Args:
        image: a PIL image as ``Image.open`` returned it (its EXIF still attached).
        channels: 1 or 3.

    Returns:
        A loaded PIL image in mode ``L`` or ``RGB``, upright.

    Raises:
        OSError: the pixels cannot be decoded.
    """
    from PIL import ImageOps

    target = "L" if channels == 1 else "RGB"
    image = ImageOps.exif_transpose(image) or image
    if image.mode in SIXTEEN_BIT or image.mode in ("I", "F"):
        image = _deep_to_l(image)
    elif has_alpha(image):
        image = _flattened(image)
    return image if image.mode == target else image.convert(target)
