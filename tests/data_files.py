"""Data set files as their publishers ship them, small and random, written where a test asks."""

import gzip
import os

import numpy as np

from experiments.data import builders

MNIST_SIZES = {"train": 7, "test": 5}


def write_idx(path, array, gz):
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    raw = header + np.ascontiguousarray(array, np.uint8).tobytes()
    if gz:
        path = str(path) + ".gz"
        raw = gzip.compress(raw)
    with open(path, "wb") as f:
        f.write(raw)


def write_mnist(folder, splits=("train", "test"), gz=True, seed=0):
    """Writes random IDX files; returns {split: (images [n, 28, 28], labels [n])}."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    written = {}
    for split in splits:
        n = MNIST_SIZES[split]
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, (n,), dtype=np.uint8)
        images_stem, labels_stem = builders.MNIST_FILES[split]
        write_idx(os.path.join(folder, images_stem), images, gz)
        write_idx(os.path.join(folder, labels_stem), labels, gz)
        written[split] = (images, labels)
    return written
