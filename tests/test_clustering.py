"""The clustering baselines of FedFew's paper. FedSoft: importance weights, the proximal pull
towards the centres, the centres' update, and the client's local model and kept estimate. CFL:
when a cluster splits, into which halves, and what each node is sent."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from flowerbed.clients.fedsoft import IMPORTANCE, importance, pull
from flowerbed.config import Config, ConfigError
from flowerbed.datasets.loading import DataSet
from flowerbed.strategies.fedsoft import FedSoftStrategy
from flowerbed.strategies.personal import pack, unpack
from tests.conftest import prepared, reply, sent
from tests.test_fedfew import SMALL, client


class Says(nn.Module):
    """Logits that always favour one class."""

    def __init__(self, cls: int, classes: int = 4) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.full((classes,), -5.0).index_fill(0, torch.tensor(cls), 5.0))

    def forward(self, x):
        return self.logits.expand(len(x), -1)


def test_importance_is_each_centres_share_of_lowest_losses_with_the_floor():
    y = torch.tensor([0, 0, 0, 1, 3, 3, 3, 3])  # class 2: no sample; centre 2 says 2
    data = DataSet("fashion-mnist", torch.zeros(8, 1, 2, 2, dtype=torch.uint8), y, 4)
    u = importance([Says(0), Says(1), Says(2), Says(3)], data, torch.device("cpu"), 1e-4)
    assert u == [3 / 8, 1 / 8, 1e-4, 4 / 8]
    broken = Says(0)
    with torch.no_grad():
        broken.logits.fill_(float("nan"))  # a diverged centre is no sample's lowest loss
    u = importance([Says(0), Says(1), broken, Says(3)], data, torch.device("cpu"), 1e-4)
    assert u == [3 / 8, 1 / 8, 1e-4, 4 / 8]


def test_the_pull_has_the_gradient_of_the_sum_over_centres():
    torch.manual_seed(0)
    centres = [nn.Linear(3, 2) for _ in range(3)]
    direct = [[p.detach().clone() for p in c.parameters()] for c in centres]
    w, u, lam = nn.Linear(3, 2), [0.5, 0.2, 1e-4], 0.3
    pull(centres, u, lam)(w).backward()
    mine = [p.grad.clone() for p in w.parameters()]
    w.zero_grad()
    sum((lam / 2) * us * sum(((p - q) ** 2).sum() for p, q in zip(w.parameters(), c, strict=True))
        for us, c in zip(u, direct, strict=True)).backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(mine, w.parameters(), strict=True))


def rec(v):
    return ArrayRecord({"w": Array(np.full((2, 2), v, np.float32))})


def answer(msg, v, u, n=10):
    return reply(msg, RecordDict({"arrays": rec(v), "metrics": MetricRecord(
        {"num-examples": n, "train-loss": 0.5, "importance": u})}))


def test_each_centre_is_the_importance_weighted_mean_of_the_local_models():
    s = FedSoftStrategy(Config.from_run_config({"method": "fedsoft", "num-models": 2, "min-clients": 1}))
    msgs = prepared(s, [100, 101, 102])
    s._models, s._reference = [rec(0.0), rec(1.0)], rec(0.0)
    out, metrics = s.aggregate_train(1, [answer(msgs[0], 1.0, [0.75, 0.25], 10),
                                         answer(msgs[1], 5.0, [1e-4, 1.0], 30),
                                         answer(msgs[2], 9.0, [0.5, float("nan")])])  # rejected
    got = unpack(out, 2)
    assert np.allclose(got[0]["w"].numpy(), (7.5 * 1 + 0.003 * 5) / 7.503)
    assert np.allclose(got[1]["w"].numpy(), (2.5 * 1 + 30 * 5) / 32.5)
    assert metrics["model-0-importance"] == pytest.approx(7.503 / 40.003)
    assert "importance" not in metrics
    assert [f["partition"] for f in s.round.failed] == [2]
    assert "importance" in s.round.failed[0]["reason"]
    assert s.eval_content(pack([rec(0.0), rec(1.0)])).array_records == {}  # scored on w_i alone


def test_the_client_keeps_its_model_and_its_estimate_for_tau_rounds():
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import to_record

    c, cfg, ctx = client("fedsoft")
    torch.manual_seed(1)
    centres = [to_record(make_model(cfg, train_set(cfg))) for _ in range(2)]

    def train(rnd, models):
        return c.train(sent(4, RecordDict({**{f"model.{k}": m for k, m in enumerate(models)},
                                           "config": ConfigRecord({"server-round": rnd})})))

    out = train(1, centres)
    u1 = out.content["metrics"]["importance"]
    assert len(u1) == 2 and sum(u1) == pytest.approx(1, abs=2e-4)
    w1 = ctx.state[c.state_key]
    assert all(np.array_equal(w1[k].numpy(), out.content["arrays"][k].numpy()) for k in w1)
    # round 2, same interval (tau = 2): the estimate is kept even though the centres changed
    assert train(2, centres[::-1]).content["metrics"]["importance"] == u1
    assert ctx.state[IMPORTANCE]["interval"] == 0
    out3 = train(3, centres[::-1])  # a new interval: estimated again, on the swapped centres
    assert out3.content["metrics"]["importance"] == pytest.approx(u1[::-1])
    # the local model carries on from its own state, not from a centre
    fresh, _, _ = client("fedsoft")
    fresh_out = fresh.train(sent(4, RecordDict({**{f"model.{k}": m for k, m in enumerate(centres[::-1])},
                                                "config": ConfigRecord({"server-round": 3})})))
    assert not np.allclose(out3.content["arrays"]["fc2.weight"].numpy(),
                           fresh_out.content["arrays"]["fc2.weight"].numpy())
    ev = c.evaluate(sent(4, RecordDict({"config": ConfigRecord({"server-round": 3})}), "evaluate"))
    assert 0 <= ev.content["metrics"]["accuracy"] <= 1


@pytest.mark.parametrize(("key", "value"), [("fedsoft-sigma", 0.0), ("fedsoft-sigma", 1.5),
                                            ("fedsoft-tau", 0), ("fedsoft-lambda", -1.0),
                                            ("fedsoft-lambda", float("nan"))])
def test_out_of_range_settings_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=key):
        Config.from_run_config({**SMALL, "method": "fedsoft", key: value})


def test_cfl_splits_a_stalled_cluster_whose_clients_disagree():
    """Four clients: two move along +e, two along −e (and a little apart), so the mean update is
    short and the largest long. Before the warm-up ends, or with a mean above ε1, nothing splits;
    after it the two groups become clusters 0 and 1, each its members' weighted mean, and each
    node is sent its own cluster's model."""
    from flowerbed.strategies.cfl import CFLStrategy

    def strategy(**rc):
        s = CFLStrategy(Config.from_run_config({"method": "cfl", "min-clients": 1, "cfl-eps1": 0.5,
                                                "cfl-eps2": 1.0, "cfl-warmup": 1, **rc}))
        s._reference = rec(0.0)
        return s

    ups = [{"w": np.array([[2.0, 0.1], [0, 0]])}, {"w": np.array([[2.0, -0.1], [0, 0]])},
           {"w": np.array([[-2.0, 0.1], [0, 0]])}, {"w": np.array([[-2.0, -0.1], [0, 0]])}]

    def round_(s, rnd, ns=(10, 10, 10, 30)):
        msgs = prepared(s, [100, 101, 102, 103])
        return s.aggregate_train(rnd, [reply(m, RecordDict({
            "arrays": ArrayRecord({"w": Array(np.asarray(u["w"], np.float32))}),
            "metrics": MetricRecord({"num-examples": n, "train-loss": 0.1})}))
            for m, u, n in zip(msgs, ups, ns, strict=True)])

    s = strategy()
    _, m = round_(s, 1, ns=(10, 10, 10, 10))  # stalled and apart, but in the warm-up: no split
    assert m["cfl-clusters"] == 1 and s.cluster_of == {str(p): 0 for p in range(4)}
    s = strategy()
    _, m = round_(s, 1)  # weighted: a mean update of 0.67, above eps1
    assert m["cfl-clusters"] == 1
    assert m["cluster-0-mean-norm"] == pytest.approx(np.hypot((2 + 2 - 2) / 6 - 2 / 2, 0.1 / 6 - 0.1 / 2))
    assert m["cluster-0-max-norm"] == pytest.approx(np.hypot(2, 0.1))
    s = strategy(**{"cfl-eps1": 0.5})
    s.cluster_models = {}
    _, m = round_(s, 2, ns=(10, 10, 10, 10))  # mean update (0, 0): stalled, and clients 2.0 apart
    assert m["cfl-clusters"] == 2 and s.cluster_of == {"0": 0, "1": 0, "2": 1, "3": 1}
    assert np.allclose(s.cluster_models["0"]["w"].numpy(), [[2.0, 0], [0, 0]])
    assert np.allclose(s.cluster_models["1"]["w"].numpy(), [[-2.0, 0], [0, 0]])
    sent_to = {n: s.content_for(n, RecordDict({"arrays": rec(9.0)}))["arrays"]["w"].numpy()[0, 0]
               for n in (100, 102)}
    assert sent_to == {100: 2.0, 102: -2.0}
    s = strategy(**{"cfl-eps1": 0.01})  # a mean update longer than eps1: still converging, no split
    _, m = round_(s, 2)
    assert m["cfl-clusters"] == 1


def test_cfl_split_with_tied_distances_gives_two_nonempty_halves():
    """Found by a review: one client moves and two send the model back, so every distance ties
    and scipy's fcluster returned one group: the split crashed the server (IndexError)."""
    from flowerbed.strategies.cfl import CFLStrategy

    s = CFLStrategy(Config.from_run_config({"method": "cfl", "min-clients": 1, "cfl-eps1": 1e6,
                                            "cfl-eps2": 1e-9, "cfl-warmup": 0}))
    s._reference = rec(0.0)
    msgs = prepared(s, [100, 101, 102])
    _, m = s.aggregate_train(1, [reply(msg, RecordDict({"arrays": rec(v), "metrics": MetricRecord(
        {"num-examples": n, "train-loss": 0.1})})) for msg, v, n in zip(msgs, (1.0, 0.0, 0.0), (1, 50, 50),
                                                                       strict=True)])
    assert m["cfl-clusters"] == 2 and sorted(s.cluster_of.values()).count(0) in (1, 2)


def test_cfl_does_not_split_a_cluster_some_of_whose_clients_sat_the_round_out(caplog):
    """... and says so (from a review: a run whose clusters never split looked like FedAvg's)."""
    from flowerbed.strategies.cfl import CFLStrategy

    s = CFLStrategy(Config.from_run_config({"method": "cfl", "min-clients": 1, "cfl-eps1": 1e6,
                                            "cfl-eps2": 1e-9, "cfl-warmup": 0}))
    s._reference = rec(0.0)
    s.cluster_of = {"3": 0}  # partition 3 trained in an earlier round, and is not sampled now
    msgs = prepared(s, [100, 101, 102])
    _, m = s.aggregate_train(1, [reply(msg, RecordDict({"arrays": rec(v), "metrics": MetricRecord(
        {"num-examples": 10, "train-loss": 0.1})})) for msg, v in zip(msgs, (1.0, -1.0, 1.1), strict=True)])
    assert m["cfl-clusters"] == 1
    assert "cluster 0 meets the split criteria" in caplog.text
    assert "partitions [3] did not reply" in caplog.text
    s.check_setup(4)
    assert "clusters rarely split" not in caplog.text
    CFLStrategy(Config.from_run_config({"method": "cfl", "fraction-train": 0.5})).check_setup(4)
    assert "with fraction-train=0.5 most rounds sample only some of them" in caplog.text


def test_cfl_says_when_a_partition_new_to_the_run_joins_cluster_0(caplog):
    from flowerbed.strategies.cfl import CFLStrategy

    s = CFLStrategy(Config.from_run_config({"method": "cfl", "min-clients": 1}))
    s._reference = rec(0.0)
    s.cluster_of, s.cluster_models = {"0": 0, "1": 1}, {"0": rec(0.0), "1": rec(0.0)}
    msgs = prepared(s, [100, 101, 102])
    s.aggregate_train(7, [reply(msg, RecordDict({"arrays": rec(1.0), "metrics": MetricRecord(
        {"num-examples": 10, "train-loss": 0.1})})) for msg in msgs])
    assert "round 7: partition 2 trains for the first time after the clusters split" in caplog.text
    assert "partition 0 trains" not in caplog.text and s.cluster_of["2"] == 0
