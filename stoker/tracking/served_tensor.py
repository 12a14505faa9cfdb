"""What the served model checks of a request that is not image files, before it classifies any.

A request is untrusted: a column other than ``image``, text where numbers belong, or a tensor of
another rank, channel count or size than the model's is refused with one line naming what is
wrong and what the model takes, never a stack trace.
"""

from __future__ import annotations

import numpy as np

IMAGE_HINT = 'image files go base64-encoded in an "image" column: {"inputs": {"image": [...]}}'


class BadTensorInput(ValueError):
    """A served request's tensor cannot be used (the message says what is wrong)."""


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
            [N, C, H, W] of the model.
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
    if values.dtype.kind not in "biuf":
        raise BadTensorInput(f"input: text or objects ({values.dtype}), expected {expected}; "
                             f"{IMAGE_HINT}")
    if values.size == 0:
        raise BadTensorInput(f"input: empty, expected {expected}")
    if values.ndim != 4 or values.shape[1:] != shape:
        raise BadTensorInput(f"input: a tensor of shape {list(values.shape)}, but the model "
                             f"takes {expected} ({shape[0]} channel(s) of {shape[1]}x{shape[2]} "
                             "pixels)")
    return values.astype(np.float32)


def _columns(model_input) -> list[str] | None:
    """The column names of a DataFrame or a dict input, or None for an array or a list."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        return [str(c) for c in model_input.columns]
    if isinstance(model_input, dict):
        return [str(c) for c in model_input]
    return None
