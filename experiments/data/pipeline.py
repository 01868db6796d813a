"""Image data for the autoregressive experiments: load a split into memory, batch it by step number.

The sets are small (MNIST train is 47 MB as uint8), so a split is read whole into a numpy array once, and
batches are cut from it on the host. The batch of global step `s` depends on `(seed, s)` only: a run
resumed from a checkpoint at step `s` sees exactly the batches the uninterrupted run would have seen,
with no data-loader state to save.

    images = load_images("mnist", "train", data_dir="~/tensorflow_datasets")
    batches = Batches(images, batch_size=64, seed=0)
    for step, x_BxD in zip(range(start, num_steps), batches.iterate(start)):
        ...  # x_BxD: uint8 [64, 784], pixels row-major, channels interleaved
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import numpy as np

from experiments.data import preparing

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about an image set (not TFDS's `DatasetInfo`).

    Attributes:
      name: the name `load_images` takes.
      image_shape: (H, W, C) of one image.
      num_classes: number of distinct pixel values, the vocabulary of a model predicting pixels
        (256 for 8-bit images, 17 for the 0..16 digits).
      num_train: images in the train split.
      num_test: images in the test split.
    """

    name: str
    image_shape: tuple[int, int, int]
    num_classes: int
    num_train: int
    num_test: int

    @property
    def seq_len(self) -> int:
        """Length H * W * C of an image flattened into a sequence of pixel values."""
        return int(np.prod(self.image_shape))


_INFOS = {
    "mnist": DatasetInfo("mnist", (28, 28, 1), 256, 60_000, 10_000),
    "cifar10": DatasetInfo("cifar10", (32, 32, 3), 256, 50_000, 10_000),
    "digits": DatasetInfo("digits", (8, 8, 1), 17, 1_500, 297),
}
DATASETS = tuple(_INFOS)


def dataset_info(name: str) -> DatasetInfo:
    """The `DatasetInfo` of data set `name` (one of `DATASETS`); needs no data on disk."""
    if name not in _INFOS:
        raise ValueError(f"Unknown data set {name!r}; known: {', '.join(DATASETS)}.")
    return _INFOS[name]


def num_classes(name: str) -> int:
    """Number of distinct pixel values of data set `name`: 256 for mnist and cifar10, 17 for digits."""
    return dataset_info(name).num_classes


def default_manual_dir(name: str, data_dir: os.PathLike | str) -> str:
    """Where `load_images` looks for raw files when no `manual_dir` is given: `<data_dir>/downloads/manual`.

    That is TFDS's own default. One folder serves every set: their raw file names do not collide.
    """
    dataset_info(name)  # validates the name
    return os.path.join(os.path.expanduser(os.fspath(data_dir)), "downloads", "manual")


def load_images(
    name: str,
    split: str,
    *,
    data_dir: os.PathLike | str,
    manual_dir: os.PathLike | str | None = None,
    download: bool = False,
) -> np.ndarray:
    """Reads split `split` of image set `name` into memory, preparing it first if needed.

    Preparing converts the raw files to TFDS `array_record` files under `data_dir` once; later calls only
    read those. The raw files come from `manual_dir` (for mnist and cifar10: the original IDX files or
    CIFAR python pickles), from scikit-learn (digits), or are downloaded, but only when `download=True`.
    When `manual_dir` holds only some splits (say only MNIST's test files), those splits are prepared, and
    adding the other split's files later prepares again.

    Args:
      name: one of `DATASETS`: "mnist", "cifar10" or "digits".
      split: "train" or "test".
      data_dir: TFDS data directory; prepared data lives in `<data_dir>/lt_<name>/<version>/`.
      manual_dir: folder holding the raw files; defaults to `default_manual_dir(name, data_dir)`.
      download: whether the raw files may be fetched from the internet when not in `manual_dir`.

    Returns:
      uint8 [N, H, W, C] in the order of the raw files; values in 0..num_classes(name) - 1.

    Raises:
      ValueError: for an unknown `name` or `split`.
      FileNotFoundError: at once, without touching the network, when the split is not prepared, its raw
        files are not in `manual_dir` and `download` is False; the message says which files to get from
        where and where to put them.
    """
    from experiments.data import builders  # imports TFDS: kept out of the metadata-only functions

    info = dataset_info(name)
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} of {name}; known: {', '.join(SPLITS)}.")
    data_dir = os.path.expanduser(os.fspath(data_dir))
    if manual_dir is None:
        manual_dir = default_manual_dir(name, data_dir)
    manual_dir = os.path.expanduser(os.fspath(manual_dir))
    builder_cls = builders.BUILDERS[name]
    builder = builder_cls(data_dir=data_dir, file_format="array_record", download=download)

    if not _holds(builder, split):
        with preparing.one_at_a_time(data_dir, builder.name):
            # Another process may have prepared it while this one waited.
            builder = builder_cls(data_dir=data_dir, file_format="array_record", download=download)
            if not _holds(builder, split):
                # Decide before TFDS runs: it must not get as far as a download not asked for.
                if not (download or split in builder_cls.raw_splits(manual_dir)):
                    raise FileNotFoundError(
                        f"{builder_cls.missing_message(split, manual_dir)} "
                        f"(The prepared data will be written under {data_dir}.)"
                    )
                _prepare(builder, manual_dir=manual_dir, overwrite=builder.is_prepared())
        builder = builder_cls(data_dir=data_dir, file_format="array_record")

    source = builder.as_data_source(split)
    examples = source.__getitems__(range(len(source)))  # one batched read, not one call per image
    images = np.stack([example["image"] for example in examples])
    if images.dtype != np.uint8 or images.shape[1:] != info.image_shape:
        raise ValueError(
            f"Prepared {name} {split} under {data_dir} holds {images.dtype} {images.shape[1:]}, "
            f"not uint8 {info.image_shape}: delete {builder.data_path} to prepare it again."
        )
    return images


def _holds(builder, split: str) -> bool:
    return builder.is_prepared() and split in builder.info.splits


def _prepare(builder, *, manual_dir: str, overwrite: bool) -> None:
    import tensorflow_datasets as tfds

    mode = tfds.download.GenerateMode
    # The builder was made with file_format="array_record"; passing it again here would fail when
    # overwriting (TFDS refuses to set the format of an info restored from disk).
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            manual_dir=manual_dir,
            # Overwrite when a split is missing from the prepared data (its files arrived later).
            download_mode=mode.REUSE_CACHE_IF_EXISTS if overwrite else mode.REUSE_DATASET_IF_EXISTS,
            try_download_gcs=False,  # never look for a prepared copy on GCS: ours are not there
        ),
    )


def flatten_images(images: np.ndarray) -> np.ndarray:
    """[N, H, W, C] -> [N, H * W * C], row-major: the pixel sequence a model reads, channels interleaved."""
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"Expected images [N, H, W, C], got shape {images.shape}.")
    return images.reshape(images.shape[0], -1)


def unflatten(x: np.ndarray, image_shape: tuple[int, int, int]) -> np.ndarray:
    """[..., H * W * C] -> [..., H, W, C]: the inverse of `flatten_images`."""
    x = np.asarray(x)
    image_shape = tuple(image_shape)
    if len(image_shape) != 3 or x.ndim < 1 or x.shape[-1] != int(np.prod(image_shape)):
        raise ValueError(f"Cannot unflatten shape {x.shape} into images of shape {image_shape}.")
    return x.reshape(*x.shape[:-1], *image_shape)


class Batches:
    """Seeded shuffled batches whose content is a pure function of `(seed, step)`.

    Epoch `e = step // steps_per_epoch` visits the images in the order
    `np.random.default_rng([seed, e]).permutation(N)`; step `s` takes the `s % steps_per_epoch`-th run of
    `batch_size` of them. The last `N % batch_size` images of each permutation are dropped, so every batch
    is full and no image appears twice in an epoch.
    """

    def __init__(self, images: np.ndarray, batch_size: int, *, seed: int):
        """Args: images uint8 [N, H, W, C] (or already flat [N, D]), batch_size, seed (an int >= 0)."""
        images = np.asarray(images)
        self.images_NxD = flatten_images(images) if images.ndim == 4 else images
        if self.images_NxD.ndim != 2:
            raise ValueError(f"Expected images [N, H, W, C] or [N, D], got shape {images.shape}.")
        if not 0 < batch_size <= len(self.images_NxD):
            raise ValueError(
                f"batch_size must be in 1..{len(self.images_NxD)} (the number of images), got {batch_size}."
            )
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.steps_per_epoch = len(self.images_NxD) // self.batch_size
        self._cached_epoch, self._cached_perm = -1, None

    def permutation(self, epoch: int) -> np.ndarray:
        """The order int64 [N] in which epoch `epoch` visits the images."""
        if epoch != self._cached_epoch:  # consecutive steps share it: compute once per epoch
            perm = np.random.default_rng([self.seed, int(epoch)]).permutation(len(self.images_NxD))
            perm.flags.writeable = False  # shared by later calls: nobody may reorder it
            self._cached_epoch, self._cached_perm = epoch, perm
        return self._cached_perm

    def batch(self, step: int) -> np.ndarray:
        """The batch of global step `step`: uint8 [batch_size, D], a new array."""
        if int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}.")
        epoch, i = divmod(int(step), self.steps_per_epoch)
        rows = self.permutation(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        return self.images_NxD[rows]

    def iterate(self, start_step: int = 0) -> Iterator[np.ndarray]:
        """Yields `batch(start_step)`, `batch(start_step + 1)`, ... without end."""
        self.batch(start_step)  # fail here on a bad start_step, not at the first `next`

        def batches():
            step = start_step
            while True:
                yield self.batch(step)
                step += 1

        return batches()
