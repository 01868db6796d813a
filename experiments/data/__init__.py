"""Image data sets for the experiments: TFDS `array_record` builders (no TensorFlow) and step-indexed batches.

Importing this package does not import TFDS; `load_images` does, when it needs to.
"""

from experiments.data.pipeline import (
    DATASETS,
    SPLITS,
    Batches,
    DatasetInfo,
    dataset_info,
    default_manual_dir,
    flatten_images,
    load_images,
    num_classes,
    unflatten,
)

__all__ = [
    "DATASETS",
    "SPLITS",
    "Batches",
    "DatasetInfo",
    "dataset_info",
    "default_manual_dir",
    "flatten_images",
    "load_images",
    "num_classes",
    "unflatten",
]
