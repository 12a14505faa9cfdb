"""Built-in models and the ``module:callable`` hook for users' own."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stoker.runtime.vision import VISION_MODELS, vision_problem


class SmallCNN(nn.Module):
    """A small CNN for tiny images (e.g. 8x8 digits).

    Input [N, C, H, W] float (H, W divisible by 2); output logits [N, num_classes].
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 16, 128), nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and self.training:
            # Recompute the conv activations in backward: trades compute for memory.
            features = checkpoint(self.features, x, use_reentrant=False)
        else:
            features = self.features(x)
        return self.head(features)


def _resnet(name: str, num_classes: int, in_channels: int) -> nn.Module:
    problem = vision_problem(name)
    if problem:
        raise ModelError(problem)
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


class ModelError(ValueError):
    """The configured model cannot be built."""


def build_model(name: str, num_classes: int, in_channels: int,
                activation_checkpointing: bool = False) -> nn.Module:
    """Build a model by name: small_cnn, resnet18/34/50, or 'module:callable'.

    A user callable receives ``num_classes`` and ``in_channels`` as keywords and returns an
    ``nn.Module`` mapping [N, C, H, W] to logits [N, num_classes].

    Raises:
        ModelError: unknown name, import failure (for resnet*: torchvision, the ``vision``
            extra), or a callable that returns no nn.Module.
    """
    if name == "small_cnn":
        return SmallCNN(num_classes, in_channels, activation_checkpointing)
    if name in VISION_MODELS:
        return _resnet(name, num_classes, in_channels)
    module, _, attr = name.partition(":")
    if not attr:
        raise ModelError(
            f"train.model {name!r}: unknown; use small_cnn, resnet18, resnet34, resnet50 "
            "or 'module:callable'"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ModelError(f"train.model {name!r}: cannot import ({e})") from None
    model = fn(num_classes=num_classes, in_channels=in_channels)
    if not isinstance(model, nn.Module):
        raise ModelError(f"train.model {name!r}: returned {type(model).__name__}, not nn.Module")
    return model
