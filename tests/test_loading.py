"""Loaders on small files written here in the real on-disk formats (IDX, CIFAR pickles, SVHN .mat)."""

import pickle

import numpy as np
import pytest
import scipy.io

from flowerbed.datasets.loading import DEBIAN_FASHION_MNIST as DEBIAN
from flowerbed.datasets.loading import DataError, load_dataset, read_idx, write_idx

rng = np.random.default_rng(0)


def write_mnist(root, n_train=40, n_test=20, gz=True):
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28))
        y = np.arange(n) % 10
        write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", x)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", y)
    return x, y


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_idx_from_data_root(tmp_path, gz):
    x, y = write_mnist(tmp_path, gz=gz)
    ds = load_dataset("fashion-mnist", train=False, data_root=str(tmp_path))
    assert ds.x.shape == (20, 1, 28, 28) and ds.x.dtype.is_floating_point is False
    assert np.array_equal(ds.x[:, 0].numpy(), x) and np.array_equal(ds.y.numpy(), y)
    assert len(load_dataset("fashion-mnist", train=True, data_root=str(tmp_path))) == 40


def test_mnist_torchvision_layout(tmp_path):
    write_mnist(tmp_path / "MNIST" / "raw", gz=False)
    ds = load_dataset("mnist", train=True, data_root=str(tmp_path))
    assert len(ds) == 40 and ds.num_classes == 10


def test_truncated_idx_is_a_clear_error(tmp_path):
    p = tmp_path / "t10k-images-idx3-ubyte"
    write_idx(p, rng.integers(0, 256, (5, 28, 28)))
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated"):
        read_idx(p)
    (tmp_path / "short").write_bytes(b"\x00\x00\x08\x03\x00")  # cut inside its sizes
    with pytest.raises(DataError, match="truncated inside its header"):
        read_idx(tmp_path / "short")
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DataError, match="magic"):
        read_idx(tmp_path / "bad")


def test_damaged_files_and_foreign_contents_are_clear_errors(tmp_path):
    """From a review: a damaged (not truncated) .gz raised zlib.error, a traceback; labels out of
    range or images of another shape failed inside training, far from the file."""
    p = tmp_path / "t10k-images-idx3-ubyte.gz"
    write_idx(p, rng.integers(0, 256, (50, 28, 28)))
    raw = bytearray(p.read_bytes())
    raw[40:400] = bytes(360)  # the deflate stream, zeroed
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="cannot read IDX file .*t10k-images"):
        read_idx(p)
    for name, x, y in (("labels", rng.integers(0, 256, (20, 28, 28)), np.arange(20) % 12),
                       ("shape", rng.integers(0, 256, (20, 32, 32)), np.arange(20) % 10)):
        root = tmp_path / name
        root.mkdir()
        write_idx(root / "t10k-images-idx3-ubyte", x)
        write_idx(root / "t10k-labels-idx1-ubyte", y)
        with pytest.raises(DataError, match={"labels": "labels from 0 to 11, outside 0-9",
                                             "shape": r"images of shape \(1, 32, 32\)"}[name]):
            load_dataset("fashion-mnist", train=False, data_root=str(root))


def test_debian_fashion_mnist_is_the_default():
    ds = load_dataset("fashion-mnist", train=False)
    assert len(ds) == 10000 and ds.shape == (1, 28, 28)
    assert sorted(np.unique(ds.y.numpy()).tolist()) == list(range(10))


def _cifar_batch(n, key, classes):
    # The real batches are Python 2 pickles with str keys; torchvision reads them as latin1.
    return {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            key: (np.arange(n) % classes).tolist(), "batch_label": "x"}


def test_cifar10_pickle_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        pickle.dump(_cifar_batch(4, "labels", 10), open(folder / f"data_batch_{i}", "wb"), protocol=2)
    pickle.dump(_cifar_batch(6, "labels", 10), open(folder / "test_batch", "wb"))
    pickle.dump({"label_names": ["c"] * 10}, open(folder / "batches.meta", "wb"))
    with pytest.warns(UserWarning, match="checksums"):
        train = load_dataset("cifar10", train=True, data_root=str(tmp_path))
    assert train.x.shape == (20, 3, 32, 32) and train.num_classes == 10
    assert len(load_dataset("cifar10", train=False, data_root=str(tmp_path))) == 6


def test_truncated_cifar_batch_is_a_clear_error(tmp_path):
    """A half-written batch (an interrupted download) raised a bare UnpicklingError."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pickle.dump(_cifar_batch(4, "labels", 10), open(folder / name, "wb"), protocol=2)
    (folder / "data_batch_3").write_bytes((folder / "data_batch_3").read_bytes()[:500])
    with pytest.warns(UserWarning), pytest.raises(DataError, match=r"cannot read \S*cifar-10-batches-py/"
                                                                    r"data_batch_3 \("):
        load_dataset("cifar10", train=True, data_root=str(tmp_path))


def test_partial_cifar_folder_names_the_missing_files(tmp_path, monkeypatch):
    """A CIFAR folder with some batches absent (a partial copy) names each missing file, not
    only the folder."""
    import flowerbed.datasets.loading as L

    def offline(*a, **k):
        raise DataError("download failed (offline)")

    monkeypatch.setattr(L, "_torchvision_download", offline)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ["data_batch_1", "data_batch_2", "data_batch_4", "data_batch_5"]:
        pickle.dump(_cifar_batch(4, "labels", 10), open(folder / name, "wb"), protocol=2)
    with pytest.raises(DataError, match=r"missing data_batch_3, test_batch\)"):
        load_dataset("cifar10", train=True, data_root=str(tmp_path))


def test_mnist_from_fashion_mnist_files_is_refused(tmp_path):
    """The two share file names and sizes: a flat folder of Fashion-MNIST's files loaded as
    MNIST (e.g. a data-root meant for the other data set) is refused, by mean intensity."""
    for f in DEBIAN.glob("t10k-*"):
        (tmp_path / f.name).symlink_to(f)
    with pytest.raises(DataError, match="looks like fashion-mnist"):
        load_dataset("mnist", train=False, data_root=str(tmp_path))
    assert len(load_dataset("fashion-mnist", train=False, data_root=str(tmp_path))) == 10000


def test_cifar100_pickles(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    pickle.dump(_cifar_batch(8, "fine_labels", 100), open(folder / "train", "wb"))
    pickle.dump(_cifar_batch(3, "fine_labels", 100), open(folder / "test", "wb"))
    pickle.dump({"fine_label_names": ["c"] * 100}, open(folder / "meta", "wb"))
    with pytest.warns(UserWarning):
        ds = load_dataset("cifar100", train=True, data_root=str(tmp_path))
    assert ds.x.shape == (8, 3, 32, 32) and ds.num_classes == 100


def test_svhn_mat(tmp_path):
    n = 7
    X = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
    y = np.array([10, 1, 2, 3, 4, 5, 6]).reshape(n, 1)  # SVHN stores digit 0 as label 10
    scipy.io.savemat(tmp_path / "train_32x32.mat", {"X": X, "y": y})
    with pytest.warns(UserWarning):
        ds = load_dataset("svhn", train=True, data_root=str(tmp_path))
    assert ds.x.shape == (n, 3, 32, 32)
    assert ds.y.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert np.array_equal(ds.x[0].numpy(), X[:, :, :, 0].transpose(2, 0, 1))


def test_missing_files_say_where_we_looked(tmp_path, monkeypatch):
    import flowerbed.datasets.loading as L

    def offline(*a, **k):
        raise DataError("download failed (offline)")

    monkeypatch.setattr(L, "_torchvision_download", offline)
    with pytest.raises(DataError, match=str(tmp_path)):
        load_dataset("cifar10", train=True, data_root=str(tmp_path))
    with pytest.raises(DataError, match="no IDX files"):
        load_dataset("mnist", train=True, data_root=str(tmp_path / "empty"))


def test_offline_mnist_is_one_line_with_advice_and_a_missing_root_is_said(tmp_path, monkeypatch,
                                                                         caplog):
    """Found by a README walk-through: offline, dataset='mnist' ended in urllib's multi-line
    error with no advice; a data-root that does not exist fell back without a word."""
    import torchvision.datasets as tvd

    def offline(*a, **k):
        raise OSError("Error downloading train-images-idx3-ubyte.gz:\nTried https://...\nfailed")

    monkeypatch.setattr(tvd, "MNIST", offline)
    with pytest.raises(DataError) as e:
        load_dataset("mnist", train=True, data_root=str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value) and "set data-root to a folder holding its IDX" in str(e.value)
    assert "does not exist" in caplog.text
    (tmp_path / "a-file").write_text("x")  # (was "does not exist", then other data)
    with pytest.raises(DataError, match="a-file is a file, not a folder"):
        load_dataset("cifar10", train=True, data_root=str(tmp_path / "a-file"))


def test_a_data_root_without_the_files_says_what_it_read_instead(tmp_path, caplog):
    """From a review: an existing data-root whose files are named otherwise (a dot in place of
    the dash) fell back to the Debian copy with nothing but an info line."""
    write_idx(tmp_path / "t10k-images.idx3-ubyte", rng.integers(0, 256, (5, 28, 28)))
    with caplog.at_level("WARNING", logger="flowerbed"):
        ds = load_dataset("fashion-mnist", train=False, data_root=str(tmp_path))
    assert len(ds) == 10000
    assert f"data-root {tmp_path} holds no fashion-mnist IDX files (t10k-images-idx3-ubyte" in caplog.text
    assert f"read {DEBIAN} instead" in caplog.text


def test_a_download_cannot_hang_for_ever(tmp_path, monkeypatch):
    """From a review: torchvision opens its URLs without a timeout, so a host that drops packets
    (a firewall) held a download for ever; it runs under a 60 s socket timeout, restored after."""
    import socket

    import torchvision.datasets as tvd

    from flowerbed.datasets import loading

    seen = []

    def stalled(**kwargs):
        seen.append(socket.getdefaulttimeout())
        raise TimeoutError("timed out")

    monkeypatch.setattr(tvd, "MNIST", stalled)
    before = socket.getdefaulttimeout()
    with pytest.raises(DataError, match="download of MNIST .* failed .TimeoutError: timed out"):
        loading._torchvision_download("MNIST", tmp_path / "m", train=True)
    assert seen == [60.0] and socket.getdefaulttimeout() == before
