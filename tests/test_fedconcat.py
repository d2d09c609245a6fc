"""FedConcat: k-means on label distributions, the concatenated model, the stage's reply checks,
and a whole run in-process across the two stages (with clients joining after round 1)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from inprocess import run_inprocess

from flowerbed.clients.fedconcat import ConcatModel, classifier_for
from flowerbed.config import Config, ConfigError
from flowerbed.models.cnn import CNN
from flowerbed.results import read_metrics
from flowerbed.strategies.fedconcat import FedConcatStrategy, kmeans


def test_kmeans_groups_the_label_distributions_and_is_seeded():
    eye = np.eye(4)
    points = np.array([eye[0], eye[0] * 0.9 + eye[1] * 0.1, eye[2], eye[2] * 0.8 + eye[3] * 0.2])
    cent, lab = kmeans(points, 2, seed=0)
    assert lab[0] == lab[1] != lab[2] == lab[3] and cent.shape == (2, 4)
    assert (kmeans(points, 2, seed=0)[1] == lab).all()


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


def test_each_stage_refuses_the_other_stages_reply_and_the_rounds_are_checked():
    with pytest.raises(ConfigError, match="fedconcat-encoder-rounds.*< num-server-rounds"):
        Config.from_run_config({"method": "fedconcat", "num-server-rounds": 3, "fedconcat-encoder-rounds": 3})
    s = FedConcatStrategy(Config.from_run_config({"method": "fedconcat"}))
    w = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    s._reference, s.classifier = w, ArrayRecord({"weight": Array(np.zeros((10, 4), np.float32))})
    model_reply = RecordDict({"arrays": w, "m": MetricRecord({"num-examples": 10, "label-counts": [1] * 10})})
    clf_reply = RecordDict({"classifier": s.classifier, "m": MetricRecord({"num-examples": 10})})
    assert s.check_arrays(model_reply) is None and "label-counts" in s.check_arrays(clf_reply)
    s._stage2 = True
    assert s.check_arrays(clf_reply) is None and "'classifier' alone" in s.check_arrays(model_reply)


def test_two_stages_in_process_with_clients_that_join_after_round_1(tmp_path, caplog):
    rc = {"num-server-rounds": 4, "train-samples": 1200, "test-samples": 200, "min-clients": 2,
          "partition": "pathological:2", "method": "fedconcat", "fedconcat-clusters": 2,
          "fedconcat-encoder-rounds": 2, "fraction-train": 0.5, "output-dir": str(tmp_path),
          "run-name": "fc", "client-state-dir": str(tmp_path / "state")}
    with caplog.at_level(logging.INFO, logger="flowerbed"):
        summary = run_inprocess(rc, 4)
    rows = read_metrics(tmp_path / "fc")
    assert "round 1: 2 clusters by label distribution" in caplog.text
    assert [r.get("accuracy") is None for r in rows[1:]] == [True, True, False, False]  # no global model yet
    assert summary["final-accuracy"] is not None
    assert sum(rows[1][f"cluster-{c}-clients"] for c in (0, 1)) == 2  # half the clients a round
    # the two clients not in round 1 join the cluster of the nearest label distribution
    assert caplog.text.count("joins cluster") == 2
    model_bytes = rows[1]["bytes-up"] / 2
    assert rows[3]["bytes-down"] > 2 * 2 * model_bytes  # both cluster models, to both clients
    assert rows[3]["bytes-up"] < 2 * (2 * 512 + 1) * 10 * 4 + 4096  # the classifier only
