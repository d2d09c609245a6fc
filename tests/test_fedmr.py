"""FedMR's server: the pool of local models, its unweighted mean and its layer-wise recombination,
on replies built here (the real engines run it in test_resume's per-method tests)."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from flowerbed.config import Config, ConfigError
from flowerbed.strategies.fedmr import FedMRStrategy, recombine
from tests.conftest import FakeGrid, error_reply, prepared, reply, train_messages

SHAPES = {"w": (3, 2), "b": (2,), "v": (4,), "u": (1,), "n": ()}  # n: a 0-d buffer, as BatchNorm's
NODES = [101, 102, 103]


def model(value: float) -> ArrayRecord:
    """Every tensor at ``value``; "n" is int64, as BatchNorm's num_batches_tracked."""
    return ArrayRecord({k: Array(np.full(s, value, np.int64 if k == "n" else np.float32))
                        for k, s in SHAPES.items()})


def trained(value: float, n: int) -> RecordDict:
    return RecordDict({"arrays": model(value),
                       "metrics": MetricRecord({"num-examples": n, "train-loss": 1.0})})


def first(rec: ArrayRecord, key: str) -> float:
    return float(rec[key].numpy().ravel()[0])


def round_of(s: FedMRStrategy, server_round: int, global_model: ArrayRecord):
    """The round's training messages (with the ids the Grid would give them), and by node."""
    msgs = train_messages(s, server_round, global_model, FakeGrid(NODES))
    return msgs, {m.metadata.dst_node_id: m for m in msgs}


def test_recombine_gives_each_tensor_its_own_permutation_of_the_models():
    models = [model(v) for v in (1.0, 2.0, 3.0, 4.0)]
    out = recombine(models, np.random.default_rng(0))
    perms = []
    for k in SHAPES:
        values = [first(o, k) for o in out]
        assert sorted(values) == [1.0, 2.0, 3.0, 4.0]  # every model's tensor goes to one slot
        perms.append(tuple(values))
    assert len(set(perms)) > 1  # shuffled tensor by tensor, not model by model
    again = recombine(models, np.random.default_rng(0))
    assert [[first(o, k) for k in SHAPES] for o in again] == [[first(o, k) for k in SHAPES] for o in out]


def test_a_round_trains_the_pool_and_returns_its_unweighted_mean(cfg):
    s = FedMRStrategy(cfg)
    prepared(s, NODES)
    msgs, by_node = round_of(s, 1, model(0.0))
    assert all(first(m.content["arrays"], "w") == 0.0 for m in msgs)  # round 1: the initial model
    slots = dict(s._slot)
    values = {101: 1.0, 102: 2.0, 103: 6.0}
    reps = [reply(by_node[n], trained(v, n_ex)) for (n, v), n_ex in zip(values.items(), (10, 30, 60),
                                                                          strict=True)]
    out, metrics = s.aggregate_train(1, reps)
    assert np.allclose(out["w"].numpy(), 3.0)  # (1 + 2 + 6) / 3, not the sample-weighted 4.3
    assert out["n"].numpy().dtype == np.int64 and out["n"].numpy() == 3  # the 0-d buffer too
    assert metrics["fedmr-recombined"] == 1 and s.round.ok == [0, 1, 2]
    assert sorted(slots.values()) == [0, 1, 2]
    for k in SHAPES:  # recombined after round 1 (fedmr-first-stage = 0)
        assert sorted(first(p, k) for p in s.pool) == [1.0, 2.0, 6.0]
    msgs2, _ = round_of(s, 2, out)
    sent = {first(m.content["arrays"], "w") for m in msgs2}
    assert sent == {1.0, 2.0, 6.0}  # each client a pool model, not the mean
    evals = s.configure_evaluate(2, out, ConfigRecord(), FakeGrid(NODES))
    assert all(first(m.content["arrays"], "w") == 3.0 for m in evals)  # evaluation: the mean


def test_first_stage_is_unweighted_fedavg(cfg):
    s = FedMRStrategy(cfg.replace(fedmr_first_stage=1))
    prepared(s, NODES)
    _, by_node = round_of(s, 1, model(0.0))
    out, metrics = s.aggregate_train(1, [reply(by_node[n], trained(v, 10 * n))
                                         for n, v in zip(NODES, (1.0, 2.0, 6.0), strict=True)])
    assert metrics["fedmr-recombined"] == 0
    assert all(first(p, k) == 3.0 for p in s.pool for k in SHAPES)
    msgs2, by_node = round_of(s, 2, out)
    assert all(first(m.content["arrays"], "w") == 3.0 for m in msgs2)
    s.aggregate_train(2, [reply(by_node[n], trained(v, 10)) for n, v in zip(NODES, (1.0, 2.0, 6.0),
                                                                            strict=True)])
    assert {first(p, "w") for p in s.pool} == {1.0, 2.0, 6.0}  # round 2 > first stage: recombined


def test_a_failed_client_leaves_its_slot_untrained(cfg):
    s = FedMRStrategy(cfg.replace(fedmr_first_stage=5))
    prepared(s, NODES)
    s.pool = [model(10.0), model(20.0), model(30.0)]
    _, by_node = round_of(s, 1, model(0.0))
    lost = s._slot[103]
    out, _ = s.aggregate_train(1, [reply(by_node[101], trained(1.0, 10)),
                                   reply(by_node[102], trained(2.0, 10)), error_reply(by_node[103])])
    assert np.allclose(out["w"].numpy(), (1.0 + 2.0 + 10.0 * (lost + 1)) / 3)
    assert [f["partition"] for f in s.round.failed] == [2]


def test_the_pool_grows_when_more_clients_are_sampled(cfg):
    s = FedMRStrategy(cfg)
    prepared(s, NODES)
    s.pool = [model(5.0)]
    msgs, _ = round_of(s, 1, model(0.0))
    assert len(s.pool) == 3 and sorted(first(m.content["arrays"], "w") for m in msgs) == [0.0, 0.0, 5.0]


def test_first_stage_must_be_a_round_count():
    with pytest.raises(ConfigError, match="'fedmr-first-stage' = -1"):
        Config.from_run_config({"method": "fedmr", "fedmr-first-stage": -1})
