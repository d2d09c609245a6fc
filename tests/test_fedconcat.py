"""FedConcat: k-means on label distributions, the concatenated model, the stage's reply checks,
and a whole run in-process across the two stages (with clients joining after round 1)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from inprocess import run_inprocess

from flowerbed.clients.fedconcat import ConcatModel, classifier_for
from flowerbed.config import Config, ConfigError
from flowerbed.models.cnn import CNN
from flowerbed.results import read_metrics
from flowerbed.strategies.fedconcat import FedConcatStrategy, kmeans


def test_kmeans_groups_the_label_distributions_is_seeded_and_drops_empty_clusters():
    eye = np.eye(4)
    points = np.array([eye[0], eye[0] * 0.9 + eye[1] * 0.1, eye[2], eye[2] * 0.8 + eye[3] * 0.2])
    cent, lab = kmeans(points, 2, seed=0)
    assert lab[0] == lab[1] != lab[2] == lab[3] and cent.shape == (2, 4)
    assert (kmeans(points, 2, seed=0)[1] == lab).all()
    # from a review: two identical distributions and k = 3 left a cluster empty (an untrained
    # encoder in the concatenation); k is capped at the distinct points and labels stay 0 … k'−1
    cent, lab = kmeans(np.array([eye[0], eye[0], eye[1]]), 3, seed=0)
    assert len(cent) == 2 and sorted(set(lab)) == [0, 1] and lab[0] == lab[1] != lab[2]


def test_the_concatenated_model_trains_only_its_classifier_and_keeps_its_encoders_in_eval_mode():
    encoders = [CNN(width=0.25), CNN(width=0.25)]
    clf = classifier_for(encoders, 10)
    assert clf.in_features == 2 * encoders[0].feature_dim
    model = ConcatModel(encoders, clf).train()
    assert not any(e.training for e in model.encoders) and model.classifier.training
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == ["classifier.weight", "classifier.bias"]
    x = torch.randn(3, 1, 28, 28)
    want = clf(torch.cat([encoders[0].features(x), encoders[1].features(x)], 1))
    assert torch.allclose(model(x), want)


def test_stage_replies_the_unweighted_classifier_mean_and_a_late_client():
    with pytest.raises(ConfigError, match="fedconcat-encoder-rounds.*< num-server-rounds"):
        Config.from_run_config({"method": "fedconcat", "num-server-rounds": 3, "fedconcat-encoder-rounds": 3})
    s = FedConcatStrategy(Config.from_run_config({"method": "fedconcat"}))
    w = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    s._reference, s.classifier = w, ArrayRecord({"weight": Array(np.zeros((10, 4), np.float32))})
    model_reply = RecordDict({"arrays": w, "m": MetricRecord({"num-examples": 10})})
    clf_reply = RecordDict({"classifier": s.classifier, "m": MetricRecord({"num-examples": 10})})
    assert s.check_arrays(model_reply) is None and s.check_arrays(clf_reply) is not None
    s._stage2 = True
    assert s.check_arrays(clf_reply) is None and "'classifier' alone" in s.check_arrays(model_reply)
    # the classifier stage averages without weights: every client took the same few steps
    from conftest import prepared, reply

    sent = prepared(s, [10, 11])
    def clf(value: float, n: int) -> RecordDict:
        return RecordDict({"classifier": ArrayRecord({"weight": Array(np.full((10, 4), value, np.float32))}),
                           "m": MetricRecord({"num-examples": n})})

    rep = [reply(sent[0], clf(1.0, 1)), reply(sent[1], clf(3.0, 99))]
    s._stage2 = True
    out, _ = s.aggregate_train(6, rep)
    assert np.allclose(out["weight"].numpy(), 2.0)
    # a partition first seen after the clustering joins the nearest centroid's cluster
    s.centroids = np.eye(10)[[0, 5]]
    counts = [0] * 10
    counts[5] = 7
    s.on_whoami(7, ConfigRecord({"label-counts": counts}))
    assert s.cluster_of["7"] == 1
    s.on_whoami(8, ConfigRecord({"label-counts": [1.5] * 10}))  # malformed: cluster 0, with a warning
    assert "8" not in s.cluster_of and 8 not in s.shares
    # a resumed run hears every whoami before it reads the checkpoint: a partition the run had
    # not seen still joins the nearest cluster, not cluster 0 (from a review)
    resumed = FedConcatStrategy(Config.from_run_config({"method": "fedconcat"}))
    resumed.on_whoami(7, ConfigRecord({"label-counts": counts}))
    resumed.restore_state({**s.checkpoint_state(), "cluster_of": {"0": 0}})
    assert resumed.cluster_of == {"0": 0, "7": 1}


def test_two_stages_in_process_with_half_the_clients_a_round(tmp_path, caplog):
    rc = {"num-server-rounds": 4, "train-samples": 1200, "test-samples": 200, "min-clients": 2,
          "partition": "pathological:2", "method": "fedconcat", "fedconcat-clusters": 2,
          "fedconcat-encoder-rounds": 2, "fraction-train": 0.5, "output-dir": str(tmp_path),
          "run-name": "fc", "client-state-dir": str(tmp_path / "state")}
    with caplog.at_level(logging.INFO, logger="flowerbed"):
        summary = run_inprocess(rc, 4)
    rows = read_metrics(tmp_path / "fc")
    # clustered before round 1, on every client's label counts (their whoami replies)
    clustered = next(m for m in (r.getMessage() for r in caplog.records) if "clusters by label" in m)
    assert clustered.startswith("2 clusters") and all(str(p) in clustered for p in range(4))
    assert [r.get("accuracy") is None for r in rows[1:]] == [True, True, False, False]  # no global model yet
    assert summary["final-accuracy"] is not None
    assert sum(rows[1][f"cluster-{c}-clients"] for c in (0, 1)) == 2  # half the clients a round
    model_bytes = rows[1]["bytes-up"] / 2
    assert rows[3]["bytes-down"] > 2 * 2 * model_bytes  # both cluster models, to both clients
    assert rows[3]["bytes-up"] < 2 * (2 * 512 + 1) * 10 * 4 + 4096  # the classifier only
