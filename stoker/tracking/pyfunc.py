"""The registered model: an MLflow pyfunc that answers class names and probabilities.

The class list and the preprocessing (size, channels, scaling, normalisation) are stored with the
model (``stoker.json`` artifact and the MLmodel metadata), so ``stoker predict``, ``mlflow models
serve`` and ``mlflow.pyfunc.load_model`` all answer ``four``, not ``0``.

Input: float32 [N, C, H, W], scaled to [0, 1] then normalised with the training mean/std
(``preprocess_images`` makes it from image files exactly as validation does in training: the whole
image resized to the training size, no augmentation).
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
    }


def preprocess_images(paths: list[Path], preprocessing: dict) -> np.ndarray:
    """Image files -> float32 [N, C, H, W] as in training (mode, size, scale, normalisation).

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

    def predict(self, context, model_input: np.ndarray, params=None):
        import pandas as pd

        logits = self.logits(model_input)
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
