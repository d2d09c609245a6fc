"""FedFTG: the generator's terms and the class-level ensemble by hand, the reply check, and whole
runs in-process (no iterations: FedAvg to the digit; with them: the global model moves)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inprocess import run_inprocess
from torch.nn import functional as F

from flowerbed.results import read_metrics
from flowerbed.strategies.fedftg import Generator, class_weights, diversity, generator_terms


def test_class_weights_share_each_class_among_the_clients_that_hold_it():
    counts = np.array([[3.0, 0, 0], [1, 2, 0]])
    assert class_weights(counts).tolist() == [[0.75, 0, 0], [0.25, 1, 0]]  # a class none holds: 0


def test_generator_terms_are_the_weighted_ce_and_kl_and_the_generator_is_standardised():
    g = torch.Generator().manual_seed(0)
    t1, t2, s = (torch.randn(4, 3, generator=g) for _ in range(3))
    y, w = torch.tensor([0, 1, 2, 1]), torch.tensor([[1.0, 0], [0.5, 0.5], [0, 1], [0.25, 0.75]])
    cls, md = generator_terms([t1, t2], s, y, w)
    ce = [F.cross_entropy(t, y, reduction="none") for t in (t1, t2)]
    assert float(cls) == pytest.approx(float(((w[:, 0] * ce[0]) + (w[:, 1] * ce[1])).mean()), rel=1e-6)
    p = [F.softmax(t, 1) for t in (t1, t2)]
    kl = [(q * (q.log() - F.log_softmax(s, 1))).sum(1) for q in p]
    assert float(md) == pytest.approx(float(((w[:, 0] * kl[0]) + (w[:, 1] * kl[1])).mean()), rel=1e-5)
    # distinct noises giving identical images: no diversity (the loss at its largest, 1)
    z = torch.randn(5, 8, generator=g)
    assert float(diversity(z, torch.zeros(5, 1, 4, 4))) == 1.0 and float(diversity(z, torch.randn(5, 16))) < 1
    gen = Generator(8, 10, (1, 28, 28)).train()
    x = gen(z, torch.arange(5)).detach()
    assert x.shape == (5, 1, 28, 28) and abs(float(x.mean())) < 1e-5  # BatchNorm without affine: standardised


def run(tmp_path, name, method, **more):
    rc = {"num-server-rounds": 2, "train-samples": 600, "test-samples": 200, "min-clients": 2,
          "method": method, "output-dir": str(tmp_path), "run-name": name,
          "client-state-dir": str(tmp_path / "state"), **more}
    return run_inprocess(rc, 3), read_metrics(tmp_path / name)


def test_without_iterations_fedftg_is_fedavg_and_with_them_the_global_model_moves(tmp_path):
    plain, _ = run(tmp_path, "avg", "fedavg")
    none, rows = run(tmp_path, "ftg0", "fedftg", **{"fedftg-iterations": 0})
    assert none["final-accuracy"] == plain["final-accuracy"] and none["final-loss"] == plain["final-loss"]
    assert "label-counts" not in rows[1]  # the counts are read, not averaged into the row
    tuned, rows = run(tmp_path, "ftg", "fedftg", **{"fedftg-iterations": 2})
    assert tuned["final-loss"] != plain["final-loss"]
    assert all(np.isfinite(rows[r][k]) for r in (1, 2) for k in ("ftg-cls", "ftg-md", "ftg-div", "ftg-kd"))


def test_a_reply_with_malformed_label_counts_is_refused():
    from conftest import prepared, reply
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from flowerbed.config import Config
    from flowerbed.strategies.fedftg import FedFTGStrategy

    strategy = FedFTGStrategy(Config.from_run_config({"method": "fedftg"}))
    sent = prepared(strategy, [10])
    arrays = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    for counts, ok in [([1] * 10, True), ([1] * 9, False), ([2] * 10, False), ([-1, 11] + [0] * 8, False),
                       ([1.0] * 10, False)]:
        m = MetricRecord({"num-examples": 10, "label-counts": counts})
        content = RecordDict({"arrays": arrays, "m": m})
        assert (strategy.check_arrays(content) is None) is ok, counts
    bad = RecordDict({"arrays": arrays, "m": MetricRecord({"num-examples": 10})})
    assert "label-counts" in strategy.check_reply(reply(sent[0], bad), True)


def test_the_ensemble_target_the_generator_loss_and_the_diversity_by_hand():
    """From a review: a flipped hard-sample sign or an unweighted ensemble would have passed."""
    from flowerbed.config import Config
    from flowerbed.strategies.fedftg import FedFTGStrategy, ensemble_target

    g = torch.Generator().manual_seed(1)
    t1, t2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    w = torch.tensor([[1.0, 0.0], [0.25, 0.75], [0.0, 1.0]])
    want = w[:, :1] * F.softmax(t1, 1) + w[:, 1:] * F.softmax(t2, 1)
    assert torch.allclose(ensemble_target([t1, t2], w), want)
    s = FedFTGStrategy(Config.from_run_config({"method": "fedftg", "fedftg-lambda-md": 2.0,
                                               "fedftg-lambda-div": 0.5}))
    assert float(s.generator_loss(torch.tensor(1.0), torch.tensor(3.0), torch.tensor(4.0))) == 1 - 6 + 2
    z, x = torch.randn(5, 8, generator=g), torch.randn(5, 1, 4, 4, generator=g)
    dz = (z[:, None] - z[None]).pow(2).mean(2)
    dx = (x.flatten(1)[:, None] - x.flatten(1)[None]).abs().mean(2)
    assert float(diversity(z, x)) == pytest.approx(float(torch.exp(-(dz * dx).mean())), rel=1e-5)


def test_a_diverged_fine_tuning_keeps_the_mean_and_the_generator_from_before(caplog):
    """From a review: a NaN generator was kept (and checkpointed), so every later round's
    fine-tuning came out NaN and was refused, FedAvg's mean with it."""
    from flwr.app import Array, ArrayRecord

    from flowerbed.config import Config
    from flowerbed.models.cnn import CNN
    from flowerbed.strategies.fedftg import FedFTGStrategy

    s = FedFTGStrategy(Config.from_run_config({"method": "fedftg", "fedftg-iterations": 1}))
    s.model = CNN(1, 10, 28)
    mean = s._reference = s.initial_arrays(s.model)
    wild = ArrayRecord({k: Array(v.numpy() * 1e30 if v.numpy().dtype.kind == "f" else v.numpy())
                        for k, v in mean.items()})  # teachers whose outputs overflow
    counts = np.full((2, 10), 5.0)
    out, _ = s.fine_tune(1, mean, [wild, wild], counts)
    assert out is mean and s.generator is None and "fine-tuning diverged" in caplog.text
    out, losses = s.fine_tune(2, mean, [mean, mean], counts)
    assert out is not mean and s.generator is not None and all(np.isfinite(list(losses.values())))
