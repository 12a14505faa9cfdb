"""What the served model accepts: encoded image files (base64) besides float32 tensors.

A request to ``mlflow models serve`` of a Stoker model may carry the image *files* (PNG, JPEG,
TIFF, ... as the user has them), base64-encoded in an ``image`` column:

    {"dataframe_records": [{"image": "iVBORw0KGgo..."}]}
    {"inputs": {"image": ["iVBORw0KGgo...", "..."]}}

The model decodes them with the one rule of :mod:`stoker.runtime.pixels` and preprocesses them
as training validated (:func:`stoker.tracking.pyfunc.preprocess_images`), so the served answer is
``stoker predict``'s answer for the same file. A float32 [N, C, H, W] tensor (``{"inputs":
[...]}``) is still taken as it is. The server reads no file path from a request: a path names a
file of the server's machine, which a caller must not choose.

Request bytes are untrusted: a value that is not base64 or not an image is refused with one
line naming its row, before any image of the request is classified.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

IMAGE_COLUMN = "image"
# An image value longer than this (base64 text as sent, about 24 MiB of file; or a file's own
# bytes in process) is refused before it is base64-decoded: its length is free to check.
MAX_IMAGE_BYTES = 32 * 1024 * 1024


class BadImageInput(ValueError):
    """A served request's image value cannot be used (the message names its row)."""


def encoded_images(model_input) -> list | None:
    """The base64 values of ``model_input``'s ``image`` column, or None for a tensor.

    Args:
        model_input: what MLflow's scoring server (or ``PyFuncModel.predict``) passes on: a
            pandas DataFrame, a dict of columns, or an array.

    Returns:
        The column's values in row order, or None when ``model_input`` has no ``image`` column.
    """
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        return list(model_input[IMAGE_COLUMN]) if IMAGE_COLUMN in model_input.columns else None
    if isinstance(model_input, dict) and IMAGE_COLUMN in model_input:
        return list(np.atleast_1d(np.asarray(model_input[IMAGE_COLUMN], dtype=object)))
    return None


def decode_base64(values: list) -> list[bytes]:
    """Base64 values (``str`` or ``bytes``; raw ``bytes`` of an image file that are not base64
    pass as they are) -> file bytes.

    Args:
        values: one value per image.

    Returns:
        The encoded image files, in order.

    Raises:
        BadImageInput: a value is longer than ``MAX_IMAGE_BYTES`` as sent (checked first),
            is not base64 text, or is empty.
    """
    files = []
    for row, value in enumerate(values):
        if isinstance(value, (str, bytes, bytearray)):
            if len(value) > MAX_IMAGE_BYTES:  # encoded, as sent: before any decoding
                raise BadImageInput(f"image row {row}: {len(value)} bytes encoded, over the "
                                    f"limit of {MAX_IMAGE_BYTES} bytes")
            try:
                data = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as e:
                if not (isinstance(value, (bytes, bytearray)) and _looks_like_image(value)):
                    raise BadImageInput(f"image row {row}: not base64 ({e})") from e
                data = bytes(value)  # the file's own bytes (in process, not over JSON)
        else:
            raise BadImageInput(f"image row {row}: a {type(value).__name__}, expected base64 "
                                "text of an image file")
        if not data:
            raise BadImageInput(f"image row {row}: empty")
        files.append(data)
    return files


def _looks_like_image(data: bytes) -> bool:
    """Whether ``data`` starts like an image file rather than base64 text (PNG, JPEG, GIF,
    TIFF, BMP, WebP signatures)."""
    return data.startswith((b"\x89PNG", b"\xff\xd8", b"GIF8", b"II*\x00", b"MM\x00*", b"BM",
                            b"RIFF"))


def images_to_batch(files: list[bytes], preprocessing: dict, preprocess) -> np.ndarray:
    """Encoded image files -> the model's float32 [N, C, H, W], by ``preprocess``.

    Args:
        files: encoded image files (from :func:`decode_base64`).
        preprocessing: the model's ``preprocessing`` metadata.
        preprocess: :func:`stoker.tracking.pyfunc.preprocess_images` (passed in: this module
            imports nothing of the model).

    Returns:
        float32 [N, C, H, W].

    Raises:
        BadImageInput: a file is not an image Pillow can decode, has more than
            ``stoker.predict_checks.MAX_IMAGE_PIXELS`` pixels, or its channels do not fit
            the model (gray on a colour model or the converse, as ``stoker predict`` refuses);
            the row is named.
    """
    from PIL import Image

    from stoker.predict_checks import UnusableImage, channel_mismatch, image_header

    batch = []
    for row, data in enumerate(files):
        try:  # the header first: an image over the pixel limit is never decoded
            mode = image_header(io.BytesIO(data), f"image row {row}")
            wrong = channel_mismatch(mode, int(preprocessing["channels"]), "the model")
            if wrong is None:
                batch.append(preprocess([io.BytesIO(data)], preprocessing)[0])
        except UnusableImage as e:
            raise BadImageInput(str(e)) from e
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise BadImageInput(f"image row {row}: not a readable image "
                                f"({str(e).splitlines()[0][:200]})") from e
        if wrong:  # as `stoker predict` refuses it: the same file gets the same answer
            raise BadImageInput(f"image row {row}: {wrong}")
    if not batch:
        raise BadImageInput("image: no rows")
    return np.stack(batch).astype(np.float32)


def served_signature(inferred):
    """The served signature: ``inferred``'s outputs and params, no input schema.

    MLflow enforces one input schema, a tensor *or* columns; the model takes both (a float32
    tensor or an ``image`` column), so the input is checked by the model itself
    (:func:`encoded_images`, :func:`decode_base64`) and documented in its ``stoker`` metadata
    (``inputs``).

    Args:
        inferred: ``mlflow.models.infer_signature(tensor_example, output, params)``.

    Returns:
        A ``mlflow.models.ModelSignature``.
    """
    from mlflow.models import ModelSignature

    return ModelSignature(inputs=None, outputs=inferred.outputs, params=inferred.params)
