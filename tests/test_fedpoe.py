"""Fed-POE on Fed-ADE's streams: the Hedge step and the mixture by hand, and whole runs in-process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inprocess import run_inprocess
from methods import EXTRA

from flowerbed.clients.fedpoe import Mixture, hedge_step, mixture
from flowerbed.results import read_metrics


def test_hedge_step_is_multiplicative_weights():
    w = np.array([0.3, 0.7])
    losses, eta = np.array([0.9, 0.2]), 0.25
    direct = w * np.exp(-eta * losses)
    got = np.exp(hedge_step(np.log(w), losses, eta))
    assert got / got.sum() == pytest.approx(direct / direct.sum(), rel=1e-12)
    assert hedge_step(np.log(w), losses, eta).max() == 0  # kept in range however long the stream
    far = hedge_step(np.zeros(2), np.array([1e6, 0.0]), 1.0)
    assert np.isfinite(far).all() and np.exp(far)[1] == 1.0
    # a diverged model (non-finite loss) loses its weight; if every loss is, nothing moves
    assert np.exp(hedge_step(np.zeros(2), np.array([np.nan, 0.5]), 1.0)).tolist() == [0.0, 1.0]
    assert hedge_step(np.log(w), np.array([np.inf, np.nan]), 1.0) == pytest.approx(np.log(w / 0.7))


def test_mixture_is_the_weighted_mean_of_the_softmaxes_and_mixes_again():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4, 10, generator=g) for _ in range(3))
    log_w = np.log(np.array([2.0, 6.0]))  # unnormalised: a/(a+b) = 0.25
    want = 0.25 * torch.softmax(a, 1) + 0.75 * torch.softmax(b, 1)
    assert torch.allclose(mixture(log_w, [a, b]).exp(), want, atol=1e-6)
    # the official code's two levels: c/(c+d)·(a·p_local + b·p_fed)/(a+b) + d/(c+d)·p_pool
    x = torch.stack([a, b, c])
    pick = [lambda x, i=i: x[i] for i in range(3)]  # three "models", whose logits are a, b and c
    lw = np.log(np.array([2.0, 6.0, 1.0, 3.0]))
    nested = Mixture([Mixture(pick[:2], lw[:2]), pick[2]], lw[2:])
    got = nested(x).exp()
    assert torch.allclose(got, 0.25 * want + 0.75 * torch.softmax(c, 1), atol=1e-6)


def run(tmp_path, name, method, **more):
    rc = {"num-server-rounds": 4, "train-samples": 2000, "test-samples": 200, "min-clients": 2,
          **EXTRA[method], "fedade-rounds-per-step": 2, "method": method, "output-dir": str(tmp_path),
          "run-name": name, "client-state-dir": str(tmp_path / "state"), **more}
    summary = run_inprocess(rc, 3)
    return summary, read_metrics(tmp_path / name)


def test_without_adaptation_fed_poe_is_the_pretrained_model_and_weights_move_once_a_step(tmp_path):
    """At learning rate 0 both of a client's models stay the pre-trained one, so the mixture is
    that model whatever its weights: Fed-ADE without adaptation, to the digit. Adapting, every
    client weighs its two models once a step (both rounds of a step train every client), the
    pre-trained model goes down only until a client holds its local model, and a reply carries
    the whole model."""
    still, _ = run(tmp_path, "poe0", "fedpoe", **{"fedade-fixed-lr": 0.0})
    none, _ = run(tmp_path, "ade0", "fedade", **{"fedade-lr-mode": "none"})
    assert still["mean-accuracy"] == none["mean-accuracy"] and still["mean-accuracy"] is not None
    assert still["mean-pre-accuracy"] == none["mean-pre-accuracy"]

    summary, rows = run(tmp_path, "poe", "fedpoe", **{"fedade-fixed-lr": 1e-3})
    assert summary["mean-accuracy"] is not None and summary["mean-accuracy"] != still["mean-accuracy"]
    first, second = rows[1], rows[2]  # round 1: every client gets the pre-trained model too
    assert second["bytes-down"] * 1.9 < first["bytes-down"] < second["bytes-down"] * 2.1
    up = pytest.approx(first["bytes-down"] / 2, rel=1e-4)  # the whole model up (and a few metrics)
    assert first["bytes-up"] == up and second["bytes-up"] == up
    w = [r["per-client"][p]["train-fed-weight"] for r in rows[1:] for p in ("0", "1", "2")
         if "train-fed-weight" in r["per-client"][p]]
    pool = [r["per-client"][p]["train-pool-weight"] for r in rows[1:] for p in ("0", "1", "2")
            if "train-pool-weight" in r["per-client"][p]]
    assert len(w) == len(pool) == 12 and all(0 < x < 1 for x in w + pool)
    # step 0: every model is the pre-trained one (equal risks: 1/2 each); step 1: moved at the
    # step's first round, kept in its second
    # (float-level: two copies of one model can score a risk a few ulps apart, seen once in CI
    # as 0.49999997, from the CPU's matmul kernels)
    for each in (w, pool):
        assert each[:6] == pytest.approx([0.5] * 6, abs=1e-6) and each[9:] == each[6:9]
        assert all(abs(x - 0.5) > 1e-4 for x in each[6:9])


def test_the_pretrained_model_goes_to_a_client_until_it_holds_a_local_model():
    """Every message to a partition without a local model carries the pre-trained one; a training
    reply says it holds one now, an error reply (its state may be gone) that it may not."""
    from conftest import error_reply, prepared, reply
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from flowerbed.clients.fedpoe import PRETRAINED
    from flowerbed.config import Config
    from flowerbed.strategies.fedpoe import FedPOEStrategy

    strategy = FedPOEStrategy(Config.from_run_config({"method": "fedpoe", "num-server-rounds": 2}))
    strategy._pretrained = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    sent = prepared(strategy, [10, 11])
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(2, np.float32))})})
    assert all(PRETRAINED in strategy.content_for(n, content) for n in (10, 11))
    strategy._reference = content["arrays"]
    ok = RecordDict({"arrays": content["arrays"],
                     "metrics": MetricRecord({"num-examples": 5, "time-step": 0})})
    strategy._check_and_log_replies([reply(sent[0], ok), error_reply(sent[1])], True, False)
    assert PRETRAINED not in strategy.content_for(10, content)
    assert PRETRAINED in strategy.content_for(11, content)
    assert strategy.content_for(10, content)["arrays"] is content["arrays"]  # the whole model, as sent
    strategy._check_and_log_replies([error_reply(sent[0])], True, False)
    assert PRETRAINED in strategy.content_for(10, content)
    # a refused reply (NaN layers, which the client does not keep) counts as not holding either
    strategy._check_and_log_replies([reply(sent[0], ok)], True, False)
    bad = RecordDict({"arrays": ArrayRecord({"w": Array(np.full(2, np.nan, np.float32))}),
                      "metrics": MetricRecord({"num-examples": 5, "time-step": 0})})
    strategy._check_and_log_replies([reply(sent[0], bad)], True, False)
    assert PRETRAINED in strategy.content_for(10, content)


def test_a_diverged_local_model_loses_its_weight_not_the_federated_models():
    """From a review: a local model gone NaN made the first-level mixture's loss NaN at the next
    Hedge update, which took c (local and federated mixed) to weight 0 for good, so the client
    predicted with the pre-trained model alone; its evaluation's loss was NaN (reply refused)."""
    from conftest import StreamClient

    from flowerbed.clients.fedpoe import HEDGE, LOCAL

    run = StreamClient({"method": "fedpoe", "train-samples": 2000, "num-server-rounds": 4,
                        **EXTRA["fedpoe"], "fedade-rounds-per-step": 2, "fedade-batch": 20,
                        "partition": "dirichlet:0.5", "min-partition-size": 6, "fedade-fixed-lr": 1e-3})
    run.train(1)  # step 0: the client now holds its local model
    local = run.ctx.state[LOCAL]
    key = next(k for k in local if local[k].numpy().dtype.kind == "f")
    local[key] = type(local[key])(np.full_like(local[key].numpy(), np.nan))
    m = run.train(3).content["metrics"]  # step 1: its Hedge update
    log_w = run.ctx.state[HEDGE]["log_w"].numpy()
    assert log_w[0] == -np.inf and np.isfinite(log_w[1:]).all(), log_w
    assert m["fed-weight"] == 1.0 and 0 < m["pool-weight"] < 1
    ev = run.client.evaluate(run.message(4)).content["metrics"]
    assert np.isfinite(ev["loss"]) and 0 <= ev["accuracy"] <= 1
