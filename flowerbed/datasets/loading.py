"""Load image classification data sets into uint8 tensors, once per process.

Look-up order for every data set: the ``data-root`` key, then (Fashion-MNIST only) the Debian
package path ``/usr/share/datasets/fashion-mnist``, then torchvision's download into the data
root (needs network). Images are kept as uint8 ``[N, C, H, W]`` and normalised per batch, so a
process holds one compact copy whatever the number of clients it serves.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import logging
import pickle
import socket
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowerbed.results import write_atomic

log = logging.getLogger("flowerbed")

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_ROOT = Path.home() / ".cache" / "flowerbed" / "data"

# (mean, std) per channel, used to normalise uint8 images at batch time.
STATS = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}
IMAGE_SHAPES = {"fashion-mnist": (1, 28, 28), "mnist": (1, 28, 28), "cifar10": (3, 32, 32),
                "cifar100": (3, 32, 32), "svhn": (3, 32, 32)}
NUM_CLASSES = {"fashion-mnist": 10, "mnist": 10, "cifar10": 10, "cifar100": 100, "svhn": 10}


class DataError(RuntimeError):
    """A data set could not be found or read; the message says where we looked."""


@dataclass(frozen=True)
class DataSet:
    """One split of a data set: uint8 images ``[N, C, H, W]`` and int64 labels ``[N]``.

    ``pixels`` says what a model is fed: ``standardised`` (the data set's channel statistics)
    or ``raw`` (0-255 floats, as Fed-ADE's official CIFAR code feeds its model).
    """

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    pixels: str = "standardised"

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.x.shape[1:])  # type: ignore[return-value]

    def normalise(self, xb: torch.Tensor) -> torch.Tensor:
        """uint8 batch -> float batch, standardised with the data set's channel statistics
        (or left at 0-255 with ``pixels='raw'``)."""
        if self.pixels == "raw":
            return xb.float()
        mean, std = STATS[self.name]
        m = torch.tensor(mean, device=xb.device).view(1, -1, 1, 1)
        s = torch.tensor(std, device=xb.device).view(1, -1, 1, 1)
        return (xb.float() / 255.0 - m) / s

    def without_labels(self) -> DataSet:
        """The same images with every label replaced by -1 (for clients that must not see them)."""
        return dataclasses.replace(self, y=torch.full_like(self.y, -1))

    def subset(self, indices: np.ndarray | torch.Tensor) -> DataSet:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return dataclasses.replace(self, x=self.x[idx], y=self.y[idx])


def load_dataset(name: str, train: bool, data_root: str = "") -> DataSet:
    """The train or test split of ``name``; cached per process (Flower may run any client here)."""
    if data_root and Path(data_root).expanduser().exists() and not Path(data_root).expanduser().is_dir():
        raise DataError(f"data-root {data_root} is a file, not a folder")
    return _load_cached(name, bool(train), str(data_root or ""))


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, train: bool, data_root: str) -> DataSet:
    loader = {
        "fashion-mnist": _load_fashion_mnist,
        "mnist": _load_mnist,
        "cifar10": _load_cifar,
        "cifar100": _load_cifar,
        "svhn": _load_svhn,
    }.get(name)
    if loader is None:
        raise DataError(f"unknown data set '{name}'; known: {', '.join(NUM_CLASSES)}")
    x, y = loader(name, train, Path(data_root).expanduser() if data_root else None)
    if x.ndim == 3:
        x = x[:, None]
    if len(x) != len(y) or len(y) == 0:
        raise DataError(f"{name}: {len(x)} images but {len(y)} labels")
    if tuple(x.shape[1:]) != IMAGE_SHAPES[name]:
        raise DataError(f"{name}: images of shape {tuple(x.shape[1:])}, not {IMAGE_SHAPES[name]} "
                        "(another data set's files?)")
    if not 0 <= int(y.min()) <= int(y.max()) < NUM_CLASSES[name]:
        raise DataError(f"{name}: labels from {int(y.min())} to {int(y.max())}, outside 0-"
                        f"{NUM_CLASSES[name] - 1} (damaged files, or another data set's)")
    ds = DataSet(name, x.contiguous(), y.long(), NUM_CLASSES[name])
    log.info("loaded %s %s: %d samples of shape %s", name, "train" if train else "test", len(ds),
             tuple(ds.shape))
    return ds


# ---------------------------------------------------------------- IDX (MNIST, Fashion-MNIST)

IDX_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped).

    torchvision's reader (``read_sn3_pascalvincent_tensor``) only opens uncompressed files at a
    path, and the Debian package ships gzipped files in a read-only folder, so we parse the
    (trivial) format here: magic (0, 0, dtype, ndim), ndim big-endian uint32 sizes, data.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # zlib: damaged compressed data
        raise DataError(f"cannot read IDX file {path}: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path} is truncated inside its header ({len(raw)} bytes)")
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: header says {tuple(dims)}, found {data.size} bytes")
    return data.reshape(tuple(dims))


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (gzipped when ``path`` ends in .gz), atomically."""
    import struct

    array = np.asarray(array)
    if array.dtype != np.uint8:
        if array.size and (array.min() < 0 or array.max() > 255):
            raise ValueError(f"IDX uint8 needs values in 0..255, got {array.min()}..{array.max()}")
        array = array.astype(np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = header + np.ascontiguousarray(array).tobytes()
    write_atomic(path, lambda f: f.write(gzip.compress(data) if path.suffix == ".gz" else data))


def _find_idx(folder: Path, stem: str) -> Path | None:
    for sub in ("", "raw"):
        for suffix in ("", ".gz"):
            p = folder / sub / (stem + suffix)
            if p.is_file():
                return p
    return None


def _load_idx_pair(name: str, train: bool, folders: list[Path]
                   ) -> tuple[torch.Tensor, torch.Tensor, Path] | None:
    """The first of ``folders`` holding the split's IDX image and label files: (images, labels,
    that folder)."""
    img_stem, lbl_stem = IDX_FILES[train]
    for folder in folders:
        img, lbl = _find_idx(folder, img_stem), _find_idx(folder, lbl_stem)
        if img and lbl:
            x = read_idx(img)
            _check_idx_identity(name, x, img)
            return torch.from_numpy(x.copy()), torch.from_numpy(read_idx(lbl).astype(np.int64)), folder
    return None


def _check_idx_identity(name: str, x: np.ndarray, path: Path) -> None:
    """MNIST and Fashion-MNIST share file names and sizes; their full files differ in mean
    intensity (0.131 and 0.286), so full-size files of the other one are refused. (Smaller
    files, e.g. a subset, are not checked.)"""
    if len(x) not in (60000, 10000):
        return
    other = "mnist" if name == "fashion-mnist" else "fashion-mnist"
    mean, own, theirs = float(x.mean()) / 255, STATS[name][0][0], STATS[other][0][0]
    if abs(mean - theirs) < abs(mean - own):
        raise DataError(f"{name}: {path} looks like {other} (mean intensity {mean:.3f}; {name}'s "
                        f"is {own}, {other}'s {theirs}); point data-root at {name}'s files "
                        f"(or its torchvision folder)")


def _torchvision_download(cls_name: str, root: Path, **kwargs) -> object:
    import torchvision.datasets as tvd

    timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60.0)  # torchvision's urlopen has none: a host that drops packets
    try:  # (a firewall) held a connection, or a stalled read, for ever
        root.mkdir(parents=True, exist_ok=True)
        return getattr(tvd, cls_name)(root=str(root), download=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - network errors come in many types
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise DataError(f"download of {cls_name} into {root} failed ({type(e).__name__}: {first})"
                        ) from e
    finally:
        socket.setdefaulttimeout(timeout)


def _load_fashion_mnist(name: str, train: bool, root: Path | None):
    return _load_mnist_like(name, train, root, "FashionMNIST", [DEBIAN_FASHION_MNIST])


def _load_mnist(name: str, train: bool, root: Path | None):
    return _load_mnist_like(name, train, root, "MNIST", [])


def _load_mnist_like(name, train, root, tv_name, extra):
    base = root or DEFAULT_ROOT
    folders = [base / tv_name, base, *extra]  # the data set's own torchvision folder first
    if root and not root.is_dir():
        log.warning("data-root %s does not exist; looking in %s", root,
                    ", ".join(str(f) for f in folders[2:]) or "nowhere else")
    found = _load_idx_pair(name, train, folders)
    if found:
        x, y, folder = found
        if root and root.is_dir() and folder in extra:  # a data-root that holds none of its files
            log.warning("data-root %s holds no %s IDX files (%s[.gz], in it, its raw/ or %s/): "
                        "read %s instead", root, name, IDX_FILES[train][0], tv_name, folder)
        return x, y
    where = ", ".join(str(f) for f in folders)
    log.info("%s not found in %s; trying torchvision download", name, where)
    try:
        ds = _torchvision_download(tv_name, base, train=train)
    except DataError as e:
        hint = (" (on Debian: apt-get install dataset-fashion-mnist)" if name == "fashion-mnist"
                else "; set data-root to a folder holding its IDX files (train-images-idx3-ubyte"
                     "[.gz] and the like)")
        raise DataError(f"{name}: no IDX files in {where}{hint}, and {e}") from None
    return ds.data, ds.targets


# ---------------------------------------------------------------- torchvision formats


def _lenient(cls):
    """A torchvision data-set class that warns, instead of failing, on a checksum mismatch.

    torchvision verifies MD5 sums of CIFAR/SVHN files before reading them. We keep that check
    (a mismatch is logged) but read any file in the real on-disk format, so re-packed or
    test-sized files load too.
    """

    class Lenient(cls):  # type: ignore[misc, valid-type]
        def _check_integrity(self) -> bool:  # noqa: D401
            if super()._check_integrity():
                return True
            if not _files_exist(self):
                return False
            warnings.warn(f"{cls.__name__}: files in {self.root} differ from the official "
                          "release checksums; reading them anyway", stacklevel=2)
            return True

        def _load_meta(self) -> None:  # CIFAR's class names: also checksummed, never used here
            try:
                super()._load_meta()
            except RuntimeError:
                self.classes = []

    Lenient.__name__ = cls.__name__
    return Lenient


def _files_exist(ds) -> bool:
    root = Path(ds.root)
    if hasattr(ds, "train_list"):  # CIFAR
        folder = root / ds.base_folder
        return all((folder / f).is_file() for f, _ in ds.train_list + ds.test_list)
    return (root / ds.split_list[ds.split][1]).is_file()  # SVHN


def _load_cifar(name: str, train: bool, root: Path | None):
    import torchvision.datasets as tvd

    cls = _lenient(tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100)
    base = root or DEFAULT_ROOT
    try:
        ds = cls(root=str(base), train=train, download=False)
    except RuntimeError:  # torchvision's "not found or corrupted"
        folder = base / cls.base_folder
        missing = [f for f, _ in cls.train_list + cls.test_list if not (folder / f).is_file()]
        where = f"{folder}/" + (f" (missing {', '.join(missing)})" if folder.is_dir() else "")
        ds = _download_or_fail(name, cls.__name__, base, where, train=train)
    except Exception as e:  # noqa: BLE001 - a truncated or damaged file: pickle errors of many kinds
        folder = base / cls.base_folder
        bad = [f for f, _ in (cls.train_list if train else cls.test_list) if not _unpickles(folder / f)]
        raise _unreadable(name, ", ".join(str(folder / f) for f in bad) or f"{folder}/", e) from None
    x = torch.from_numpy(np.asarray(ds.data)).permute(0, 3, 1, 2)
    return x, torch.as_tensor(ds.targets, dtype=torch.long)


def _unpickles(path: Path) -> bool:
    """Whether a CIFAR batch file reads whole (torchvision's error does not say which failed)."""
    try:
        with open(path, "rb") as f:
            pickle.load(f, encoding="latin1")
    except Exception:  # noqa: BLE001 - truncated, damaged, unreadable: any of them
        return False
    return True


def _load_svhn(name: str, train: bool, root: Path | None):
    import torchvision.datasets as tvd

    cls = _lenient(tvd.SVHN)
    base = root or DEFAULT_ROOT
    split = "train" if train else "test"
    try:
        ds = cls(root=str(base), split=split, download=False)
    except RuntimeError:  # torchvision's "not found or corrupted"
        ds = _download_or_fail(name, "SVHN", base, f"{base}/{split}_32x32.mat", split=split)
    except Exception as e:  # noqa: BLE001 - a truncated or damaged .mat file
        raise _unreadable(name, f"{base}/{split}_32x32.mat", e) from None
    return torch.from_numpy(np.asarray(ds.data)), torch.as_tensor(ds.labels, dtype=torch.long) % 10


def _unreadable(name: str, where: str, e: Exception) -> DataError:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return DataError(f"{name}: cannot read {where} ({type(e).__name__}: {first}); is a file there "
                     "truncated or damaged (an interrupted download or copy)?")


def _download_or_fail(name: str, cls_name: str, base: Path, expected: str, **kwargs):
    log.info("%s not found at %s; trying torchvision download", name, expected)
    try:
        return _torchvision_download(cls_name, base, **kwargs)
    except DataError as e:
        raise DataError(f"{name}: nothing readable at {expected}, and {e}. "
                        f"Set data-root to a folder holding the torchvision layout.") from None
