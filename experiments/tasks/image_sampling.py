"""Generate images, timed: from a training workdir's checkpoint, or from a model trained with the
authors' library (pytorch-fast-transformers)."""

from __future__ import annotations

import math
import pathlib
import time

import jax
import numpy as np

from experiments.data import pipeline
from experiments.tasks import images
from experiments.tasks.image_generation import ImageGeneration
from experiments.training.restore import load_config, restore_trainer
from linear_transformers import interop
from linear_transformers.image_generator import sample_images, sample_images_full_recompute

METHODS = {"recurrent": sample_images, "recompute": sample_images_full_recompute}


def sample_from_workdir(
    workdir,
    *,
    num_images: int = 16,
    prefix_pixels: int = 0,
    method: str = "recurrent",
    seed: int = 0,
    step: int | None = None,
    out=None,
) -> dict:
    """Generate `num_images` images (completing the first `prefix_pixels` sub-pixels of test
    images when > 0) and write a PNG grid; return path, timing and the images."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}.")
    config = load_config(workdir)
    if config.get("task", ImageGeneration.name) != ImageGeneration.name:
        raise ValueError(
            f"workdir {workdir} trained the task {config.task!r}; sampling generates images, from "
            f"a workdir of the task {ImageGeneration.name!r} (configs/digits.py, mnist.py, cifar10.py)."
        )
    info = pipeline.dataset_info(config.dataset)
    length = math.prod(info.image_shape)
    if not 0 <= prefix_pixels < length:
        raise ValueError(f"prefix_pixels must be in [0, {length}), got {prefix_pixels}.")
    trainer, step = restore_trainer(workdir, config, ImageGeneration(config), step=step)
    model = trainer.eval_model()
    prefix = _test_prefix(
        config.dataset,
        num_images,
        prefix_pixels,
        data_dir=config.data_dir,
        manual_dir=config.manual_dir or None,
    )
    path = (
        pathlib.Path(out)
        if out
        else (
            pathlib.Path(workdir).expanduser()
            / "samples"
            / f"sample_{method}_step{step}_k{prefix_pixels}.png"
        )
    )
    result = _timed_sample(model, jax.random.key(seed), num_images, prefix, method, path, info)
    return {**result, "step": step}


def _test_prefix(dataset: str, num_images: int, prefix_pixels: int, *, data_dir, manual_dir):
    """The first `prefix_pixels` sub-pixels of the first test images, [N, k] int32, or None."""
    if not prefix_pixels:
        return None
    test = pipeline.flatten_images(
        pipeline.load_images(dataset, "test", data_dir=data_dir, manual_dir=manual_dir, download=False)
    )
    return test[:num_images, :prefix_pixels].astype(np.int32)


def _timed_sample(model, key, num_images: int, prefix, method: str, path: pathlib.Path, info) -> dict:
    """Sample (compiled first, then timed), write a PNG grid at `path`."""
    if prefix is not None:
        num_images = len(prefix)
    sample = METHODS[method]
    jax.block_until_ready(sample(model, key, num_images, prefix=prefix))  # compile
    start = time.perf_counter()
    images_BT = np.asarray(jax.block_until_ready(sample(model, key, num_images, prefix=prefix)))
    seconds = time.perf_counter() - start
    images.save_image_grid(
        path,
        images_BT.reshape(-1, *info.image_shape),
        info.num_classes,
        scale=max(1, 128 // info.image_shape[0]),
    )
    return {
        "path": str(path),
        "num_images": num_images,
        "seconds": seconds,
        "images_per_sec": num_images / seconds,
        "method": method,
        "images": images_BT,
    }


def sample_from_fast_transformers(
    checkpoint,
    *,
    attention_type: str = "linear",
    n_heads: int = 8,
    num_images: int = 16,
    prefix_pixels: int = 1,
    method: str = "recurrent",
    seed: int = 0,
    out=None,
    dataset: str = "mnist",
    data_dir="~/tensorflow_datasets",
    manual_dir=None,
) -> dict:
    """Complete test images with a model trained by the authors' library: their demo's
    `Generator` / `RecurrentGenerator` state dict (.pth, or .npz of the same arrays), converted
    by `interop.image_generator_from_fast_transformers`.

    As in their demo, the first `prefix_pixels` (>= 1: their model has no distribution for the
    first sub-pixel) sub-pixels of each of the first `num_images` test images are kept and the
    rest drawn. attention_type ("linear" or "full") and n_heads are not in the weights: the
    demo's models have 8 heads.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}.")
    if attention_type not in ("linear", "causal-linear", "full"):
        raise ValueError(
            f"attention_type must be 'linear', 'causal-linear' or 'full' (the "
            f"demo's models), got {attention_type!r}."
        )
    info = pipeline.dataset_info(dataset)
    length = math.prod(info.image_shape)
    if not 1 <= prefix_pixels < length:
        raise ValueError(
            f"prefix_pixels must be in [1, {length}) for a fast-transformers model "
            f"(it has no distribution for the first sub-pixel), got {prefix_pixels}."
        )
    state_dict = interop.load_state_dict(pathlib.Path(checkpoint).expanduser())
    config = interop.generator_config(state_dict, attention_type=attention_type, n_heads=n_heads)
    model = interop.image_generator_from_fast_transformers(state_dict, config)
    if model.max_length != length or model.num_classes != info.num_classes:
        raise ValueError(
            f"{checkpoint}: the model generates {model.max_length} sub-pixels of "
            f"{model.num_classes} values; {dataset} images have {length} of "
            f"{info.num_classes}."
        )
    prefix = _test_prefix(dataset, num_images, prefix_pixels, data_dir=data_dir, manual_dir=manual_dir)
    path = (
        pathlib.Path(out)
        if out
        else pathlib.Path(f"{pathlib.Path(checkpoint).stem}_{method}_k{prefix_pixels}.png")
    )
    return _timed_sample(model, jax.random.key(seed), num_images, prefix, method, path, info)
