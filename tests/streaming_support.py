"""A small generated ImageFolder of mixed-size RGB images for the streaming dataset tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_rgb_folder(root: Path, classes: int = 2, per_class: int = 40, seed: int = 0,
                    sides: tuple[int, int] = (10, 21)) -> Path:
    """``root/c<k>/<i>.png`` RGB images of ``sides`` [low, high) px per side; class k is
    brighter in channel k (learnable at any size and crop)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k in range(classes):
        folder = root / f"c{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(*sides, size=2))
            pixels = rng.integers(0, 120, size=(h, w, 3), dtype=np.uint8)
            pixels[:, :, k % 3] += 120
            Image.fromarray(pixels, mode="RGB").save(folder / f"{i:03d}.png")
    return root
