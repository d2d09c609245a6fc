"""FedCT: the majority vote by hand, hard labels only, and the client's training on its private
data and the consensus-labelled public set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from flowerbed.clients.fedct import one_hot_argmax
from flowerbed.config import Config
from flowerbed.registry import METHODS
from flowerbed.strategies.distill import PREDICTIONS
from flowerbed.strategies.fedct import FedCTStrategy
from tests.conftest import sent
from tests.test_fedcc import SMALL


def test_the_consensus_is_the_majority_vote_one_hot_and_a_tie_is_drawn_among_the_tied_classes():
    votes = np.eye(3, dtype=np.float32)[np.array([[0, 1], [2, 1], [2, 0]])]  # 3 clients, 2 samples
    s = FedCTStrategy(Config.from_run_config({"method": "fedct", "public-fraction": 0.1}))
    assert s.combine(votes).tolist() == [[0, 0, 1], [0, 1, 0]]
    assert s.ensemble_probs(votes)[0] == pytest.approx([1 / 3, 0, 2 / 3], abs=1e-5)
    # every client a different class on 600 samples (one class per client): ties everywhere, drawn
    # among the tied classes (always the lowest class made the whole public set class 0)
    tie = np.eye(3, dtype=np.float32)[np.array([[2] * 600, [1] * 600])]
    drawn = s.combine(tie).argmax(1)
    assert set(drawn) == {1, 2} and 200 < (drawn == 1).sum() < 400
    assert (s.combine(tie) == s.combine(tie)).all()  # seeded by the round: the same after a resume
    assert set(s.ensemble_probs(tie).argmax(1)) == {1, 2}
    assert one_hot_argmax(torch.tensor([[0.2, 0.5, 0.5], [3.0, -1, 0]])).tolist() == [[0, 1, 0], [1, 0, 0]]


def test_soft_labels_are_refused_and_the_client_shares_hard_ones_then_trains_on_the_consensus():
    cfg = Config.from_run_config({**SMALL, "method": "fedct"})
    s = METHODS["fedct"].strategy(cfg)
    s.num_classes, s.n_public = 10, 120
    hard = np.eye(10, dtype=np.float32)[np.arange(120) % 10]
    assert s._check_matrix(ArrayRecord({"p": Array(hard)}), 120) is None
    soft = np.full((120, 10), 0.1, np.float32)
    assert "not hard labels" in s._check_matrix(ArrayRecord({"p": Array(soft)}), 120)
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 10},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS["fedct"].client(cfg, ctx)
    out = client.train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 1})})))
    p = out.content[PREDICTIONS]["p"].numpy()
    assert p.shape == (120, 10) and set(np.unique(p)) <= {0.0, 1.0} and (p.sum(1) == 1).all()
    seen = []
    client.fit_private = lambda model, gen, epochs, data=None: seen.append(data) or 0.0
    targets = ArrayRecord({"soft_targets": Array(hard)})
    client.train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 2}), "soft_targets": targets})))
    data = seen[0]
    n = len(client.train_data)
    assert len(data) == n + 120 and torch.equal(data.x[n:], client.public.x)
    assert data.y[n:].tolist() == (np.arange(120) % 10).tolist()
    assert torch.equal(data.y[:n], client.train_data.y)


def test_a_diverged_model_casts_no_votes():
    """From a review: the one-hot argmax of NaN logits is class 0, a valid-looking vote."""
    cfg = Config.from_run_config({**SMALL, "method": "fedct"})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 10},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS["fedct"].client(cfg, ctx)
    model = client.new_model()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="not finite"):
        client.outputs(model, client.public)
