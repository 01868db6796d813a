"""TFDS builders for the image sets of the paper's experiments, written as `array_record`, no TensorFlow.

The stock TFDS `mnist` and `cifar10` builders need TensorFlow to prepare, so these builders parse the
original raw files themselves. They are defined with `skip_registration=True` and under their own names
(`lt_mnist`, `lt_cifar10`, `lt_digits`): registering them would clash with the stock `mnist`/`cifar10`
the moment anything asks TFDS for those, and their prepared data must never be confused with the stock
TFRecord data in a shared `data_dir`. Being unregistered, they are used through the classes, not
`tfds.data_source(name)` (which, for a name it has to prepare, would also try the network):

    builder = LtMnist(data_dir=data_dir, file_format="array_record", download=False)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=folder_with_idx_files, try_download_gcs=False))
    test = builder.as_data_source("test")  # test[i] == {"image": uint8 [28, 28, 1], "label": int64}

Every example is `{"image": uint8 [H, W, C], "label": int64}`, in the order of the raw files.
"""

from __future__ import annotations

import gzip
import os
import pickle
import tarfile
from collections.abc import Iterator, Mapping
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

MNIST_URL = "https://storage.googleapis.com/cvdf-datasets/mnist/"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

# The IDX files of each MNIST split, without the `.gz` suffix (both spellings are accepted).
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_BATCHES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
DIGITS_NUM_TEST = 297  # sklearn's 1,797 digits: the first 1,500 train, the last 297 test.


class _ImageBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared parts: one image feature of a fixed shape, a label, and which raw splits a folder holds."""

    IMAGE_SHAPE: ClassVar[tuple[int, int, int]]
    NUM_LABELS: ClassVar[int]
    DESCRIPTION: ClassVar[str]
    HOMEPAGE: ClassVar[str]

    def _info(self) -> tfds.core.DatasetInfo:
        # A raw uint8 tensor rather than `tfds.features.Image`: no PNG encoding per example (and no
        # pillow), and the 0..16 digits are not mistaken for dark 8-bit images by image tools.
        info = self.dataset_info_from_configs(
            description=self.DESCRIPTION,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=self.IMAGE_SHAPE, dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=self.NUM_LABELS),
                }
            ),
            supervised_keys=("image", "label"),
            homepage=self.HOMEPAGE,
            # Keep the raw files' order (examples sorted by their integer key): the training pipeline
            # shuffles by itself, reproducibly, and tests compare against the raw order.
            disable_shuffling=True,
        )
        # TFDS looks for precomputed metadata of an unprepared data set on GCS, which it keeps
        # disabled, after making a temporary directory it never removes: one empty tmp*tfds folder
        # per builder. These data sets have no GCS metadata, so the lookup is skipped.
        info.initialize_from_bucket = lambda: None
        return info

    @classmethod
    def raw_splits(cls, manual_dir: os.PathLike | str | None) -> dict[str, object]:
        """Maps each split whose raw files are all in `manual_dir` to what `_generate_examples` reads."""
        raise NotImplementedError

    @classmethod
    def missing_message(cls, split: str, manual_dir: os.PathLike | str) -> str:
        """Says which raw files `split` needs, where to get them and where to put them."""
        raise NotImplementedError

    def __init__(self, *, download: bool = False, **kwargs):
        """Takes the TFDS builder arguments, plus whether raw files may be downloaded.

        `download`: whether raw files missing from the manual dir may be fetched from the internet. Off by
        default, so that preparing never waits on an unreachable host.
        """
        self.download = download
        super().__init__(**kwargs)
        self._original_state["download"] = download  # TFDS rebuilds builders from this when unpickling

    def _download_sources(self, dl_manager: tfds.download.DownloadManager, splits: list[str]) -> dict:
        """Downloads the raw files of `splits`; returns them in the form `raw_splits` gives."""
        raise NotImplementedError

    def _sources(self, dl_manager: tfds.download.DownloadManager) -> dict[str, object]:
        """The raw files of every split: from the manual dir where complete there, else downloaded if allowed.

        Splits with neither are left out (a folder holding only MNIST's test files prepares `test`).
        """
        try:
            manual_dir = dl_manager.manual_dir
        except AssertionError:  # TFDS's way of saying that the manual dir is missing or empty
            manual_dir = dl_manager._manual_dir  # only to name it in the error below
        splits = self.raw_splits(manual_dir)
        missing = [split for split in ("train", "test") if split not in splits]
        if missing and self.download:
            splits.update(self._download_sources(dl_manager, missing))
        if not splits:
            raise FileNotFoundError(" ".join(self.missing_message(split, manual_dir) for split in missing))
        return splits


class LtMnist(_ImageBuilder, skip_registration=True):
    """MNIST from the original IDX files: 28x28x1, 256 grey levels, splits train (60,000) and test (10,000).

    Reads `train-images-idx3-ubyte.gz`, `train-labels-idx1-ubyte.gz`, `t10k-images-idx3-ubyte.gz` and
    `t10k-labels-idx1-ubyte.gz` (gzipped or not) from the manual dir, preparing whichever splits are
    complete there; with `download=True` it fetches the other splits' files from `MNIST_URL`.
    """

    name = "lt_mnist"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Parsed from the raw IDX files."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = f"Put the four MNIST IDX files from {MNIST_URL} in the manual dir."
    IMAGE_SHAPE = (28, 28, 1)
    NUM_LABELS = 10
    DESCRIPTION = "MNIST handwritten digits (LeCun et al.), read from the raw IDX files."
    HOMEPAGE = "http://yann.lecun.com/exdb/mnist/"

    @classmethod
    def raw_splits(cls, manual_dir):
        if manual_dir is None or not os.path.isdir(manual_dir):
            return {}
        found = {}
        for split, stems in MNIST_FILES.items():
            paths = [_find_file(manual_dir, stem, (".gz", "")) for stem in stems]
            if all(paths):
                found[split] = tuple(paths)
        return found

    @classmethod
    def missing_message(cls, split, manual_dir):
        names = ", ".join(f"{stem}.gz" for stem in MNIST_FILES[split])
        return (
            f"MNIST split {split!r} is not prepared and its raw files are not in {manual_dir}. "
            f"Download {names} from {MNIST_URL} and put them (gzipped or not) in {manual_dir}, "
            "or pass download=True to fetch them."
        )

    def _download_sources(self, dl_manager, splits):
        urls = {
            f"{split}_{i}": MNIST_URL + stem + ".gz"
            for split in splits
            for i, stem in enumerate(MNIST_FILES[split])
        }
        paths = dl_manager.download(urls)
        return {split: (paths[f"{split}_0"], paths[f"{split}_1"]) for split in splits}

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(*paths) for split, paths in self._sources(dl_manager).items()}

    def _generate_examples(self, images_path, labels_path):
        images = read_idx(images_path)
        labels = read_idx(labels_path)
        if images.ndim != 3 or images.shape[1:] != self.IMAGE_SHAPE[:2] or labels.shape != images.shape[:1]:
            raise ValueError(
                f"{images_path} and {labels_path} are not a matching pair of MNIST IDX files: "
                f"images {images.shape}, labels {labels.shape}."
            )
        for i, (image, label) in enumerate(zip(images[..., None], labels)):
            yield i, {"image": image, "label": int(label)}


class LtCifar10(_ImageBuilder, skip_registration=True):
    """CIFAR-10 from the python pickles: 32x32x3 RGB, 256 levels, splits train (50,000) and test (10,000).

    Reads the folder `cifar-10-batches-py` (data_batch_1..5, test_batch) or the archive
    `cifar-10-python.tar.gz` from the manual dir (the folder may also be the manual dir itself); with
    `download=True` it fetches the archive from `CIFAR10_URL` when a split is missing there.
    """

    name = "lt_cifar10"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Parsed from the python pickles."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Put {CIFAR10_ARCHIVE} from {CIFAR10_URL} (or its extracted folder) in the manual dir."
    )
    IMAGE_SHAPE = (32, 32, 3)
    NUM_LABELS = 10
    DESCRIPTION = "CIFAR-10 (Krizhevsky, 2009), read from the python version of the data set."
    HOMEPAGE = "https://www.cs.toronto.edu/~kriz/cifar.html"

    @classmethod
    def raw_splits(cls, manual_dir):
        if manual_dir is None or not os.path.isdir(manual_dir):
            return {}
        found = {}
        for folder in (os.path.join(manual_dir, CIFAR10_DIR), manual_dir):
            for split, batches in CIFAR10_BATCHES.items():
                if split not in found and all(os.path.isfile(os.path.join(folder, b)) for b in batches):
                    found[split] = ("pickles", tuple(os.path.join(folder, b) for b in batches))
        archive = os.path.join(manual_dir, CIFAR10_ARCHIVE)
        if os.path.isfile(archive):
            found = {split: found.get(split, ("archive", archive)) for split in CIFAR10_BATCHES}
        return found

    @classmethod
    def missing_message(cls, split, manual_dir):
        names = ", ".join(CIFAR10_BATCHES[split])
        return (
            f"CIFAR-10 split {split!r} is not prepared and its raw files are not in {manual_dir}. "
            f"Download {CIFAR10_URL} and put {CIFAR10_ARCHIVE} (or the extracted folder {CIFAR10_DIR}/ "
            f"holding {names}) in {manual_dir}, or pass download=True to fetch it."
        )

    def _download_sources(self, dl_manager, splits):
        archive = dl_manager.download(CIFAR10_URL)  # one archive holds both splits
        return {split: ("archive", archive) for split in splits}

    def _split_generators(self, dl_manager):
        return {
            split: self._generate_examples(split, *source)
            for split, source in self._sources(dl_manager).items()
        }

    def _generate_examples(self, split, kind, paths):
        key = 0
        for data, labels in _cifar_batches(split, kind, paths):
            # Rows are 1024 red, then 1024 green, then 1024 blue values, each plane row-major.
            images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            for image, label in zip(images, labels):
                yield key, {"image": image, "label": int(label)}
                key += 1


class LtDigits(_ImageBuilder, skip_registration=True):
    """scikit-learn's bundled 8x8 handwritten digits: 1,797 images, grey levels 0..16 (17 values).

    Needs no download. Split deterministically by position: the first 1,500 images are `train`, the last
    297 `test`.
    """

    name = "lt_digits"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "sklearn.datasets.load_digits, last 297 = test."}
    IMAGE_SHAPE = (8, 8, 1)
    NUM_LABELS = 10
    DESCRIPTION = "Optical recognition of handwritten digits (UCI), as bundled with scikit-learn."
    HOMEPAGE = "https://archive.ics.uci.edu/dataset/80"

    @classmethod
    def raw_splits(cls, manual_dir):
        return {"train": slice(None, -DIGITS_NUM_TEST), "test": slice(-DIGITS_NUM_TEST, None)}

    @classmethod
    def missing_message(cls, split, manual_dir):
        return "The digits data set ships with scikit-learn: `pip install scikit-learn`."

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(rows) for split, rows in self.raw_splits(None).items()}

    def _generate_examples(self, rows):
        images, labels = load_sklearn_digits()
        start = rows.indices(len(images))[0]
        for i, (image, label) in enumerate(zip(images[rows], labels[rows])):
            yield start + i, {"image": image, "label": int(label)}


def load_sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 of scikit-learn's digits as (uint8 [1797, 8, 8, 1] with values 0..16, int64 labels)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("The digits data set needs scikit-learn: `pip install scikit-learn`.") from e
    digits = load_digits()
    images = digits.images.astype(np.uint8)[..., None]
    exact = np.array_equal(images[..., 0], digits.images)  # integral values, none clipped by uint8
    if images.shape != (1797, 8, 8, 1) or not exact or images.max() > 16:
        raise ValueError(f"Unexpected scikit-learn digits: shape {images.shape}, max {images.max()}.")
    return images, digits.target.astype(np.int64)


def read_idx(path: os.PathLike | str) -> np.ndarray:
    """Reads an unsigned-byte IDX file, gzipped or not, as a uint8 array.

    Raises:
      ValueError: if the header is not that of an unsigned-byte IDX file or the size does not match it.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # the gzip magic: decide by content, as downloaded files get other names
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (header {raw[:4]!r}).")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw[4:header], dtype=">u4"))
    if len(raw) != header + int(np.prod(shape)):
        raise ValueError(
            f"{path}: header says shape {shape} but it holds {len(raw) - header} bytes of data "
            "(truncated or corrupt download?)."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _find_file(folder, stem: str, suffixes: tuple[str, ...]) -> str | None:
    for suffix in suffixes:
        path = os.path.join(folder, stem + suffix)
        if os.path.isfile(path):
            return path
    return None


def _cifar_batches(split: str, kind: str, paths) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields (uint8 data [n, 3072], labels [n]) for each batch of `split`, from pickles or the archive.

    Pickles can run code when loaded: only read CIFAR files from the official source.
    """
    if kind == "archive":
        # Read straight from the archive: no extracted copy of 180 MB left behind in the data dir.
        with tarfile.open(paths, "r:gz") as tar:
            members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
            for batch in CIFAR10_BATCHES[split]:
                if batch not in members:
                    raise FileNotFoundError(f"{paths} holds no {batch}: not the CIFAR-10 python archive?")
                yield _unpickle_batch(tar.extractfile(members[batch]), f"{paths}:{batch}")
        return
    for path in paths:
        with open(path, "rb") as f:
            yield _unpickle_batch(f, path)


def _unpickle_batch(f, where: str) -> tuple[np.ndarray, np.ndarray]:
    # The batches were pickled by Python 2: their keys are bytes, hence encoding="bytes".
    batch: Mapping = pickle.load(f, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != data.shape[:1]:
        raise ValueError(f"{where}: not a CIFAR-10 batch (data {data.shape}, labels {labels.shape}).")
    return data, labels


BUILDERS: dict[str, type[_ImageBuilder]] = {"mnist": LtMnist, "cifar10": LtCifar10, "digits": LtDigits}
