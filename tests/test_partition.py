"""Partitioners: sizes, label skew, determinism, agreement with flwr-datasets, client splits."""

import numpy as np
import pytest
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner

from flowerbed.config import ConfigError, parse_partition
from flowerbed.datasets.partition import client_split, label_histogram, labels_digest, partition_indices

rng = np.random.default_rng(0)
LABELS = np.repeat(np.arange(10), 300)[rng.permutation(3000)]


def split(spec, n=10, seed=0, labels=LABELS):
    return partition_indices(labels, parse_partition(spec), n, seed, min_partition_size=10)


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.5", "pathological:2", "shards:2"])
def test_disjoint_and_covering(spec):
    parts = split(spec)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(set(allidx.tolist()))
    assert set(allidx.tolist()) <= set(range(len(LABELS)))
    if spec in ("iid", "dirichlet:0.5"):
        assert len(allidx) == len(LABELS)
    assert all(len(p) > 0 for p in parts)


def test_the_labels_digest_depends_on_the_labels_not_their_dtype_or_byte_order():
    digest = labels_digest(LABELS)
    assert labels_digest(LABELS.astype(">i8")) == digest  # a big-endian machine's copy
    assert labels_digest(LABELS.astype(np.uint8)) == digest
    assert labels_digest(LABELS[::-1]) != digest


def test_iid_sizes_equal():
    sizes = [len(p) for p in split("iid")]
    assert max(sizes) - min(sizes) <= 1


def test_deterministic_and_seeded():
    a, b, c = split("dirichlet:0.3", seed=1), split("dirichlet:0.3", seed=1), split("dirichlet:0.3", seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    # the IID split, which has no seed of its own in flwr-datasets, depends on ours too
    assert not np.array_equal(split("iid", seed=1)[0], split("iid", seed=2)[0])


def _skew(parts):
    hist = label_histogram(LABELS, parts, 10).astype(float)
    p = hist / hist.sum(1, keepdims=True)
    return float((p.max(1)).mean())  # mean share of each client's majority class


def test_label_skew_orders_with_alpha():
    assert _skew(split("dirichlet:0.1")) > _skew(split("dirichlet:1.0")) > _skew(split("iid"))


def test_min_partition_size_respected():
    assert min(len(p) for p in split("dirichlet:0.1")) >= 10


def test_pathological_k_classes_and_all_classes_held():
    for k in (1, 2):
        parts = split(f"pathological:{k}")
        hist = label_histogram(LABELS, parts, 10)
        assert ((hist > 0).sum(1) == k).all()
        assert (hist.sum(0) > 0).all(), "every class must be held by some client"


def test_agrees_with_flwr_datasets():
    """Our wrapper is flwr-datasets' DirichletPartitioner on the seeded, shuffled label set."""
    seed = 3
    order = np.random.default_rng(seed).permutation(len(LABELS))
    ds = Dataset.from_dict({"idx": order, "label": LABELS[order]})
    part = DirichletPartitioner(num_partitions=10, partition_by="label", alpha=0.5,
                                min_partition_size=10, seed=seed)
    part.dataset = ds
    ours = split("dirichlet:0.5", seed=seed)
    for i in range(10):
        assert np.array_equal(np.asarray(part.load_partition(i)["idx"]), ours[i])


def test_client_split_fraction_and_disjoint():
    idx = np.arange(100, 200)
    tr, te = client_split(idx, 0.25, seed=0, partition_id=4)
    assert len(te) == 25 and len(tr) == 75
    assert set(tr.tolist()).isdisjoint(te.tolist()) and set(tr) | set(te) == set(idx)
    tr2, te2 = client_split(idx, 0.25, seed=0, partition_id=4)
    assert np.array_equal(te, te2)


def test_a_single_sample_client_keeps_it_for_training():
    """With local-test-fraction >= 0.5 a one-sample client used to get (0 train, 1 test): every
    training reply was then refused as having no samples."""
    for frac in (0.2, 0.6):
        tr, te = client_split(np.array([7]), frac, seed=0, partition_id=1)
        assert tr.tolist() == [7] and te.tolist() == []
    tr, te = client_split(np.array([7, 8]), 0.9, seed=0, partition_id=1)
    assert len(tr) == 1 and len(te) == 1


def test_an_impossible_dirichlet_minimum_size_is_refused_up_front():
    from flowerbed.config import ConfigError

    with pytest.raises(ConfigError, match=r"'min-partition-size'.*30 clients x 10 exceeds the 200"):
        partition_indices(LABELS[:200], parse_partition("dirichlet:0.5"), 30, 0, 10)


def test_a_split_that_leaves_classes_to_no_client_is_named(caplog):
    """pathological:1 over 5 clients holds 5 of 10 classes: the rest is dropped silently by
    flwr-datasets (its own warning names an option flowerbed does not expose)."""
    from flowerbed.datasets.partition import warn_unheld

    spec = parse_partition("pathological:1")
    parts = partition_indices(LABELS, spec, 5, seed=0)
    with caplog.at_level("WARNING", logger="flowerbed"):
        warn_unheld(LABELS, parts, spec)
    assert "classes [5, 6, 7, 8, 9] are held by none" in caplog.text
    caplog.clear()
    warn_unheld(LABELS, partition_indices(LABELS, spec, 10, seed=0), spec)
    assert caplog.text == ""
    shards = parse_partition("shards:3")  # a remainder below one shard: said so, not "larger k"
    with caplog.at_level("WARNING", logger="flowerbed"):
        warn_unheld(LABELS, partition_indices(LABELS, shards, 7, seed=0), shards)
    assert "the remainder is dropped" in caplog.text and "larger k" not in caplog.text


# ------------------------------------------------ found by a mutation review (session 37)


def test_a_small_client_still_gets_one_local_test_sample():
    """R1: test_fraction > 0 gives each part at least one sample (round(5 * 0.05) = 0)."""
    from flowerbed.datasets.partition import client_split

    tr, te = client_split(np.arange(5), 0.05, seed=0, partition_id=0)
    assert len(te) == 1 and len(tr) == 4


def test_a_stored_split_is_reused_only_by_the_same_splitting_code(tmp_path, monkeypatch):
    """Stored splits were named by a version number to raise by hand: a change to the splitting
    code that forgot it would have reused the old code's splits. The name now hashes the code."""
    from flowerbed.datasets import partition as part

    monkeypatch.setenv("FLOWERBED_CACHE", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return (np.arange(3), np.arange(3, 6))

    key = ("labels", "iid", 2, 0, 1)
    assert [p.tolist() for p in part._on_disk(key, compute)] == [[0, 1, 2], [3, 4, 5]]
    part._on_disk(key, compute)
    assert len(calls) == 1  # stored, then read back
    monkeypatch.setattr(part, "SPLIT_CODE", "other code")
    part._on_disk(key, compute)
    assert len(calls) == 2


def test_a_node_with_a_partition_id_out_of_range_is_named_before_round_1(tmp_path):
    """From a review: the client loaded its data in whoami first and failed with an IndexError
    the server only logged ("did not answer whoami"), so the run went on without the partition."""
    from inprocess import run_inprocess

    from flowerbed.config import Config, ConfigError
    from flowerbed.datasets.federated import client_data

    rc = {"num-server-rounds": 1, "train-samples": 600, "test-samples": 100, "min-clients": 2,
          "output-dir": str(tmp_path), "run-name": "r", "client-state-dir": str(tmp_path / "s")}
    for pid in (3, -1):
        with pytest.raises(ConfigError, match=r"'partition-id' = .* must be in \[0, 3\)"):
            client_data(Config.from_run_config(rc), pid, 3)
    with pytest.raises(ConfigError, match=r"'partition-id' = 3 is invalid: must be in \[0, 3\) \(node"):
        run_inprocess(rc, 3, node_extra=[{}, {}, {"partition-id": 3}])


def test_a_redrawn_split_that_no_draw_can_give_fails_at_once(monkeypatch):
    """Fed-ADE's target split is redrawn up to 600 times (6,000 draws): a split too small for the
    clients' minimum whatever the draw is refused at the first, not after every one."""
    from flowerbed.datasets import partition as part

    calls = []
    split = part._split
    monkeypatch.setattr(part, "_split", lambda *a: calls.append(a) or split(*a))
    with pytest.raises(ConfigError, match="min-partition-size"):
        part.partition_indices(np.arange(30) % 3, parse_partition("dirichlet:0.1"), 20, 0,
                               min_partition_size=6, redraws=600)
    assert len(calls) == 1
