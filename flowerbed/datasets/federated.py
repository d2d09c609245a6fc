"""The run's view of the data: the (optionally subsampled) train/test sets and each client's part."""

from __future__ import annotations

import functools

import numpy as np

from flowerbed.config import Config
from flowerbed.datasets.loading import DataSet, load_dataset
from flowerbed.datasets.partition import client_split, partition_indices


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


def client_data(cfg: Config, partition_id: int, num_partitions: int) -> tuple[DataSet, DataSet]:
    """(local train, local test) of one client; cached per process."""
    key = (cfg.dataset, cfg.data_root, cfg.train_samples, cfg.public_fraction, str(cfg.partition),
           cfg.seed,
           cfg.min_partition_size, cfg.local_test_fraction, partition_id, num_partitions)
    if key not in _CLIENT_CACHE:
        full = train_set(cfg)
        idx = client_partitions(cfg, num_partitions)[partition_id]
        tr, te = client_split(idx, cfg.local_test_fraction, cfg.seed, partition_id)
        _CLIENT_CACHE[key] = (full.subset(tr), full.subset(te))
    return _CLIENT_CACHE[key]
