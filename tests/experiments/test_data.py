"""experiments.data: raw files -> TFDS array_record -> numpy exactly, helpful errors, step-indexed batches.

Everything runs offline on tiny files written here; no TensorFlow.
"""

import os
import pathlib
import pickle
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import pytest
from data_files import MNIST_SIZES, write_idx, write_mnist

from experiments import data
from experiments.data import builders

ROOT = pathlib.Path(__file__).resolve().parents[2]

CIFAR_TRAIN_ROWS = (2, 3, 1, 2, 2)  # rows of data_batch_1..5
CIFAR_TEST_ROWS = 3


def _write_cifar(folder, seed=0):
    """Writes cifar-10-batches-py/ pickles under `folder`; returns {split: data uint8 [n, 3072]}."""
    rng = np.random.default_rng(seed)
    batch_dir = os.path.join(folder, builders.CIFAR10_DIR)
    os.makedirs(batch_dir)
    rows = dict(zip(builders.CIFAR10_BATCHES["train"], CIFAR_TRAIN_ROWS), test_batch=CIFAR_TEST_ROWS)
    datas = {}
    for batch, n in rows.items():
        datas[batch] = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        content = {
            b"batch_label": batch.encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": datas[batch],
            b"filenames": [b"x.png"] * n,
        }
        with open(os.path.join(batch_dir, batch), "wb") as f:
            pickle.dump(content, f, protocol=2)  # the real files are Python 2 pickles
    return {
        "train": np.concatenate([datas[b] for b in builders.CIFAR10_BATCHES["train"]]),
        "test": datas["test_batch"],
    }


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_read_back_exactly(tmp_path, gz):
    raw = write_mnist(tmp_path / "manual", gz=gz)
    for split, (images, _) in raw.items():
        loaded = data.load_images("mnist", split, data_dir=tmp_path / "tfds", manual_dir=tmp_path / "manual")
        assert loaded.dtype == np.uint8 and loaded.shape == (MNIST_SIZES[split], 28, 28, 1)
        np.testing.assert_array_equal(loaded[..., 0], images)  # same bytes, same order


def test_mnist_labels_kept(tmp_path):
    raw = write_mnist(tmp_path / "manual")
    data.load_images("mnist", "test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "manual")
    builder = builders.LtMnist(data_dir=tmp_path / "tfds")
    assert builder.info.file_format.value == "array_record"
    assert all(".array_record-" in path.name for path in builder.data_path.glob("lt_mnist-*"))
    source = builder.as_data_source("test")
    np.testing.assert_array_equal([example["label"] for example in source], raw["test"][1])


def test_mnist_test_split_alone_then_train_added(tmp_path):
    manual, tfds_dir = tmp_path / "manual", tmp_path / "tfds"
    raw = write_mnist(manual, splits=("test",))
    test = data.load_images("mnist", "test", data_dir=tfds_dir, manual_dir=manual)
    np.testing.assert_array_equal(test[..., 0], raw["test"][0])
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.gz"):
        data.load_images("mnist", "train", data_dir=tfds_dir, manual_dir=manual)

    raw.update(write_mnist(manual, splits=("train",), seed=1))  # the train files arrive later
    train = data.load_images("mnist", "train", data_dir=tfds_dir, manual_dir=manual)
    np.testing.assert_array_equal(train[..., 0], raw["train"][0])
    test = data.load_images("mnist", "test", data_dir=tfds_dir, manual_dir=manual)
    np.testing.assert_array_equal(test[..., 0], raw["test"][0])


def test_mnist_default_manual_dir(tmp_path):
    raw = write_mnist(data.default_manual_dir("mnist", tmp_path), splits=("test",))
    test = data.load_images("mnist", "test", data_dir=tmp_path)
    np.testing.assert_array_equal(test[..., 0], raw["test"][0])


def test_mnist_download_fetches_only_missing_files(tmp_path, monkeypatch):
    """download=True goes through TFDS's download manager, for the files the manual dir lacks."""
    import tensorflow_datasets as tfds

    raw = write_mnist(tmp_path / "manual", splits=("test",))
    served = write_mnist(tmp_path / "server", splits=("train",), seed=2)
    requested = []

    def fake_download(self, urls):
        requested.extend(urls.values())
        return {key: tmp_path / "server" / (url.rsplit("/", 1)[1]) for key, url in urls.items()}

    monkeypatch.setattr(tfds.download.DownloadManager, "download", fake_download)
    train = data.load_images(
        "mnist", "train", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "manual", download=True
    )
    assert sorted(requested) == sorted(
        builders.MNIST_URL + stem + ".gz" for stem in builders.MNIST_FILES["train"]
    )
    np.testing.assert_array_equal(train[..., 0], served["train"][0])
    test = data.load_images("mnist", "test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "manual")
    np.testing.assert_array_equal(test[..., 0], raw["test"][0])


def _cifar_reference(rows_Nx3072):
    # Written out pixel by pixel, independent of the reshape in the builder: row = [R plane, G, B].
    n = len(rows_Nx3072)
    out = np.zeros((n, 32, 32, 3), np.uint8)
    for i in range(n):
        for channel in range(3):
            for y in range(32):
                start = channel * 1024 + y * 32
                out[i, y, :, channel] = rows_Nx3072[i, start : start + 32]
    return out


@pytest.mark.parametrize("layout", ["folder", "archive"])
def test_cifar10_read_back_exactly_rgb_interleaved(tmp_path, layout):
    manual = tmp_path / "manual"
    raw = _write_cifar(manual)
    if layout == "archive":
        with tarfile.open(tmp_path / builders.CIFAR10_ARCHIVE, "w:gz") as tar:
            tar.add(manual / builders.CIFAR10_DIR, arcname=builders.CIFAR10_DIR)
        manual = tmp_path / "manual_archive"
        manual.mkdir()
        os.replace(tmp_path / builders.CIFAR10_ARCHIVE, manual / builders.CIFAR10_ARCHIVE)
    for split, rows in raw.items():
        loaded = data.load_images("cifar10", split, data_dir=tmp_path / "tfds", manual_dir=manual)
        assert loaded.dtype == np.uint8 and loaded.shape == (len(rows), 32, 32, 3)
        np.testing.assert_array_equal(loaded, _cifar_reference(rows))
        flat = data.flatten_images(loaded)
        # Flattened row-major, the first pixel's R, G, B come first.
        np.testing.assert_array_equal(flat[:, :3], rows[:, [0, 1024, 2048]])


def test_digits_are_sklearn_digits(tmp_path):
    from sklearn.datasets import load_digits

    train = data.load_images("digits", "train", data_dir=tmp_path)
    test = data.load_images("digits", "test", data_dir=tmp_path)
    assert train.shape == (1500, 8, 8, 1) and test.shape == (297, 8, 8, 1)
    both = np.concatenate([train, test])
    assert both.dtype == np.uint8 and both.min() == 0 and both.max() == 16
    np.testing.assert_array_equal(both[..., 0], load_digits().images)
    assert data.num_classes("digits") == 17 == data.dataset_info("digits").num_classes


# Loads digits' train split into the file argv[2] once told to start (a line on stdin).
_LOAD_WHEN_TOLD = """
import sys
import numpy as np
from experiments import data
print("ready", flush=True)
sys.stdin.readline()
np.save(sys.argv[2], data.load_images("digits", "train", data_dir=sys.argv[1]))
"""


def test_processes_loading_one_unprepared_data_dir_at_once_prepare_it_once(tmp_path):
    """A run's processes on one host share the data directory. Started at the same moment,
    each loads the data set; one prepares it while the others wait (TFDS alone renames its
    temporary folder into place in each process: the slower failed with FileExistsError)."""
    data_dir = tmp_path / "tfds"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD_WHEN_TOLD, str(data_dir), str(tmp_path / f"{i}.npy")],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2, procs[0].stderr.read()[-3000:]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    expected = data.load_images("digits", "train", data_dir=data_dir)
    for i in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"{i}.npy"), expected)


@pytest.mark.parametrize(
    "name, files",
    [
        ("mnist", ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", builders.MNIST_URL]),
        ("cifar10", [builders.CIFAR10_ARCHIVE, builders.CIFAR10_DIR, builders.CIFAR10_URL]),
    ],
)
def test_missing_data_fails_fast_and_says_what_to_do(tmp_path, name, files):
    manual = tmp_path / "nothing_here"
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as error:
        data.load_images(name, "train", data_dir=tmp_path / "tfds", manual_dir=manual)
    assert time.monotonic() - start < 2.0
    for part in [*files, str(manual), "download=True"]:
        assert part in str(error.value)


def test_missing_data_names_the_default_manual_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte.gz") as error:
        data.load_images("mnist", "test", data_dir=tmp_path)
    assert data.default_manual_dir("mnist", tmp_path) in str(error.value)


def test_unknown_names_list_the_known_ones(tmp_path):
    for call in (
        lambda: data.load_images("imagenet", "train", data_dir=tmp_path),
        lambda: data.num_classes("imagenet"),
        lambda: data.dataset_info("imagenet"),
    ):
        with pytest.raises(ValueError, match="mnist, cifar10, digits"):
            call()
    with pytest.raises(ValueError, match="train, test"):
        data.load_images("digits", "validation", data_dir=tmp_path)


def test_corrupt_idx_file_is_reported(tmp_path):
    path = tmp_path / "t10k-images-idx3-ubyte"
    write_idx(path, np.zeros((2, 28, 28), np.uint8), gz=False)
    with open(path, "ab") as f:
        f.write(b"extra")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        builders.read_idx(path)


def test_dataset_info():
    assert data.DATASETS == ("mnist", "cifar10", "digits")
    assert data.num_classes("mnist") == data.num_classes("cifar10") == 256
    info = data.dataset_info("cifar10")
    assert info.image_shape == (32, 32, 3) and info.seq_len == 3072
    assert (info.num_train, info.num_test) == (50_000, 10_000)


def test_flatten_unflatten_round_trip():
    images = np.arange(2 * 4 * 3 * 3, dtype=np.uint8).reshape(2, 4, 3, 3)
    flat = data.flatten_images(images)
    assert flat.shape == (2, 36)
    np.testing.assert_array_equal(flat[0, :6], [0, 1, 2, 3, 4, 5])  # (y0 x0 RGB), (y0 x1 RGB)
    np.testing.assert_array_equal(data.unflatten(flat, (4, 3, 3)), images)
    with pytest.raises(ValueError, match="Cannot unflatten"):
        data.unflatten(flat, (4, 4, 3))


def _images(n=10):
    return np.arange(n, dtype=np.uint8).reshape(n, 1, 1, 1) * np.ones((1, 2, 2, 1), np.uint8)


def test_batches_visit_every_image_once_per_epoch():
    batches = data.Batches(_images(10), batch_size=3, seed=0)
    assert batches.steps_per_epoch == 3  # the 10th image of each permutation is dropped
    for epoch in range(3):
        seen = np.concatenate([batches.batch(epoch * 3 + i)[:, 0] for i in range(3)])
        assert seen.shape == (9,) and len(set(seen.tolist())) == 9
        np.testing.assert_array_equal(seen, batches.permutation(epoch)[:9])
    assert not np.array_equal(batches.permutation(0), batches.permutation(1))


def test_batches_are_a_function_of_seed_and_step():
    images = np.random.default_rng(0).integers(0, 256, (50, 4, 4, 3), dtype=np.uint8)
    a = data.Batches(images, batch_size=8, seed=3)
    run = [b for _, b in zip(range(20), a.iterate(0))]
    assert run[0].shape == (8, 48) and run[0].dtype == np.uint8
    np.testing.assert_array_equal(run[0], data.flatten_images(images)[a.permutation(0)[:8]])
    # A fresh object resumed at step 13 (after the epoch boundary at 6 and 12) sees the same batches.
    resumed = data.Batches(images, batch_size=8, seed=3)
    for want, got in zip(run[13:], resumed.iterate(13)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(resumed.batch(2), run[2])  # going back works too
    other = data.Batches(images, batch_size=8, seed=4)
    assert not np.array_equal(other.batch(0), run[0])


def test_batches_reject_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        data.Batches(_images(4), batch_size=5, seed=0)
    with pytest.raises(ValueError, match="seed"):
        data.Batches(_images(4), batch_size=2, seed=-1)
    batches = data.Batches(_images(4), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="step"):
        batches.batch(-1)
    with pytest.raises(ValueError, match="step"):
        batches.iterate(-1)


def test_no_tensorflow_imported(tmp_path):
    data.load_images("digits", "test", data_dir=tmp_path)
    assert "tensorflow" not in sys.modules


def test_preparing_leaves_nothing_in_the_system_temp_folder(tmp_path, monkeypatch):
    system_tmp = tmp_path / "system_tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    write_mnist(tmp_path / "manual", splits=("test",))
    data.load_images("mnist", "test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "manual")
    data.load_images("mnist", "test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "manual")
    assert list(system_tmp.iterdir()) == []
