"""Load a workdir's latest checkpoint and generate images, timed."""

from __future__ import annotations

import json
import math
import pathlib
import time

import jax
import ml_collections
import numpy as np

from experiments.data import pipeline
from experiments.training import images
from experiments.training.checkpoints import (Checkpointer, CheckpointError,
                                              DamagedCheckpointError)
from experiments.training.loop import _Trainer, data_mesh
from linear_transformers.image_generator import sample_images, sample_images_full_recompute

METHODS = {"recurrent": sample_images, "recompute": sample_images_full_recompute}


def load_config(workdir) -> ml_collections.ConfigDict:
    """The config a workdir was trained with (its config.json)."""
    workdir = pathlib.Path(workdir).expanduser()
    if not workdir.is_dir():
        raise FileNotFoundError(f"workdir {workdir} is not a directory: --workdir must be a "
                                f"directory written by python -m experiments.train.")
    path = workdir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --workdir must be a directory written by "
                                f"python -m experiments.train.")
    try:
        return ml_collections.ConfigDict(json.loads(path.read_text()))
    except ValueError as e:
        raise ValueError(f"{path} is not a valid config ({e}); it is written by "
                         f"python -m experiments.train when training starts: restore it, or "
                         f"re-run training with the run's config to rewrite it.") from None


def sample_from_workdir(workdir, *, num_images: int = 16, prefix_pixels: int = 0,
                        method: str = "recurrent", seed: int = 0, step: int | None = None,
                        out=None) -> dict:
    """Generate `num_images` images (completing the first `prefix_pixels` sub-pixels of test
    images when > 0) and write a PNG grid; return path, timing and the images."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}.")
    config = load_config(workdir)
    info = pipeline.dataset_info(config.dataset)
    length = math.prod(info.image_shape)
    if not 0 <= prefix_pixels < length:
        raise ValueError(f"prefix_pixels must be in [0, {length}), got {prefix_pixels}.")
    mesh = data_mesh(jax.devices()[:1])
    trainer = _Trainer(config, info, mesh)
    checkpointer = Checkpointer(pathlib.Path(workdir).expanduser() / "checkpoints")
    try:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"there is no checkpoint in {checkpointer.directory}.")
        trainer.state = checkpointer.restore(trainer.state, step)
    except DamagedCheckpointError as e:
        others = [s for s in checkpointer.all_steps() if s != step]
        raise DamagedCheckpointError(f"{e} Sample another checkpoint with --step (steps: "
                                     f"{others}), or resume training to replace it.") from None
    finally:
        checkpointer.close()
    prefix = None
    if prefix_pixels:
        test = pipeline.flatten_images(pipeline.load_images(
            config.dataset, "test", data_dir=config.data_dir,
            manual_dir=config.manual_dir or None, download=False))
        prefix = test[:num_images, :prefix_pixels].astype(np.int32)
        num_images = len(prefix)
    model, key = trainer.eval_model(), jax.random.key(seed)
    sample = METHODS[method]
    jax.block_until_ready(sample(model, key, num_images, prefix=prefix))  # compile
    start = time.perf_counter()
    x_NL = np.asarray(jax.block_until_ready(sample(model, key, num_images, prefix=prefix)))
    seconds = time.perf_counter() - start
    path = pathlib.Path(out) if out else (pathlib.Path(workdir).expanduser() / "samples" /
                                          f"sample_{method}_step{step}_k{prefix_pixels}.png")
    images.save_image_grid(path, x_NL.reshape(-1, *info.image_shape), info.num_classes,
                           scale=max(1, 128 // info.image_shape[0]))
    return {"path": str(path), "num_images": num_images, "seconds": seconds,
            "images_per_sec": num_images / seconds, "method": method, "step": step,
            "images": x_NL}
