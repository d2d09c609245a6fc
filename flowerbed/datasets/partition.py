"""Partition a training set over clients with flwr-datasets' partitioners, offline.

The partitioners run on a local ``datasets.Dataset`` that holds only the labels and each
sample's index into the training set (no hub, no image copies). Results are cached per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
import zipfile
from pathlib import Path

import numpy as np

from flowerbed import cache_root
from flowerbed.config import ConfigError, Partition
from flowerbed.results import write_atomic

log = logging.getLogger("flowerbed")


def partition_indices(labels: np.ndarray, partition: Partition, num_partitions: int, seed: int,
                      min_partition_size: int = 10, redraws: int = 1) -> list[np.ndarray]:
    """Indices into ``labels`` for each of ``num_partitions`` clients (seeded, deterministic).

    ``redraws`` > 1: a Dirichlet split that flwr-datasets gives up on (10 draws below
    ``min_partition_size``) is tried again with seeds derived from ``seed``, up to that many
    times in all (the first with ``seed`` itself). Raises :class:`ConfigError` naming the key
    when the split is impossible.
    """
    labels = np.asarray(labels)
    key = (labels_digest(labels), str(partition),
           int(num_partitions), int(seed), int(min_partition_size), *([int(redraws)] if redraws > 1 else []))
    if key not in _CACHE:
        _CACHE[key] = _on_disk(key, lambda: _redrawn(labels, partition, num_partitions, seed,
                                                     min_partition_size, redraws))
    return [p.copy() for p in _CACHE[key]]


def labels_digest(labels: np.ndarray) -> str:
    """sha256 of a label sequence: what a seeded split depends on (the same files in the same
    order give the same split on every machine, whatever its byte order)."""
    return hashlib.sha256(np.asarray(labels).astype("<i8").tobytes()).hexdigest()


def _redrawn(labels, partition, num_partitions, seed, min_size, redraws) -> tuple[np.ndarray, ...]:
    tries = redraws if partition.kind == "dirichlet" else 1
    failed = ConfigError("partition", str(partition), "no draw")
    for attempt in range(tries):
        s = seed if attempt == 0 else int(np.random.default_rng([seed, 83, attempt]).integers(2 ** 31))
        try:
            return _split(labels, partition, num_partitions, s, min_size)
        except ConfigError as e:
            if e.key != "partition" or tries == 1:  # impossible whatever the draw, or one try
                raise
            failed = e
    raise ConfigError(failed.key, failed.value, f"{failed.allowed} (in {10 * tries} draws)")


_CACHE: dict[tuple, tuple[np.ndarray, ...]] = {}
#: part of the stored splits' names: this module's source, so that a change to the splitting
#: code never reuses a split the old code stored (a version number to raise by hand was
#: one edit away from being forgotten)
SPLIT_CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _on_disk(key: tuple, compute) -> tuple[np.ndarray, ...]:
    """The split from ``<cache>/partitions/`` or computed and stored there.

    Deployed SuperNodes start a new ClientApp process per message; reading the stored split
    spares each one flwr-datasets' import (about 1 s). The file name hashes the labels, the
    partition, the client count, the seed, the minimum size, the flwr-datasets version and
    :data:`SPLIT_CODE`, so a stored split is only reused for exactly the same inputs and code.
    """
    from importlib.metadata import version

    name = hashlib.sha256(repr((*key, version("flwr-datasets"), SPLIT_CODE)).encode()
                          ).hexdigest()[:32]
    path = cache_root() / "partitions" / f"{name}.npz"
    with contextlib.suppress(OSError, ValueError, KeyError, zipfile.BadZipFile):
        with np.load(path) as f:
            return tuple(f[f"p{i}"] for i in range(key[2]))
    out = compute()
    with contextlib.suppress(OSError):  # a read-only home only loses the speed-up
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: np.savez(f, **{f"p{i}": p for i, p in enumerate(out)}))
    return out


def check_partition(labels: np.ndarray, partition: Partition, num_partitions: int) -> None:
    """Reject impossible splits before any data is moved."""
    n, classes = len(labels), len(np.unique(labels))
    if num_partitions < 1:
        raise ConfigError("num-partitions", num_partitions, "need at least one client")
    if num_partitions > n:
        raise ConfigError("num-partitions", num_partitions,
                          f"more clients than training samples ({n}); use fewer clients or more data")
    if partition.kind == "pathological" and partition.param > classes:
        raise ConfigError("partition", str(partition),
                          f"k={partition.param} classes per client but the data has {classes} classes")
    if partition.kind == "shards" and partition.param * num_partitions > n:
        raise ConfigError("partition", str(partition),
                          f"{partition.param} shards x {num_partitions} clients exceeds {n} samples")


def warn_unheld(labels: np.ndarray, parts: list[np.ndarray], partition: Partition) -> None:
    """Warn when the split leaves samples to no client (``pathological:k`` with clients + k − 1
    below the number of classes): those classes are never trained on, yet tested."""
    labels = np.asarray(labels)
    used = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    unheld = sorted(set(np.unique(labels).tolist()) - set(np.unique(labels[used]).tolist()))
    if len(used) < len(labels):
        advice = ("flwr-datasets' shards have a whole number of samples each, and the remainder "
                  "is dropped" if partition.kind == "shards" else "use more clients or a larger k")
        log.warning("partition %s leaves %d of %d training samples to no client%s; %s", partition,
                    len(labels) - len(used), len(labels),
                    f" (classes {unheld} are held by none)" if unheld else "", advice)


def _split(labels, partition, num_partitions, seed, min_size) -> tuple[np.ndarray, ...]:
    from datasets import Dataset
    from flwr_datasets import partitioner as fp

    check_partition(labels, partition, num_partitions)
    # Shuffle once with the run's seed so that even the IID split (which has no seed of its own)
    # depends on it; "idx" maps each row back to the training set.
    order = np.random.default_rng(seed).permutation(len(labels))
    ds = Dataset.from_dict({"idx": order, "label": labels[order]})
    kind, p = partition.kind, partition.param
    if kind == "dirichlet" and min_size * num_partitions > len(labels):
        raise ConfigError("min-partition-size", min_size, f"{num_partitions} clients x {min_size} "
                          f"exceeds the {len(labels)} training samples; lower it, or use fewer "
                          "clients or more train-samples")
    if kind == "iid":
        part = fp.IidPartitioner(num_partitions=num_partitions)
    elif kind == "dirichlet":
        part = fp.DirichletPartitioner(num_partitions=num_partitions, partition_by="label",
                                       alpha=float(p), min_partition_size=min_size, seed=seed)
    elif kind == "pathological":
        # "deterministic" gives client i the classes i, ..., i+k-1 (mod C), so every class is held
        # by some client whenever num_partitions + k - 1 >= C; "random" can leave classes unheld.
        part = fp.PathologicalPartitioner(num_partitions=num_partitions, partition_by="label",
                                          num_classes_per_partition=int(p),
                                          class_assignment_mode="deterministic", seed=seed)
    else:
        part = fp.ShardPartitioner(num_partitions=num_partitions, partition_by="label",
                                   num_shards_per_partition=int(p), seed=seed)
    part.dataset = ds
    try:
        with warnings.catch_warnings():  # its unused-classes hint names its own option, not
            # one of ours; warn_unheld says which classes no client holds
            warnings.filterwarnings("ignore", message="Classes: .* will NOT be used")
            # one per redraw, listing every client's alpha; a split that never succeeds is our
            # one-line ConfigError below, and one that does needs no warning
            warnings.filterwarnings("ignore", message="The specified min_partition_size")
            # pyarrow's deprecation inside the shard partitioner's sort, twice a split
            warnings.filterwarnings("ignore", message=".*null_placement", category=FutureWarning)
            out = tuple(np.asarray(part.load_partition(i)["idx"], dtype=np.int64)
                        for i in range(num_partitions))
    except ValueError as e:
        hint = ""
        if kind == "dirichlet":  # flwr-datasets redraws at most 10 times, then gives up
            lower = f"lower min-partition-size (now {min_size}), " if min_size > 1 else ""
            hint = (f"; {lower}raise alpha, use more train-samples or fewer clients, or another "
                    "seed (flwr-datasets gives up after 10 draws)")
        raise ConfigError("partition", str(partition),
                          f"flwr-datasets cannot split {len(labels)} samples over "
                          f"{num_partitions} clients this way ({e}){hint}") from None
    empty = [i for i, o in enumerate(out) if len(o) == 0]
    if empty:
        raise ConfigError("partition", str(partition),
                          f"clients {empty[:5]} get no samples; use fewer clients or more data")
    return out


def client_split(indices: np.ndarray, test_fraction: float, seed: int, partition_id: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into local train and local test parts (seeded per client).

    With ``test_fraction`` > 0 each part gets at least one sample; a single-sample client keeps
    it for training (no local test split) rather than having nothing to train on."""
    rng = np.random.default_rng([seed, partition_id, 7919])
    perm = rng.permutation(indices)
    n_test = int(round(len(perm) * test_fraction))
    if test_fraction > 0:
        n_test = min(max(n_test, 1), len(perm) - 1) if len(perm) >= 2 else 0
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def label_histogram(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """``[clients, classes]`` counts of each label in each partition (flwr-datasets'
    ``compute_counts``)."""
    from flwr_datasets.metrics import compute_counts

    counts = compute_counts(_fixed(labels, parts), "label")
    return counts.reindex(columns=range(num_classes), fill_value=0).to_numpy(dtype=np.int64)


def plot_histogram(labels: np.ndarray, parts: list[np.ndarray], out, title: str = ""):
    """Stacked bars, one per client, one colour per class (flwr-datasets'
    ``plot_label_distributions``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from flwr_datasets.visualization import plot_label_distributions

    fig, _, _ = plot_label_distributions(
        _fixed(labels, parts), "label", legend=True, legend_title="class", title=title,
        figsize=(max(6, len(parts) * 0.35), 4), verbose_labels=False)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def _fixed(labels: np.ndarray, parts: list[np.ndarray]):
    """A flwr-datasets Partitioner over splits already made (for its metrics and plots)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import Partitioner

    class Fixed(Partitioner):
        @property
        def num_partitions(self) -> int:
            return len(parts)

        def load_partition(self, partition_id: int) -> Dataset:
            return self.dataset.select(parts[partition_id])

    p = Fixed()
    p.dataset = Dataset.from_dict({"label": np.asarray(labels, dtype=np.int64)})
    return p
