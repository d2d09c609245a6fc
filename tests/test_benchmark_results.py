"""Benchmarks keep the splits an earlier run measured only when those were measured the same way."""

import json

import benchmarks.common as common


def test_kept_splits_only_with_the_same_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    base = {"num-server-rounds": 10, "seed": 0, "train-samples": 12000}
    (tmp_path / "b.json").write_text(json.dumps({
        "results": {"s1": {"m": 1}, "s2": {"m": 2}, "s3": {"m": 3}},
        "split-configs": {"s1": base, "s2": {**base, "num-server-rounds": 30},
                          "s3": {**base, "train-samples": 6000}}}))
    results, configs = common.kept_splits("b", {**base, "num-server-rounds": 5},
                                          vary=("num-server-rounds",))
    assert results == {"s1": {"m": 1}, "s2": {"m": 2}}  # s3 had other data: dropped
    assert configs["s2"]["num-server-rounds"] == 30
    assert common.kept_splits("b", {**base, "num-server-rounds": 5}) == ({}, {})
    assert common.kept_splits("missing", base) == ({}, {})


def test_merged_rows_overlay_the_kept_ones_in_order():
    kept = {"a": 1, "b": 2, "stale": 9}
    assert common.merged_rows(kept, {"b": 20, "c": 3}, ["c", "b", "a"]) == {"c": 3, "b": 20, "a": 1}
