"""Sample grids as PNG files (Pillow)."""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np
from PIL import Image


def image_grid(images: np.ndarray, num_classes: int, *, pad: int = 1) -> np.ndarray:
    """Tile class-valued images [count, height, width, channels] into one uint8 grid image,
    nearly square."""
    images = np.asarray(images)
    n, h, w, c = images.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * (h + pad) + pad, cols * (w + pad) + pad, c), np.uint8)
    pixels = np.round(images.astype(np.float64) * 255.0 / (num_classes - 1)).astype(np.uint8)
    for i in range(n):
        r, q = divmod(i, cols)
        top, left = pad + r * (h + pad), pad + q * (w + pad)
        grid[top : top + h, left : left + w] = pixels[i]
    return grid


def save_image_grid(path, images, num_classes: int, *, scale: int = 1) -> pathlib.Path:
    """Write a PNG grid of the images; `scale` enlarges small images (nearest neighbour). The
    file appears whole or not at all (a resumed trainer rewrites only a missing one)."""
    grid = image_grid(images, num_classes)
    if scale > 1:
        grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid).save(partial, format="PNG")
    os.replace(partial, path)
    return path
