"""The run's view of the data: the (optionally subsampled) train/test sets and each client's part."""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowerbed.config import DISTILL_METHODS, Config, ConfigError
from flowerbed.datasets.loading import (
    IMAGE_SHAPES,
    NUM_CLASSES,
    DataError,
    DataSet,
    load_dataset,
    read_idx,
    write_idx,
)
from flowerbed.datasets.partition import client_split, partition_indices

log = logging.getLogger("flowerbed")


def _limit(ds: DataSet, n: int, seed: int, salt: int) -> DataSet:
    if n <= 0 or n >= len(ds):
        return ds
    idx = np.sort(np.random.default_rng([seed, salt]).permutation(len(ds))[:n])
    return ds.subset(idx)


def full_train(cfg: Config) -> DataSet:
    """The whole training set, or its seeded `train-samples` subset."""
    return _limit(load_dataset(cfg.dataset, True, cfg.data_root), cfg.train_samples, cfg.seed, 1)


def public_indices(cfg: Config) -> np.ndarray:
    """Indices (into the training set) of the public set: a seeded ``public-fraction``, sorted."""
    n = len(full_train(cfg))
    k = int(round(n * cfg.public_fraction))
    if cfg.public_fraction > 0 and k < 1:
        raise ConfigError("public-fraction", cfg.public_fraction, f"gives no public sample out of "
                          f"{n} training samples: raise it (or train-samples)")
    if k >= n:
        raise ConfigError("public-fraction", cfg.public_fraction, f"takes all {n} training samples "
                          "and leaves the clients none: lower it")
    return np.sort(np.random.default_rng([cfg.seed, 3]).permutation(n)[:k])


@functools.lru_cache(maxsize=4)
def train_set(cfg: Config) -> DataSet:
    """The training set the run partitions: a seeded subset when ``train-samples`` > 0, minus
    the public set when ``public-fraction`` > 0."""
    full = full_train(cfg)
    if cfg.public_fraction <= 0:
        return full
    keep = np.setdiff1d(np.arange(len(full)), public_indices(cfg))
    return full.subset(keep)


@functools.lru_cache(maxsize=4)
def public_set(cfg: Config) -> DataSet:
    """The public set, labels removed; identical (same samples, same order) in every process."""
    return full_train(cfg).subset(public_indices(cfg)).without_labels()


@functools.lru_cache(maxsize=4)
def test_set(cfg: Config) -> DataSet:
    """The test set for server-side evaluation (a seeded subset when ``test-samples`` > 0)."""
    return _limit(load_dataset(cfg.dataset, False, cfg.data_root), cfg.test_samples, cfg.seed, 2)


def client_partitions(cfg: Config, num_partitions: int) -> list[np.ndarray]:
    """Indices into :func:`train_set` for every client (validates the split)."""
    labels = train_set(cfg).y.numpy()
    return partition_indices(labels, cfg.partition, num_partitions, cfg.seed, cfg.min_partition_size)


_CLIENT_CACHE: dict[tuple, tuple[DataSet, DataSet]] = {}


def client_data(cfg: Config, partition_id: int, num_partitions: int,
                data_dir: str = "") -> tuple[DataSet, DataSet]:
    """(local train, local test) of one client; cached per process.

    Either computed from the shared seed (the run's data set, split by ``partition``), or, with
    ``data_dir`` (a SuperNode's ``--node-config data-dir=...``), read from that folder of the
    client's own data (see :func:`export_partitions`).
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError("partition-id", partition_id, f"must be in [0, {num_partitions}) (the "
                          "SuperNode's --node-config)")
    key = (cfg.dataset, cfg.data_root, cfg.train_samples, cfg.public_fraction, str(cfg.partition),
           cfg.seed,
           cfg.min_partition_size, cfg.local_test_fraction, partition_id, num_partitions, data_dir)
    if key not in _CLIENT_CACHE:
        if data_dir:
            _CLIENT_CACHE[key] = read_partition_dir(cfg, Path(data_dir), partition_id, num_partitions)
        else:
            full = train_set(cfg)
            idx = client_partitions(cfg, num_partitions)[partition_id]
            tr, te = client_split(idx, cfg.local_test_fraction, cfg.seed, partition_id)
            _CLIENT_CACHE[key] = (full.subset(tr), full.subset(te))
    return _CLIENT_CACHE[key]


# ------------------------------------------------------------------ a client's own data folder
# <dir>/train-images.idx.gz, train-labels.idx.gz: the client's data (uint8 [N, C, H, W], labels)
# <dir>/test-images.idx.gz, test-labels.idx.gz: its local test split (optional: without them the
#   train files are split by local-test-fraction, seeded by (seed, partition-id))
# <dir>/partition.json: what the folder holds (data set, partition id, how it was made)


#: the run-config keys that make a split: an export's partition.json records them, and a run on
#: exported folders whose own values differ trains on the folders' split all the same
# (min-partition-size: a Dirichlet split is redrawn until every client holds that many)
EXPORT_KEYS = ("partition", "seed", "train-samples", "public-fraction", "local-test-fraction",
               "min-partition-size")


def split_settings(cfg: Config) -> dict[str, Any]:
    """``cfg``'s values of :data:`EXPORT_KEYS`, as partition.json records them."""
    return {k: str(v) if k == "partition" else v
            for k, v in cfg.to_run_config().items() if k in EXPORT_KEYS}


def folder_meta(folder: Path) -> dict[str, Any]:
    """A client data folder's partition.json ({} for a hand-made folder without one)."""
    meta_file = Path(folder) / "partition.json"
    return json.loads(meta_file.read_text()) if meta_file.exists() else {}


def export_partitions(cfg: Config, num_partitions: int, out: Path, replace: bool = False) -> list[Path]:
    """Write each client's (local train, local test) data, as the seed route computes it, into
    ``out/client-<i>/``; a SuperNode given ``data-dir=out/client-<i>`` then trains on exactly it.
    With ``replace``, the ``client-<i>/`` folders already there are removed first (once the
    split is known to work), so none of a larger earlier export is left beside it."""
    parts = client_partitions(cfg, num_partitions)  # validates the split first
    for old in client_folders(Path(out)) if replace else []:
        shutil.rmtree(old)
    folders = []
    for i in range(num_partitions):
        tr, te = client_data(cfg, i, num_partitions)
        folder = Path(out) / f"client-{i}"
        for split, ds in (("train", tr), ("test", te)):
            if split == "test" and not len(ds):  # none: a run's local-test-fraction splits it
                continue
            write_idx(folder / f"{split}-images.idx.gz", ds.x.numpy())
            write_idx(folder / f"{split}-labels.idx.gz", ds.y.numpy())
        (folder / "partition.json").write_text(json.dumps({
            "dataset": cfg.dataset, "partition-id": i, "num-partitions": num_partitions,
            **split_settings(cfg),
            "num-train": len(tr), "num-test": len(te), "num-assigned": len(parts[i])}, indent=1))
        folders.append(folder)
    return folders


def client_folders(out: Path) -> list[Path]:
    """The client data folders in ``out`` (an export's, or hand-made: ``client-<i>/``, what
    ``deploy up --data-dirs`` reads), in client order."""
    return sorted((p for p in out.glob("client-*/") if re.fullmatch(r"client-\d+", p.name)),
                  key=lambda p: int(p.name[7:]))


def read_partition_dir(cfg: Config, folder: Path, partition_id: int,
                       num_partitions: int | None = None) -> tuple[DataSet, DataSet]:
    """A client's own data folder -> (local train, local test), checked against the run and
    the node: what its partition.json records (if any) must match."""
    if not folder.is_dir():
        raise DataError(f"data-dir {folder} does not exist on this SuperNode")
    meta = folder_meta(folder)
    if meta.get("dataset", cfg.dataset) != cfg.dataset:
        raise DataError(f"data-dir {folder} holds {meta['dataset']}, the run uses {cfg.dataset}")
    if meta.get("partition-id", partition_id) != partition_id:
        raise DataError(f"data-dir {folder} holds partition {meta['partition-id']}, but this "
                        f"SuperNode is partition-id={partition_id}")
    if num_partitions is not None and meta.get("num-partitions", num_partitions) != num_partitions:
        raise DataError(f"data-dir {folder} is one of {meta['num-partitions']} exported partitions, "
                        f"but this SuperNode has num-partitions={num_partitions}")
    run = split_settings(cfg)
    public = [k for k in ("seed", "train-samples", "public-fraction") if meta.get(k, run[k]) != run[k]]
    if cfg.method in DISTILL_METHODS and cfg.public_fraction > 0 and public:
        raise DataError(f"data-dir {folder} was exported with "
                        f"{', '.join(f'{k}={meta[k]!r}' for k in public)}; this run has "
                        f"{', '.join(f'{k}={run[k]!r}' for k in public)}, which draw another public "
                        f"set than the one the export left out, so {cfg.method}'s public samples "
                        "would be in the clients' private data: run with the export's values, or "
                        "export again (flowerbed export) with the run's")
    if differ := [k for k, v in run.items() if meta.get(k, v) != v]:  # the folder is the data;
        log.warning("data-dir %s was exported with %s; this run has %s: the client trains on the "
                    "folder's data", folder, ", ".join(f"{k}={meta[k]!r}" for k in differ),
                    ", ".join(f"{k}={run[k]!r}" for k in differ))  # (seed: also model init)

    def read(split: str) -> DataSet | None:
        img, lbl = folder / f"{split}-images.idx.gz", folder / f"{split}-labels.idx.gz"
        if not img.exists() and not lbl.exists():
            return None
        if not (img.exists() and lbl.exists()):
            raise DataError(f"data-dir {folder}: {split}-images and {split}-labels come in pairs")
        x, y = torch.from_numpy(read_idx(img).copy()), torch.from_numpy(read_idx(lbl).astype(np.int64))
        if x.ndim == 3:
            x = x[:, None]
        expected = IMAGE_SHAPES[cfg.dataset]
        if tuple(x.shape[1:]) != tuple(expected) or len(x) != len(y):
            raise DataError(f"data-dir {folder}: {split} images {tuple(x.shape)} with {len(y)} "
                            f"labels; {cfg.dataset} needs [N, {', '.join(map(str, expected))}]")
        if len(y) and (y.min() < 0 or y.max() >= NUM_CLASSES[cfg.dataset]):
            raise DataError(f"data-dir {folder}: {split} labels outside 0..{NUM_CLASSES[cfg.dataset] - 1}")
        return DataSet(cfg.dataset, x.contiguous(), y, NUM_CLASSES[cfg.dataset])

    train, test = read("train"), read("test")
    if train is None:
        raise DataError(f"data-dir {folder} has no train-images.idx.gz/train-labels.idx.gz")
    if test is None or (not len(test) and cfg.local_test_fraction > 0):  # older exports: empty
        tr, te = client_split(np.arange(len(train)), cfg.local_test_fraction, cfg.seed, partition_id)
        train, test = train.subset(tr), train.subset(te)
    log.info("partition %d from its own data folder %s: %d train, %d local test samples",
             partition_id, folder, len(train), len(test))
    return train, test
