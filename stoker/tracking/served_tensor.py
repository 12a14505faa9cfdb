"""What the served model checks of a request that is not image files, before it classifies any.

A request is untrusted: a column other than ``image``, text where numbers belong, a tensor of
another rank, channel count or size than the model's, a non-finite value, or values far outside
the normalized range the model was trained with (0-255 pixels sent as they are) is refused with
one line naming what is wrong and what the model takes. Nothing is answered for such a request:
a NaN would answer a NaN probability (not JSON), 0-255 pixels a confident wrong class, a 16x16
tensor on a 32x32 model a class of an image the model never saw the like of.
"""

from __future__ import annotations

import contextlib

import numpy as np

# A tensor value beyond FAR times the largest magnitude a normalized pixel can take is refused
# (0-255 pixels sent without scaling and normalisation are 100 to 1000 times beyond it).
FAR = 4.0
IMAGE_HINT = 'image files go base64-encoded in an "image" column: {"inputs": {"image": [...]}}'


class BadTensorInput(ValueError):
    """A served request's tensor cannot be used (the message says what is wrong)."""


def normalized_range(preprocessing: dict) -> tuple[float, float]:
    """The lowest and highest value a preprocessed pixel can take, over the channels.

    Args:
        preprocessing: the model's ``preprocessing`` metadata (``mean``, ``std``: per channel,
            of pixels scaled to 0..1).

    Returns:
        (low, high): ``(0 - mean) / std`` and ``(1 - mean) / std``, the extremes over channels.
    """
    mean = np.asarray(preprocessing["mean"], dtype=np.float64)
    std = np.asarray(preprocessing["std"], dtype=np.float64)
    return float(np.min(-mean / std)), float(np.max((1.0 - mean) / std))


def tensor_batch(model_input, preprocessing: dict) -> np.ndarray:
    """A request's tensor -> the model's float32 [N, C, H, W], checked.

    Args:
        model_input: what the scoring server parsed from the request (an array, a list, a dict
            of columns or a DataFrame) that has no ``image`` column.
        preprocessing: the model's ``preprocessing`` metadata (``channels``, ``height``,
            ``width``, ``mean``, ``std``).

    Returns:
        float32 [N, C, H, W].

    Raises:
        BadTensorInput: named columns, text, an empty or ragged input, a shape other than
            [N, C, H, W] of the model, a non-finite value, or values beyond ``FAR`` times the
            normalized range.
    """
    shape = tuple(int(preprocessing[k]) for k in ("channels", "height", "width"))
    expected = f"a float32 [N, {shape[0]}, {shape[1]}, {shape[2]}] tensor"
    columns = _columns(model_input)
    if columns is not None:
        raise BadTensorInput(f"input: column(s) {', '.join(map(repr, columns[:5]))}, but the "
                             f"model takes an \"image\" column of base64 image files or "
                             f"{expected}")
    try:
        values = np.asarray(model_input)
    except ValueError as e:  # ragged nested lists
        raise BadTensorInput(f"input: not a rectangular array ({e}); expected {expected}") from e
    if values.dtype.kind == "O":  # JSON null among numbers: NaN, refused below as non-finite
        with contextlib.suppress(TypeError, ValueError):  # text stays text: refused next
            values = np.asarray(values, dtype=np.float64)
    if values.dtype.kind not in "biuf":
        raise BadTensorInput(f"input: text or objects ({values.dtype}), expected {expected}; "
                             f"{IMAGE_HINT}")
    if values.size == 0:
        raise BadTensorInput(f"input: empty, expected {expected}")
    if values.ndim != 4 or values.shape[1:] != shape:
        raise BadTensorInput(f"input: a tensor of shape {list(values.shape)}, but the model "
                             f"takes {expected} ({shape[0]} channel(s) of {shape[1]}x{shape[2]} "
                             "pixels)")
    return checked_values(values.astype(np.float32), preprocessing)


def checked_values(batch: np.ndarray, preprocessing: dict) -> np.ndarray:
    """``batch`` when its values are finite and within ``FAR`` times the normalized range.

    Raises:
        BadTensorInput: a NaN or infinite value (its index named), or values far outside the
            normalized range the model was trained with.
    """
    finite = np.isfinite(batch)
    if not finite.all():
        index = [int(i) for i in np.argwhere(~finite)[0]]
        raise BadTensorInput(f"input: a non-finite value ({batch[tuple(index)]}) at {index}; "
                             "every value must be a finite number")
    low, high = normalized_range(preprocessing)
    limit = FAR * max(abs(low), abs(high))
    peak = float(np.abs(batch).max())
    if peak > limit:
        raise BadTensorInput(
            f"input: values up to {peak:g} in magnitude, but the model was trained on "
            f"normalized values in {low:.2f}..{high:.2f} (refused beyond {limit:.2f}): looks "
            "like 0-255 pixels: send normalized values or image files")
    return batch


def _columns(model_input) -> list[str] | None:
    """The column names of a DataFrame or a dict input, or None for an array or a list."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        return [str(c) for c in model_input.columns]
    if isinstance(model_input, dict):
        return [str(c) for c in model_input]
    return None
