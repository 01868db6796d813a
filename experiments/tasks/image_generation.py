"""The paper's autoregressive image generator (sections 4.2, 4.3): `ImageGeneration`.

Flattened images [B, T] in raster order, sub-pixels interleaved; the loss is the negative
log-likelihood per sub-pixel (nats) of the discretized mixture of logistics; evaluation is
test bits/dim over the whole evaluation split; samples (recurrent form) go to a PNG grid.

Legend: B batch, T time (the sub-pixels of an image, height * width * channels).
"""

from __future__ import annotations

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from experiments.data import pipeline
from experiments.tasks import images
from experiments.training import schemas
from experiments.training.config_checks import check_sizes, model_config
from experiments.training.trainer import Task, Trainer
from linear_transformers import mixture
from linear_transformers.image_generator import ImageGenerator, sample_images


def schema() -> ml_collections.ConfigDict:
    """Every key of an image-generation config, with its default (the model: the paper's MNIST
    architecture, Table 1)."""
    c = ml_collections.ConfigDict()
    c.task = "image_generation"
    c.seed = 0

    # Data: a name from experiments.data, where prepared data lives, where raw files are.
    c.dataset = "digits"
    c.data_dir = "~/tensorflow_datasets"
    c.manual_dir = ""  # raw files (IDX .gz, cifar-10-batches-py); "" = <data_dir>/downloads/manual
    c.download = False  # fetch raw files with the TFDS download manager when missing
    c.train_split = "train"  # "train", "test", or a slice such as "test[:9000]"
    c.eval_split = "test"
    c.max_train_examples = 0  # 0 = all; >0 keeps the first N (quick runs)
    c.max_eval_examples = 0  # 0 = the whole test split

    # Model: embedding ++ positions, a causal transformer (TransformerConfig(**c.model)), and a
    # mixture of num_mixtures discretized logistics per sub-pixel.
    c.model = schemas.model(
        attention="linear",
        num_layers=8,
        num_heads=8,
        model_dim=256,
        feed_forward_dim=1024,
        dropout=0.1,
        dtype="float32",  # computation: float32 | bfloat16 (parameters stay float32)
    )
    c.num_mixtures = 10

    schemas.optimisation(c)
    schemas.bookkeeping(c)
    c.eval_batch_size = 64
    c.sample_every = 500
    c.num_samples = 16
    schemas.devices(c)
    return c


# The paper's architectures where they differ from schema()'s (its MNIST model, Table 1): CIFAR-10
# has 16 layers (Table 2).
PAPER_MODELS = {"mnist": {}, "cifar10": {"num_layers": 16}}


def paper_config(dataset: str) -> ml_collections.ConfigDict:
    """schema() for `dataset` ("mnist" or "cifar10") with the paper's architecture for it."""
    if dataset not in PAPER_MODELS:
        raise ValueError(f"no paper architecture for {dataset!r}; the paper's: {sorted(PAPER_MODELS)}.")
    c = schema()
    c.dataset = dataset
    c.model.update(PAPER_MODELS[dataset])
    return c


def build_model(
    config: ml_collections.ConfigDict, info, *, sequence_axis: str | None = None
) -> ImageGenerator:
    """The image generator of `config` for data set `info`, initialised from config.seed."""
    return ImageGenerator(
        model_config(config.model, sequence_axis=sequence_axis),
        num_classes=info.num_classes,
        num_mixtures=config.num_mixtures,
        max_length=math.prod(info.image_shape),
        rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1),
    )


_SPLIT_SPEC = re.compile(r"^(\w+)(?:\[(\d*):(\d*)\])?$")


def load_split(config, spec: str) -> np.ndarray:
    """Flattened images [number of images, T] of a split spec: "train", "test", or a slice like "test[:9000]"
    or "test[9000:]" (to train on part of a split when only that split is at hand)."""
    match = _SPLIT_SPEC.match(spec)
    if match is None or match.group(1) not in pipeline.SPLITS:
        raise ValueError(
            f"split {spec!r} is not one of {pipeline.SPLITS}, optionally sliced as 'test[:9000]'."
        )
    name, start, stop = match.groups()
    loaded = pipeline.load_images(
        config.dataset,
        name,
        data_dir=config.data_dir,
        manual_dir=config.manual_dir or None,
        download=config.download,
    )
    x = pipeline.flatten_images(loaded)[int(start) if start else None : int(stop) if stop else None]
    if not len(x):
        raise ValueError(f"split {spec!r} of {config.dataset!r} is empty.")
    # Checked once here: inside the compiled steps a bad value would only show as a NaN loss.
    num_classes = pipeline.dataset_info(config.dataset).num_classes
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"split {spec!r} of {config.dataset!r} has sub-pixel values in "
            f"[{low}, {high}]; the model takes [0, {num_classes}). Check the data "
            f"files in {config.manual_dir or config.data_dir}."
        )
    return x


class ImageGeneration(Task):
    """Train an `ImageGenerator` on `config.dataset`; evaluate test bits/dim; sample images."""

    name = "image_generation"
    schema = staticmethod(schema)

    def __init__(self, config):
        super().__init__(config)
        self.info = pipeline.dataset_info(config.dataset)
        self.train_images = self.test_images = self._batches = None

    def check(self) -> None:
        check_sizes(
            self.config,
            positive=("eval_batch_size", "num_samples", "num_mixtures"),
            non_negative=("sample_every", "max_train_examples", "max_eval_examples"),
        )
        if self.config.model.model_dim % 4:
            raise ValueError(
                f"config.model.model_dim must be a multiple of 4 (half embedding, half "
                f"sine/cosine position encoding), got {self.config.model.model_dim}."
            )

    def sequence_length(self) -> int:
        return math.prod(self.info.image_shape)

    def load_data(self) -> None:
        c = self.config
        train = load_split(c, c.train_split)
        test = load_split(c, c.eval_split)
        self.train_images = train[: c.max_train_examples] if c.max_train_examples else train
        self.test_images = test[: c.max_eval_examples] if c.max_eval_examples else test
        if len(self.train_images) < c.batch_size:
            raise ValueError(
                f"config.batch_size={c.batch_size} exceeds the {len(self.train_images)} "
                f"training images of {c.dataset!r} {c.train_split!r}."
            )
        self._batches = pipeline.Batches(self.train_images, c.batch_size, seed=c.seed)

    def build_model(self, *, sequence_axis=None) -> ImageGenerator:
        return build_model(self.config, self.info, sequence_axis=sequence_axis)

    def batch(self, step: int) -> np.ndarray:
        return self._batches.batch(step)

    def loss(self, model, x_BT):
        return model.nll(x_BT), {}

    def train_scalars(self, loss, sums) -> dict:
        return {"train_bits_per_dim": loss / math.log(2)}

    def progress(self, scalars) -> dict:
        return {"loss": f"{scalars['loss']:.4f}", "bpd": f"{scalars['train_bits_per_dim']:.4f}"}

    def eval_sums(self, model, batch) -> dict:
        x_BT, weight_B = batch
        return {"nll": -jnp.sum(model.log_prob(x_BT) * weight_B)}

    def evaluate(self, trainer: Trainer) -> dict:
        """Test bits/dim over every evaluation image (the last batch padded, padding weighted 0)."""
        test_images = self.test_images
        bs = self.config.eval_batch_size
        bs += (-bs) % trainer.mesh.shape["data"]
        total = 0.0
        for start in range(0, len(test_images), bs):
            x = test_images[start : start + bs]
            weight = np.zeros(bs, np.float32)
            weight[: len(x)] = 1.0
            x = np.concatenate([x, np.zeros((bs - len(x), x.shape[1]), x.dtype)])
            total += trainer.eval_sums((x, weight))["nll"]
        return {
            "test_bits_per_dim": float(
                mixture.bits_per_dim(total / (len(test_images) * test_images.shape[1]))
            )
        }

    def write_samples(self, trainer: Trainer, directory, step: int) -> pathlib.Path:
        """Sample config.num_samples images with the recurrent form; write a PNG grid."""
        key = jax.random.fold_in(jax.random.key(self.config.seed + 3), step)
        images_BT = np.asarray(sample_images(trainer.eval_model(), key, self.config.num_samples))
        scale = max(1, 128 // self.info.image_shape[0])
        return images.save_image_grid(
            self.samples_file(directory, step),
            images_BT.reshape(-1, *self.info.image_shape),
            self.info.num_classes,
            scale=scale,
        )

    def samples_file(self, directory, step: int) -> pathlib.Path:
        return pathlib.Path(directory) / f"step_{step:07d}.png"
