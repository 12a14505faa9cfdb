"""The registered model: an MLflow pyfunc that answers class names and probabilities.

The class list and the preprocessing (size, channels, scaling, normalisation) are stored with the
model (``stoker.json`` artifact and the MLmodel metadata), so ``stoker predict``, ``mlflow models
serve`` and ``mlflow.pyfunc.load_model`` all answer ``four``, not ``0``.

Input: float32 [N, C, H, W], scaled to [0, 1] then normalised with the training mean/std
(``preprocess_images`` makes it from image files exactly as validation does in training: the whole
image resized to the training size, no augmentation); or an ``image`` column of base64-encoded
image files, which the model decodes and preprocesses itself by the same function
(:mod:`stoker.tracking.served_input`).
Output: a DataFrame with ``class`` (name), ``probability`` (of that class) and ``p_<class>`` per
class; with ``params={"logits": True}`` also ``logit_<class>`` per class.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc
import numpy as np

# The signature is given explicitly (a tensor input). `model_input: np.ndarray` is a type hint
# MLflow accepts without inferring a schema from it (no "Add type hints" warning at every load).


def model_meta(result: dict) -> dict:
    """What the pyfunc needs from a training ``result.json``: architecture, classes, and the
    preprocessing that turns an image file into the model's input."""
    channels, height, width = (int(v) for v in result["input_shape"])
    return {
        "model": result["model"],
        "classes": list(result["classes"]),
        "preprocessing": {
            "layout": "NCHW", "channels": channels, "height": height, "width": width,
            "color_mode": "L" if channels == 1 else "RGB", "scale": 1.0 / 255.0,
            "mean": list(result.get("image_mean") or [0.0] * channels),
            "std": list(result.get("image_std") or [1.0] * channels),
        },
        # What the served model takes (stoker.tracking.served_input): a float32 [N, C, H, W]
        # tensor, or an "image" column of base64-encoded image files.
        "inputs": {"tensor": "float32 [N, C, H, W], preprocessed",
                   "image": "base64 of an image file (PNG, JPEG, ...)"},
    }


def preprocess_images(paths: list, preprocessing: dict) -> np.ndarray:
    """Image files -> float32 [N, C, H, W] as in training (mode, size, scale, normalisation).

    Args:
        paths: image file paths, or binary file objects of encoded images.
        preprocessing: the model's ``preprocessing`` metadata (:func:`model_meta`).

    Returns:
        float32 [N, C, H, W].

    Raises:
        OSError, PIL.UnidentifiedImageError: a file is not a readable image.
    """
    from PIL import Image

    from stoker.runtime.pixels import to_model_mode

    size = (preprocessing["width"], preprocessing["height"])
    mean = np.asarray(preprocessing["mean"], dtype=np.float32)[:, None, None]
    std = np.asarray(preprocessing["std"], dtype=np.float32)[:, None, None]
    batch = []
    for path in paths:
        with Image.open(path) as image:
            image = to_model_mode(image, 1 if preprocessing["color_mode"] == "L" else 3)
            if image.size != size:
                image = image.resize(size, Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32) * preprocessing["scale"]
        pixels = pixels.reshape(size[1], size[0], -1).transpose(2, 0, 1)
        batch.append((pixels - mean) / std)
    return np.stack(batch).astype(np.float32)


class ImageClassifier(mlflow.pyfunc.PythonModel):
    """Pyfunc wrapper of a trained Stoker classifier (weights + ``stoker.json`` artifacts)."""

    def load_context(self, context) -> None:
        import torch

        from stoker.runtime.models import build_model

        meta = json.loads(Path(context.artifacts["meta"]).read_text())
        self.classes = list(meta["classes"])
        self.preprocessing = meta["preprocessing"]
        channels = meta["preprocessing"]["channels"]
        self.model = build_model(meta["model"], len(self.classes), channels)
        state = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        self.model.load_state_dict(state, strict=True)
        self.model.eval()

    def logits(self, batch: np.ndarray) -> np.ndarray:
        """float32 [N, C, H, W] -> logits [N, num_classes]."""
        import torch

        with torch.no_grad():
            return self.model(torch.as_tensor(np.asarray(batch, dtype=np.float32))).numpy()

    def batch(self, model_input) -> np.ndarray:
        """The model's float32 [N, C, H, W] from a tensor or an ``image`` column of base64 files.

        Raises:
            mlflow.exceptions.MlflowException: an image value or the tensor is unusable (HTTP
                400 when served; the message names the row or what the model takes).
        """
        from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

        from stoker.tracking import served_input, served_tensor

        values = served_input.encoded_images(model_input)
        try:
            if values is None:
                return served_tensor.tensor_batch(model_input, self.preprocessing)
            return served_input.images_to_batch(served_input.decode_base64(values),
                                                self.preprocessing, preprocess_images)
        except (served_input.BadImageInput, served_tensor.BadTensorInput) as e:
            # INVALID_PARAMETER_VALUE: HTTP 400 with this message only, no stack trace
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from e

    def predict(self, context, model_input: np.ndarray, params=None):
        import pandas as pd

        logits = self.logits(self.batch(model_input))
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = shifted / shifted.sum(axis=1, keepdims=True)
        best = probs.argmax(axis=1)
        out = {"class": [self.classes[i] for i in best],
               "probability": probs[np.arange(len(best)), best].astype(np.float64)}
        out.update({f"p_{name}": probs[:, i].astype(np.float64)
                    for i, name in enumerate(self.classes)})
        if (params or {}).get("logits"):
            out.update({f"logit_{name}": logits[:, i].astype(np.float64)
                        for i, name in enumerate(self.classes)})
        return pd.DataFrame(out)
