"""Server-side logic on replies built here: FedAvg's mean, reply validation, SCAFFOLD's update."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn

from flowerbed.config import Config, ConfigError
from flowerbed.strategies.base import cast_like
from flowerbed.strategies.fedavg import FedAvgStrategy, FedProxStrategy
from flowerbed.strategies.scaffold import ACCEPTED, CV_DELTA, ScaffoldStrategy
from tests.conftest import FakeGrid, bn_record, error_reply, reply, sent
from tests.conftest import prepared as sent_to

SHAPES = {"w": (3, 2), "b": (2,)}


def arrays(value: float | dict) -> ArrayRecord:
    vals = value if isinstance(value, dict) else {k: np.full(s, value, np.float32)
                                                   for k, s in SHAPES.items()}
    return ArrayRecord({k: Array(np.asarray(v, np.float32)) for k, v in vals.items()})


def content(value, n, **extra):
    rd = RecordDict({"arrays": arrays(value), "metrics": MetricRecord({"num-examples": n,
                                                                       "train-loss": 1.0})})
    for k, v in extra.items():
        rd[k] = v
    return rd


def prepared(strategy, nodes):
    """conftest's prepared strategy, whose global model (the replies' reference) is all zeros."""
    strategy._reference = arrays(0.0)
    return sent_to(strategy, nodes)


def test_fedavg_is_the_sample_weighted_mean(cfg):
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])
    reps = [reply(msgs[0], content(1.0, 10)), reply(msgs[1], content(2.0, 30)),
            reply(msgs[2], content(4.0, 60))]
    out, metrics = s.aggregate_train(1, reps)
    expected = (1 * 10 + 2 * 30 + 4 * 60) / 100
    assert np.allclose(out["w"].numpy(), expected) and np.allclose(out["b"].numpy(), expected)
    assert metrics["train-loss"] == pytest.approx(1.0)
    assert s.round.ok == [0, 1, 2] and s.round.failed == []


def test_bad_replies_are_left_out_and_named(cfg, caplog):
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102, 103, 104, 105, 106])
    nan = {k: np.full(sh, np.nan) for k, sh in SHAPES.items()}
    wrong = {"w": np.zeros((2, 2)), "b": np.zeros(2)}
    missing_key = RecordDict({"arrays": arrays(9.0), "metrics": MetricRecord({"loss": 1.0})})
    reps = [reply(msgs[0], content(2.0, 10)),
            reply(msgs[1], content(nan, 10)),
            reply(msgs[2], content(wrong, 10)),
            reply(msgs[3], missing_key),
            error_reply(msgs[4]),
            reply(msgs[5], content(4.0, 10))]
    with caplog.at_level("WARNING", logger="flowerbed"):
        out, _ = s.aggregate_train(1, reps)
    assert np.allclose(out["w"].numpy(), 3.0)  # only partitions 0 and 5
    failed = {f["partition"]: f["reason"] for f in s.round.failed}
    assert set(failed) == {1, 2, 3, 4}
    assert "NaN" in failed[1] and "shape" in failed[2] and "num-examples" in failed[3]
    assert failed[4] == "the ClientApp raised (Flower error code 2): ValueError: boom"
    assert "client partition 1 (node 102)" in caplog.text


def test_missing_reply_is_counted_and_round_goes_on(cfg):
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])
    out, _ = s.aggregate_train(1, [reply(msgs[0], content(1.0, 5)), reply(msgs[2], content(3.0, 5))])
    assert np.allclose(out["w"].numpy(), 2.0)
    assert [f["partition"] for f in s.round.failed] == [1]
    assert "no reply" in s.round.failed[0]["reason"]


def test_round_skipped_below_min_clients(cfg):
    s = FedAvgStrategy(cfg.replace(min_clients=2))
    msgs = prepared(s, [101, 102])
    out, metrics = s.aggregate_train(1, [reply(msgs[0], content(1.0, 5)), error_reply(msgs[1])])
    assert out is None and metrics is None and s.round.skipped


def test_replies_are_aggregated_in_partition_order(cfg):
    """Float sums depend on order; sorting by partition id makes the result deterministic."""
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])
    vals = [0.1, 1e8, -1e8]
    reps = [reply(m, content(v, 1)) for m, v in zip(msgs, vals, strict=True)]
    a, _ = s.aggregate_train(1, reps)
    b, _ = s.aggregate_train(1, list(reversed(reps)))
    assert np.array_equal(a["w"].numpy(), b["w"].numpy())


def test_fedprox_sends_mu_and_samples_deterministically(cfg):
    grid = FakeGrid([101, 102, 103, 104])
    s = FedProxStrategy(cfg.replace(proximal_mu=0.5, fraction_train=0.5, min_clients=1))
    prepared(s, [101, 102, 103, 104])
    msgs = list(s.configure_train(3, arrays(0.0), ConfigRecord(), grid))
    assert len(msgs) == 2
    assert msgs[0].content["config"]["proximal-mu"] == 0.5
    again = FedProxStrategy(cfg.replace(proximal_mu=0.5, fraction_train=0.5, min_clients=1))
    prepared(again, [101, 102, 103, 104])
    msgs2 = list(again.configure_train(3, arrays(0.0), ConfigRecord(), grid))
    assert [m.metadata.dst_node_id for m in msgs] == [m.metadata.dst_node_id for m in msgs2]
    assert s.round.bytes_down == 2 * sum(r.count_bytes() for r in msgs[0].content.values())


def test_scaffold_server_update(cfg):
    s = ScaffoldStrategy(cfg.replace(scaffold_server_lr=0.5))
    msgs = prepared(s, [101, 102, 103, 104])  # N = 4 clients, 2 participate
    d1 = ArrayRecord({"w": Array(np.full((3, 2), 1.0, np.float32))})
    d2 = ArrayRecord({"w": Array(np.full((3, 2), 3.0, np.float32))})
    reps = [reply(msgs[0], content(2.0, 10, **{CV_DELTA: d1})),
            reply(msgs[1], content(4.0, 30, **{CV_DELTA: d2}))]
    s._sent = msgs[:2]
    out, _ = s.aggregate_train(1, reps)
    # x <- x + eta * (weighted mean - x) = 0 + 0.5 * 3.5
    assert np.allclose(out["w"].numpy(), 0.5 * (2 * 10 + 4 * 30) / 40)
    # c <- c + (1/N) sum of deltas = (1 + 3) / 4
    assert np.allclose(s.c["w"], 1.0) and "b" not in s.c
    content_next = s.train_content(2, out, ConfigRecord())
    assert np.allclose(content_next["server_cv"]["w"].numpy(), 1.0)
    assert dict(content_next[ACCEPTED]) == {"0": 1, "1": 1}  # whose Δc_i c now holds
    # an aggregate that overflows float32 (a server step of 3 here) is refused by the round
    # loop: c stays as it was (from a review: the refused step came back next round)
    s.cfg, s._reference, s._sent = s.cfg.replace(scaffold_server_lr=3.0), out, msgs[:1]
    out2, _ = s.aggregate_train(2, [reply(msgs[0], content(3e38, 10, **{CV_DELTA: d1}))])
    assert not np.isfinite(out2["w"].numpy()).all() and np.allclose(s.c["w"], 1.0)
    assert dict(s.train_content(3, out, ConfigRecord())[ACCEPTED]) == {"0": 1, "1": 1}


def test_scaffold_server_lr_steps_parameters_not_buffers(cfg):
    """eta_g extrapolates the parameters only: at eta_g = 3 a buffer stepped as well took a
    running variance from 1 and 0.1 to -1.7; buffers take FedAvg's weighted mean."""
    s = ScaffoldStrategy(cfg.replace(scaffold_server_lr=3.0))
    s.model = nn.BatchNorm1d(2)
    msgs = prepared(s, [101, 102])
    s._reference = bn_record(0.0, 1.0, 0)
    delta = ArrayRecord({"weight": Array(np.zeros(2, np.float32)), "bias": Array(np.zeros(2, np.float32))})
    reps = [reply(msgs[0], RecordDict({"arrays": bn_record(1.0, 0.1, 4), CV_DELTA: delta,
                                       "metrics": MetricRecord({"num-examples": 10})})),
            reply(msgs[1], RecordDict({"arrays": bn_record(1.0, 0.1, 8), CV_DELTA: delta,
                                       "metrics": MetricRecord({"num-examples": 30})}))]
    s._sent = msgs
    out, _ = s.aggregate_train(1, reps)
    assert np.allclose(out["weight"].numpy(), 3.0) and np.allclose(out["bias"].numpy(), 3.0)
    assert np.allclose(out["running_mean"].numpy(), 1.0) and np.allclose(out["running_var"].numpy(), 0.1)
    assert out["num_batches_tracked"].numpy().dtype == np.int64 and out["num_batches_tracked"].numpy() == 7


def test_parameter_names_leave_out_buffers_with_or_without_a_network(cfg):
    s = ScaffoldStrategy(cfg)
    assert s.model is None and s.parameter_names(bn_record(0.0, 1.0, 0)) == ["weight", "bias"]
    s.model = nn.BatchNorm1d(2)
    assert s.parameter_names(bn_record(0.0, 1.0, 0)) == ["weight", "bias"]


def test_scaffold_rejects_reply_without_delta(cfg):
    s = ScaffoldStrategy(cfg)
    msgs = prepared(s, [101, 102])
    bad = {"w": Array(np.zeros((9, 9), np.float32))}
    reps = [reply(msgs[0], content(1.0, 5)),
            reply(msgs[1], content(1.0, 5, **{CV_DELTA: ArrayRecord(bad)}))]
    assert s.aggregate_train(1, reps) == (None, None)
    assert s.accepted == {}  # neither client may adopt its c_i+
    reasons = [f["reason"] for f in s.round.failed]
    assert "missing ArrayRecord 'cv_delta'" in reasons[0] and "shape" in reasons[1]


def test_scaffold_records_only_the_taken_deltas(cfg):
    s = ScaffoldStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])
    d = ArrayRecord({"w": Array(np.ones((3, 2), np.float32))})
    reps = [reply(msgs[0], content(1.0, 5)),  # partition 0: no delta, refused
            reply(msgs[2], content(1.0, 5, **{CV_DELTA: d})),  # partition 2 taken
            reply(msgs[1], content(1.0, 5, **{CV_DELTA: d}))]  # partition 1 taken
    s.aggregate_train(4, reps)
    assert s.accepted == {"1": 4, "2": 4}


def test_a_round_without_evaluation_counts_no_failures(cfg):
    """Regression: with no evaluation messages sent, the training messages are not 'missing'."""
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102])
    s.aggregate_train(1, [reply(m, content(1.0, 5)) for m in msgs])
    assert s.aggregate_evaluate(1, []) is None
    assert s.round.failed == []


def test_a_metric_of_another_shape_is_refused_not_a_crash(cfg):
    """A metric that is a list in one reply and a number (or a list of another length) in the
    others made Flower's metric average raise after the round had trained."""
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102, 103, 104])
    odd = content(5.0, 10)
    odd["metrics"]["train-loss"] = [1.0, 2.0]
    short = content(5.0, 10)
    short["metrics"]["curve"] = [1.0]
    reps = [reply(msgs[0], content(1.0, 10)), reply(msgs[1], odd), reply(msgs[2], content(3.0, 10)),
            reply(msgs[3], short)]
    for r in (reps[0], reps[2]):
        r.content["metrics"]["curve"] = [1.0, 2.0]
    out, metrics = s.aggregate_train(1, reps)
    assert np.allclose(out["w"].numpy(), 2.0)  # partitions 0 and 2
    failed = {f["partition"]: f["reason"] for f in s.round.failed}
    assert failed == {1: "metric 'train-loss' is a list of 2 values where the other replies have "
                         "a number",
                      3: "metric 'curve' is a list of 1 values where the other replies have a "
                         "list of 2 values"}
    assert metrics["curve"] == [1.0, 2.0] and s.round.ok == [0, 2] and set(s.round.clients) == {0, 2}


@pytest.mark.parametrize("strategy", [FedAvgStrategy, FedProxStrategy])
def test_a_metric_some_replies_lack_is_averaged_over_those_that_report_it(cfg, strategy):
    """FedProx's constructor passed None for the metric aggregations, which replaced ours with
    Flower's: a metric one reply lacked was pulled towards 0."""
    s = strategy(cfg)
    msgs = prepared(s, [101, 102])
    bare = RecordDict({"arrays": arrays(1.0), "metrics": MetricRecord({"num-examples": 30})})
    _, metrics = s.aggregate_train(1, [reply(msgs[0], content(1.0, 10)), reply(msgs[1], bare)])
    assert metrics["train-loss"] == pytest.approx(1.0)  # not 10/40 of it


def test_float64_or_overweighted_replies_are_refused(cfg):
    """Finite float64 values can overflow a float32 model once averaged in; a sample count of
    1e300 overflows the total weight (the aggregate came out all zeros)."""
    s = FedAvgStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])
    wide = RecordDict({"arrays": ArrayRecord({k: Array(np.full(sh, 1e300)) for k, sh in SHAPES.items()}),
                       "metrics": MetricRecord({"num-examples": 10, "train-loss": 1.0})})
    out, _ = s.aggregate_train(1, [reply(msgs[0], content(1.0, 10)), reply(msgs[1], wide),
                                   reply(msgs[2], content(2.0, 1e300))])
    assert np.allclose(out["w"].numpy(), 1.0)
    failed = {f["partition"]: f["reason"] for f in s.round.failed}
    assert "dtype float64, expected float32" in failed[1]
    assert "not a plausible sample count" in failed[2]


class WhoamiGrid(FakeGrid):
    """Nodes that answer whoami with the given ``info`` records (None: no info at all)."""

    def __init__(self, infos: dict[int, dict | None]) -> None:
        super().__init__(list(infos))
        self.infos = infos

    def send_and_receive(self, messages, timeout=None):
        from tests.conftest import sent
        out = []
        for m in messages:  # (a reply comes from the node its message went to)
            info = self.infos[m.metadata.dst_node_id]
            content = RecordDict() if info is None else RecordDict({"info": ConfigRecord(info)})
            out.append(reply(sent(m.metadata.dst_node_id, mtype="query"), content))
        return out


def test_a_malformed_or_late_bad_node_is_ignored_not_fatal(cfg, caplog):
    """A whoami reply without partition info used to raise KeyError; a node that joins a running
    federation with another num-partitions is ignored (before round 1 it is a startup error)."""
    good = {"partition-id": 0, "num-partitions": 2}
    s = FedAvgStrategy(cfg)
    grid = WhoamiGrid({1: good, 2: None, 3: {"partition-id": "x", "num-partitions": 2}})
    with caplog.at_level("WARNING", logger="flowerbed"):
        assert s.discover(grid) == 2
    assert s.node_of == {0: 1} and s.ignored_nodes == {2, 3}
    assert "node 2 ignored" in caplog.text and "node 3 ignored" in caplog.text
    late = WhoamiGrid({1: good, 4: {"partition-id": 1, "num-partitions": 5}})
    with pytest.raises(ConfigError, match="num-partitions"):
        FedAvgStrategy(cfg).discover(late)  # before the rounds: the federation is misconfigured
    s = FedAvgStrategy(cfg)
    s.discover(WhoamiGrid({1: good}))
    s.running = True
    assert s.discover(late) == 2 and s.ignored_nodes == {4} and s.node_of == {0: 1}


def test_two_nodes_claiming_one_partition_and_silent_nodes_mid_run(cfg, caplog):
    """Regression: two nodes serving partition 0 took turns (the other partition was never
    trained) with a warning every round; a node that gave no usable whoami answer was asked
    again at every sampling with a fixed 120 s wait instead of round-timeout."""
    zero, one = {"partition-id": 0, "num-partitions": 2}, {"partition-id": 1, "num-partitions": 2}
    with pytest.raises(ConfigError, match="nodes 1 and 3 both serve it"):
        FedAvgStrategy(cfg).discover(WhoamiGrid({1: zero, 2: one, 3: zero}))

    class Counting(WhoamiGrid):
        asked: list = []

        def send_and_receive(self, messages, timeout=None):
            messages = list(messages)
            self.asked.append(([m.metadata.dst_node_id for m in messages], timeout))
            return super().send_and_receive([m for m in messages if m.metadata.dst_node_id != 4])

    s = FedAvgStrategy(cfg)
    s.discover(WhoamiGrid({1: zero, 2: one}))
    s.running = True
    grid = Counting({1: zero, 2: one, 3: zero, 4: one})  # 3 claims 0 again, 4 never answers
    with caplog.at_level("WARNING", logger="flowerbed"):
        for rnd in (1, 1, 2):  # training and evaluation sample twice in round 1
            assert s.sample(grid, rnd, 1.0, 0) == [1, 2]
    wait = min(cfg.round_timeout, 120.0)
    assert grid.asked == [([3, 4], wait), ([3, 4], wait)]  # once a round
    assert "node 3 ignored this round: run-config 'partition-id' = 0" in caplog.text
    s.sample(WhoamiGrid({2: one, 3: zero}), 3, 1.0, 0)  # node 1 left: node 3 takes partition 0
    assert s.node_of == {0: 3, 1: 2}


def test_a_node_back_with_other_data_is_ignored_until_it_serves_the_same(cfg, caplog):
    """Until 2026-12-06 a partition's node that came back reading another folder (or the seeded
    split) was warned about and trained on it: one run mixed two data sets, and a resume, which
    checks the data, refused what the attempt had accepted."""
    a = {"partition": "iid", "train-samples": 600}
    own = {"partition-id": 0, "num-partitions": 2, "data-dir": "/d0", "exported-with": json.dumps(a)}
    one = {"partition-id": 1, "num-partitions": 2}
    s = FedAvgStrategy(cfg)
    s.discover(WhoamiGrid({1: own, 2: one}))
    s.running = True
    other = {**own, "exported-with": json.dumps({**a, "train-samples": 900})}
    seeded = {"partition-id": 0, "num-partitions": 2}  # back without its folder
    for rnd, back in ((2, other), (3, seeded)):  # (a node is asked once a round)
        with caplog.at_level("WARNING", logger="flowerbed"):
            assert s.sample(WhoamiGrid({2: one, 5: back}), rnd, 1.0, 0) == [2]  # node 1 left
        assert 0 not in s.node_of and "node 5 ignored this round: it serves partition 0 from other data" \
            in caplog.text
        caplog.clear()
    same = {**own, "data-dir": "/elsewhere", "exported-with": json.dumps({**a, "train-samples": 600.0})}
    assert s.sample(WhoamiGrid({2: one, 5: same}), 4, 1.0, 0) == [5, 2]  # the same export: back in
    assert s.data_folders[0] == ("/elsewhere", {**a, "train-samples": 600.0})
    # before round 1 nothing has trained: a node back with other data replaces the first answer
    # (it was left out for the whole run, asked at every pass of the wait for nodes)
    s = FedAvgStrategy(cfg)
    s.discover(WhoamiGrid({1: own, 2: one}))
    with caplog.at_level("WARNING", logger="flowerbed"):
        assert s.discover(WhoamiGrid({2: one, 5: other})) == 2
    assert s.node_of == {0: 5, 1: 2} and s.first_data[0] == {**a, "train-samples": 900}
    assert "ignored" not in caplog.text
    # a newcomer that claims a held partition with other data is told about its data first
    s.running = True
    with caplog.at_level("WARNING", logger="flowerbed"):
        s.sample(WhoamiGrid({2: one, 5: other, 6: seeded}), 5, 1.0, 0)
    assert "node 6 ignored this round: it serves partition 0 from other data" in caplog.text


# ------------------------------------------------ found by a mutation review (session 37)


def with_metrics(value, n, **metrics):
    return RecordDict({"arrays": arrays(value),
                       "metrics": MetricRecord({"num-examples": n, **metrics})})


def test_train_metrics_are_sample_weighted(cfg):
    """A1: aggregate_metrics must weight each reply's metric by num-examples (not count replies)."""
    s = FedAvgStrategy(cfg)
    s._reference = arrays(0.0)
    msgs = prepared(s, [101, 102])
    _, m = s.aggregate_train(1, [reply(msgs[0], with_metrics(1.0, 10, **{"train-loss": 1.0})),
                                 reply(msgs[1], with_metrics(1.0, 30, **{"train-loss": 3.0}))])
    assert m["train-loss"] == pytest.approx((10 * 1.0 + 30 * 3.0) / 40)  # 2.5, not 2.0


def test_cast_like_rounds_integer_buffers():
    """A2: an averaged int64 buffer is rounded to nearest, not truncated."""
    ref = ArrayRecord({"n": Array(np.array([0], np.int64)), "w": Array(np.zeros(2, np.float32))})
    rec = ArrayRecord({"n": Array(np.array([2.75])), "w": Array(np.array([0.5, 1.5]))})
    out = cast_like(rec, ref)
    assert out["n"].numpy().dtype == np.int64 and out["n"].numpy().tolist() == [3]
    assert out["w"].numpy().dtype == np.float32


def test_aggregate_keeps_the_models_integer_dtype(cfg):
    """A2/A3: FedAvg of int64 buffers comes back int64 (rounded), so next round's int64 replies
    still match the model."""
    s = FedAvgStrategy(cfg)
    ref = ArrayRecord({"w": Array(np.zeros(2, np.float32)), "n": Array(np.array([0], np.int64))})
    s._reference = ref
    msgs = sent_to(s, [101, 102])

    def c(v, k, n):
        return RecordDict({"arrays": ArrayRecord({"w": Array(np.full(2, v, np.float32)),
                                                  "n": Array(np.array([k], np.int64))}),
                           "m": MetricRecord({"num-examples": n})})

    out, _ = s.aggregate_train(1, [reply(msgs[0], c(1.0, 1, 10)), reply(msgs[1], c(2.0, 2, 30))])
    assert out["n"].numpy().dtype == np.int64 and out["n"].numpy().tolist() == [2]  # 1.75 -> 2


def test_sampling_changes_from_round_to_round(cfg):
    """A4: the sampling generator is seeded by the round too; the same clients every round would
    leave the others untrained."""
    s = FedAvgStrategy(cfg.replace(fraction_train=0.3, min_clients=1))
    nodes = list(range(100, 110))
    prepared(s, nodes)
    grid = FakeGrid(nodes)
    picks = {tuple(s.sample(grid, r, 0.3, 0)) for r in range(1, 9)}
    assert len(picks) > 1
    assert all(len(p) == 3 for p in picks)


def test_sampling_never_goes_below_min_clients(cfg):
    """A5: fraction x clients below min-clients still samples min-clients (else every round would
    be skipped for too few replies)."""
    s = FedAvgStrategy(cfg.replace(fraction_train=0.1, min_clients=3))
    nodes = list(range(100, 110))
    prepared(s, nodes)
    assert len(s.sample(FakeGrid(nodes), 1, 0.1, 0)) == 3


def test_the_last_round_is_always_evaluated(cfg):
    """A6: eval-every not dividing num-server-rounds still evaluates the last round."""
    s = FedAvgStrategy(cfg.replace(eval_every=3, num_server_rounds=4))
    assert [r for r in range(1, 5) if s.evaluates(r)] == [3, 4]


def test_a_reply_with_a_nan_metric_is_refused(cfg):
    """A7: a NaN train-loss is left out (it would turn the round's metric into NaN)."""
    s = FedAvgStrategy(cfg)
    s._reference = arrays(0.0)
    msgs = prepared(s, [101, 102])
    _, m = s.aggregate_train(1, [reply(msgs[0], with_metrics(1.0, 10, **{"train-loss": 1.0})),
                                 reply(msgs[1], with_metrics(1.0, 10, **{"train-loss": float("nan")}))])
    assert [f["partition"] for f in s.round.failed] == [1]
    assert "not finite" in s.round.failed[0]["reason"] and m["train-loss"] == pytest.approx(1.0)


def test_scaffold_control_variate_update_option_ii():
    """S1/S3: c_i+ = c_i - c + (x - y) / (K eta / (1 - beta)); delta = c_i+ - c_i."""
    from flowerbed.clients.scaffold import PENDING, ScaffoldClient
    from flowerbed.strategies.scaffold import CV_DELTA

    cfg = Config.from_run_config({"method": "scaffold", "lr": 0.1, "momentum": 0.5})
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # y (after training)
    me = ScaffoldClient.__new__(ScaffoldClient)  # no data: only the update is computed
    me.cfg, me.steps = cfg, 4
    me.context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    me._x = {"weight": torch.full((1, 1), 3.0)}  # x (before training)
    me._c, me._ci = {"weight": torch.full((1, 1), 0.5)}, {"weight": torch.full((1, 1), 0.2)}
    out = me.extra_arrays(model, sent(1, RecordDict({"config": ConfigRecord({"server-round": 1})})))
    ci_plus = 0.2 - 0.5 + (3.0 - 1.0) / (4 * 0.1 / (1 - 0.5))  # = 2.2
    assert me.context.state[PENDING]["weight"].numpy().item() == pytest.approx(ci_plus)
    assert out[CV_DELTA]["weight"].numpy().item() == pytest.approx(ci_plus - 0.2)


def test_scaffold_correction_adds_c_minus_c_i_to_the_gradient():
    """S2: each step uses g - c_i + c: a positive server c pushes parameters down."""
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.registry import METHODS
    from flowerbed.strategies.scaffold import SERVER_CV
    from flowerbed.training import to_record
    from tests.conftest import sent

    small = {"method": "scaffold", "train-samples": 1000, "test-samples": 100, "batch-size": 32,
             "local-test-fraction": 0.25}
    cfg = Config.from_run_config(small)
    torch.manual_seed(0)
    model = to_record(make_model(cfg, train_set(cfg)))

    def train(c_value):
        ctx = Context(run_id=1, node_id=4, node_config={"partition-id": 2, "num-partitions": 5},
                      state=RecordDict(), run_config=cfg.to_run_config())
        cv = ArrayRecord({k: Array(np.full(v.numpy().shape, c_value, np.float32))
                          for k, v in model.items() if k == "fc2.bias"})
        out = METHODS["scaffold"].client(cfg, ctx).train(sent(4, RecordDict({
            "arrays": model, SERVER_CV: cv, "config": ConfigRecord({"server-round": 1})})))
        return out.content["arrays"]["fc2.bias"].numpy()

    assert (train(1.0) - train(0.0)).max() < 0  # the correction +c lowers every bias entry


def test_jain_index_by_hand():
    """C1: Jain's index (sum x)^2 / (n sum x^2)."""
    from flowerbed.apps.server_app import fairness

    f = fairness([1.0, 0.0])
    assert f["jain-index"] == pytest.approx(0.5)
    assert fairness([0.6, 0.6, 0.6])["jain-index"] == pytest.approx(1.0)
    assert f["client-accuracy-std"] == pytest.approx(0.5)


def test_a_simulation_client_without_a_gpu_share_stays_on_the_cpu(monkeypatch):
    """From a GPU-readiness review: on a GPU box, a client given `num-gpus` 0 found CUDA only
    because Ray hides the GPUs from it, a default Ray says it will drop; then every such client
    would use cuda:0. Ray's own assignment now decides; the ServerApp (Ray's driver, not an
    actor) and processes without Ray keep the GPU. (Ray faked: there is no GPU here.)"""
    import sys
    import types

    from flowerbed.training import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device().type == "cuda"  # no Ray loaded: a deployed SuperNode, a test

    def ray(actor: str | None, gpus: list) -> types.ModuleType:
        ctx = types.SimpleNamespace(get_actor_id=lambda: actor)
        return types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: ctx,
                                     get_gpu_ids=lambda: gpus)

    for actor, gpus, device in [("a1", [], "cpu"), ("a1", ["0"], "cuda"), (None, [], "cuda")]:
        monkeypatch.setitem(sys.modules, "ray", ray(actor, gpus))
        assert pick_device().type == device, (actor, gpus)


def test_feddyn_server_update_by_hand_with_batchnorm_buffers(cfg):
    """h <- h - alpha/m sum_P (theta_k - theta); theta <- mean_P theta_k - h/alpha over the
    parameters (an unweighted mean); buffers take FedAvg's mean, int64 ones stay int64."""
    from flowerbed.strategies.feddyn import FedDynStrategy
    from flowerbed.strategies.synced import ACCEPTED

    s = FedDynStrategy(cfg.replace(feddyn_alpha=0.1))
    s.model = nn.BatchNorm1d(2)  # parameters weight, bias; buffers incl. num_batches_tracked
    msgs = prepared(s, [101, 102, 103, 104])  # m = 4 clients, 2 participate
    s._reference = bn_record(0.0, n=0)
    reps = [reply(msgs[0], RecordDict({"arrays": bn_record(2.0, n=3),
                                       "metrics": MetricRecord({"num-examples": 10})})),
            reply(msgs[1], RecordDict({"arrays": bn_record(4.0, n=6),
                                       "metrics": MetricRecord({"num-examples": 30})}))]
    s._sent = msgs[:2]
    out, _ = s.aggregate_train(1, reps)
    h = -0.1 / 4 * (2.0 + 4.0)
    assert np.allclose(s.h["weight"], h) and "running_mean" not in s.h
    assert np.allclose(out["weight"].numpy(), 3.0 - h / 0.1)  # 4.5, not the weighted 3.5
    assert np.allclose(out["running_mean"].numpy(), (2 * 10 + 4 * 30) / 40)
    assert out["num_batches_tracked"].numpy().dtype == np.int64
    assert dict(s.train_content(2, out, ConfigRecord())[ACCEPTED]) == {"0": 1, "1": 1}
    # scored: the served model, or with feddyn-eval='average' the uploads' plain mean (the
    # official code's avg_model), on the server and in the clients' evaluation messages
    assert s.scored(out) is out
    s.cfg = s.cfg.replace(feddyn_eval="average")
    avg = s.eval_content(out)["arrays"]
    assert np.allclose(avg["weight"].numpy(), 3.0) and np.allclose(avg["running_mean"].numpy(), 3.5)
    s.cfg = s.cfg.replace(feddyn_eval="served")
    s._reference = out  # round 2: one client, no change: h stays, theta = theta_k - h/alpha
    s._sent = msgs[:1]
    out2, _ = s.aggregate_train(2, [reply(msgs[0], RecordDict({"arrays": out, "metrics": MetricRecord(
        {"num-examples": 10})}))])
    assert np.allclose(s.h["weight"], h) and np.allclose(out2["weight"].numpy(), 4.5 - h / 0.1)
    # an aggregate that overflows float32 is refused by the round loop: h and whose state the
    # server took stay as they were (from a review: the refused step came back next round)
    s._reference, s._sent = out2, msgs[:1]
    huge = RecordDict({"arrays": bn_record(3e38, n=3), "metrics": MetricRecord({"num-examples": 10})})
    out3, _ = s.aggregate_train(3, [reply(msgs[0], huge)])
    assert not np.isfinite(out3["weight"].numpy()).all()
    assert np.allclose(s.h["weight"], h) and s.accepted["0"] == 2


def test_synced_state_reads_scaffolds_older_pending_round_and_drops_a_roundless_pending(caplog):
    """State filed before the handshake was shared named SCAFFOLD's pending round
    'scaffold.pending-round': a resume from it adopts as before; a pending state without its
    round is dropped with a warning instead of failing every round after."""
    from flowerbed.clients.scaffold import PENDING, STATE_KEY, ScaffoldClient
    from flowerbed.strategies.synced import ACCEPTED

    me = ScaffoldClient.__new__(ScaffoldClient)
    me.partition_id = 0
    pending = ArrayRecord({"weight": Array(np.ones(1, np.float32))})
    me.context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(
        {PENDING: pending, "scaffold.pending-round": ConfigRecord({"round": 3})}), run_config={})
    me.adopt_pending(sent(1, RecordDict({ACCEPTED: ConfigRecord({"0": 3})})))
    assert STATE_KEY in me.context.state and PENDING not in me.context.state
    assert "scaffold.pending-round" not in me.context.state
    me.context.state[PENDING] = pending
    with caplog.at_level("WARNING", logger="flowerbed"):
        me.adopt_pending(sent(1, RecordDict({ACCEPTED: ConfigRecord({"0": 3})})))
    assert PENDING not in me.context.state and "without its round" in caplog.text


def test_fednova_normalises_each_update_by_its_gradient_weight(cfg):
    """x <- x - tau_eff sum_i p_i (x - y_i) / ||a_i||_1: two clients that end at the same model
    after 2 and 4 steps' worth of gradient weight; equal norms give FedAvg's mean; a reply
    without a positive norm is refused."""
    from flowerbed.strategies.fednova import NORM, FedNovaStrategy

    s = FedNovaStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])

    def nova(value, n, norm):
        return RecordDict({"arrays": arrays(value), "metrics": MetricRecord(
            {"num-examples": n, "train-loss": 1.0, **({NORM: norm} if norm is not None else {})})})

    out, m = s.aggregate_train(1, [reply(msgs[0], nova(2.0, 10, 2.0)), reply(msgs[1], nova(2.0, 30, 4.0)),
                                   reply(msgs[2], nova(9.0, 10, 0.0))])
    tau = 0.25 * 2 + 0.75 * 4  # p = (0.25, 0.75): partition 2 (norm 0) refused
    assert np.allclose(out["w"].numpy(), tau * (0.25 / 2 * 2.0 + 0.75 / 4 * 2.0))  # 2.1875, not 2
    assert m["tau-eff"] == pytest.approx(tau) and [f["partition"] for f in s.round.failed] == [2]
    assert "nova-norm" not in m  # its weighted mean is tau-eff
    assert "'nova-norm' must be in [1, " in s.round.failed[0]["reason"]
    s._sent = msgs[:1]  # a norm far above what 10 samples allow: refused too (it would inflate tau_eff)
    assert s.aggregate_train(2, [reply(msgs[0], nova(2.0, 10, 1e12))]) == (None, None)
    assert "got 1000000000000.0" in s.round.failed[-1]["reason"]
    s._sent = msgs[:2]
    even, _ = s.aggregate_train(2, [reply(msgs[0], nova(1.0, 10, 3.0)), reply(msgs[1], nova(4.0, 30, 3.0))])
    assert np.allclose(even["w"].numpy(), (1.0 * 10 + 4.0 * 30) / 40)


def test_fednova_update_covers_parameters_and_buffers_keep_the_mean(cfg):
    """On a BatchNorm model FedNova normalises the parameters' updates only: the running
    statistics take FedAvg's mean (a normalised step on a variance can turn it negative) and
    num_batches_tracked stays int64."""
    from flowerbed.strategies.fednova import NORM, FedNovaStrategy

    s = FedNovaStrategy(cfg)
    s.model = nn.BatchNorm1d(2)
    msgs = prepared(s, [101, 102])
    s._reference = bn_record(0.0, 1.0, 0)
    reps = [reply(msgs[i], RecordDict({"arrays": bn_record(2.0, var, n), "metrics": MetricRecord(
        {"num-examples": ex, "train-loss": 1.0, NORM: norm})}))
        for i, (var, n, ex, norm) in enumerate([(0.1, 4, 10, 2.0), (0.3, 8, 30, 4.0)])]
    s._sent = msgs
    out, _ = s.aggregate_train(1, reps)
    tau = 0.25 * 2 + 0.75 * 4
    assert np.allclose(out["weight"].numpy(), tau * (0.25 / 2 * 2.0 + 0.75 / 4 * 2.0))
    assert np.allclose(out["running_var"].numpy(), 0.25 * 0.1 + 0.75 * 0.3)
    assert out["num_batches_tracked"].numpy().dtype == np.int64 and out["num_batches_tracked"].numpy() == 7


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_fednova_gradient_weight_is_what_the_optimiser_applied(momentum):
    """A constant gradient g moves a parameter by lr * g * ||a||_1 over the steps."""
    from flowerbed.clients.fednova import gradient_weight
    from flowerbed.training import make_optimizer

    w = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        w.weight.zero_()
    opt = make_optimizer(w, 0.1, momentum, 0.0)
    for _ in range(7):
        opt.zero_grad()
        (w.weight * 2.0).sum().backward()  # gradient 2 at every step
        opt.step()
    assert -w.weight.item() == pytest.approx(0.1 * 2.0 * gradient_weight(7, momentum), rel=1e-5)


def test_fedmgda_min_norm_weights_against_a_grid_search():
    """argmin λᵀGλ over the simplex within ε of λ0 (three clients), against a grid; ε = 0 keeps λ0."""
    from flowerbed.strategies.fedmgda import min_norm_weights

    d = np.array([[1.0, 0.0], [0.0, 1.0], [-0.6, 0.8]])
    gram, lambda0 = d @ d.T, np.array([0.5, 0.3, 0.2])
    for eps in (0.05, 0.2, 1.0):
        lam = min_norm_weights(gram, lambda0, eps)
        assert lam.sum() == pytest.approx(1) and (lam >= 0).all()
        assert (np.abs(lam - lambda0) <= eps + 1e-9).all()
        grid = [np.array([a, b, 1 - a - b]) for a in np.linspace(0, 1, 201) for b in np.linspace(0, 1, 201)
                if a + b <= 1 and (np.abs(np.array([a, b, 1 - a - b]) - lambda0) <= eps).all()]
        assert lam @ gram @ lam <= min(g @ gram @ g for g in grid) + 1e-6
    assert np.array_equal(min_norm_weights(gram, lambda0, 0.0), lambda0)


def test_fedmgda_steps_along_the_weighted_normalised_updates(cfg):
    """ε = 0: θ − η Σ λ0_i d_i with d_i the unit updates; ε = 1 with opposite updates: no common
    descent direction, so the model stays (FedAvg would move); a client that did not move adds
    nothing and no NaN."""
    from flowerbed.strategies.fedmgda import FedMGDAStrategy

    def run(eps, values, ns=(10, 30), lr=0.5):
        s = FedMGDAStrategy(cfg.replace(method="fedmgda", fedmgda_epsilon=eps, fedmgda_lr=lr))
        msgs = sent_to(s, list(range(101, 101 + len(values))))
        s._reference = arrays(0.0)
        return s.aggregate_train(1, [reply(msg, content(v, n))
                                     for msg, v, n in zip(msgs, values, ns, strict=True)])

    w = {"w": np.zeros((3, 2)), "b": np.zeros(2)}
    one, two = {**w, "b": np.array([-3.0, 0.0])}, {**w, "b": np.array([0.0, -4.0])}  # θ − θ_i: (3, 0), (0, 4)
    out, m = run(0.0, [one, two])
    assert np.allclose(out["b"].numpy(), [-0.5 * 0.25, -0.5 * 0.75]) and np.allclose(out["w"].numpy(), 0)
    assert m["mgda-weight-shift"] == 0
    out, m = run(1.0, [{**w, "b": np.array([-3.0, 0.0])}, {**w, "b": np.array([1.0, 0.0])}])
    assert np.allclose(out["b"].numpy(), 0, atol=1e-6)
    assert m["mgda-direction-norm"] == pytest.approx(0, abs=1e-6)
    out, _ = run(0.0, [one, 0.0])
    assert np.isfinite(out["b"].numpy()).all() and np.allclose(out["b"].numpy(), [-0.5 * 0.25, 0])


@pytest.mark.parametrize(("key", "value"), [("fedmgda-epsilon", -0.1), ("fedmgda-epsilon", 1.5),
                                            ("fedmgda-lr", 0.0), ("fedmgda-lr", float("inf"))])
def test_fedmgda_settings_out_of_range_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=key):
        Config.from_run_config({"method": "fedmgda", key: value})


def test_fedmgda_steps_the_parameters_and_averages_batchnorm_buffers(cfg):
    """The step covers the parameters; running statistics take FedAvg's mean and
    num_batches_tracked stays int64."""
    from flowerbed.strategies.fedmgda import FedMGDAStrategy

    s = FedMGDAStrategy(cfg.replace(method="fedmgda", fedmgda_epsilon=0.0, fedmgda_lr=1.0))
    s.model = nn.BatchNorm1d(2)
    msgs = sent_to(s, [101, 102])
    s._reference = bn_record(0.0, 1.0, 0)
    reps = [reply(msgs[i], RecordDict({"arrays": bn_record(2.0, var, n), "metrics": MetricRecord(
        {"num-examples": ex, "train-loss": 1.0})}))
        for i, (var, n, ex) in enumerate([(0.1, 4, 10), (0.3, 8, 30)])]
    out, _ = s.aggregate_train(1, reps)
    assert np.allclose(out["weight"].numpy(), 0.5)  # a unit step along (1, 1, 1, 1) / 2: the 4 parameters
    assert np.allclose(out["running_var"].numpy(), 0.25 * 0.1 + 0.75 * 0.3)
    assert out["num_batches_tracked"].numpy().dtype == np.int64 and out["num_batches_tracked"].numpy() == 7


def test_a_model_whose_logits_overflow_is_scored_as_diverged_not_as_a_guess():
    """From a review: only NaN outputs counted, so finite weights whose logits overflowed to inf
    scored an accuracy (argmax's class 0) beside a NaN loss."""
    import torch

    from flowerbed.datasets.loading import DataSet
    from flowerbed.training import evaluate

    data = DataSet("fashion-mnist", torch.full((8, 1, 2, 2), 255, dtype=torch.uint8),
                   torch.tensor([0, 1, 2, 3] * 2), 4)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.fill_(1e38)
        model[1].bias.zero_()
    loss, acc = evaluate(model, data, torch.device("cpu"))
    assert np.isnan(loss) and np.isnan(acc)


def test_feddyn_scores_the_served_model_or_the_uploads_mean(tmp_path):
    from inprocess import run_inprocess

    rc = {"method": "feddyn", "num-server-rounds": 2, "train-samples": 600, "test-samples": 200,
          "min-clients": 2, "output-dir": str(tmp_path), "feddyn-alpha": 0.1}
    served = run_inprocess({**rc, "run-name": "served"}, 3)
    average = run_inprocess({**rc, "run-name": "average", "feddyn-eval": "average"}, 3)
    assert np.isfinite([served["final-loss"], average["final-loss"]]).all()
    assert served["final-loss"] != average["final-loss"]  # the same training, another model scored


def test_a_client_scored_with_a_diverged_model_counts_as_zero_not_as_missing():
    """From a review: a client whose model's outputs overflowed replied NaN and was refused, so
    the clients' mean, min and Jain's index covered the survivors only (min 0.8 where one
    client's model classified nothing)."""
    from flowerbed.registry import METHODS

    cfg = Config.from_run_config({"train-samples": 600, "local-test-fraction": 0.25, "min-clients": 1})
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 2, "num-partitions": 3},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS["fedavg"].client(cfg, ctx)
    model = client.new_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1e30)  # finite weights, outputs that overflow to inf
    msg = sent(7, RecordDict({"config": ConfigRecord({"server-round": 1})}), "evaluate")
    diverged = client.scored(msg, model).content["metrics"]
    assert diverged["accuracy"] == 0.0 and diverged["diverged"] == 1.0 and "loss" not in diverged
    s = FedAvgStrategy(cfg)
    s.node_of, s.partition_of = {0: 5, 1: 6, 2: 7}, {5: 0, 6: 1, 7: 2}
    s._sent = [sent(n, mtype="evaluate") for n in (5, 6, 7)]
    ok = [MetricRecord({"num-examples": 10, "accuracy": a, "loss": 0.5}) for a in (0.9, 0.8)]
    metrics = s.aggregate_evaluate(1, [reply(m, RecordDict({"metrics": r}))
                                       for m, r in zip(s._sent, [*ok, diverged], strict=True)])
    n = diverged["num-examples"]
    assert not s.round.failed and metrics["accuracy"] == pytest.approx(17 / (20 + n))
    assert metrics["loss"] == pytest.approx(0.5)  # over the clients that have one
    assert metrics["diverged"] == 1  # how many clients (it read 1.0, the mean of the flags sent)
    two = s.aggregate_evaluate(1, [reply(m, RecordDict({"metrics": r}))
                                   for m, r in zip(s._sent, [ok[0], diverged, diverged], strict=True)])
    assert two["diverged"] == 2


def test_a_seeded_initialisation_leaves_the_gpus_generators_alone(monkeypatch):
    """From a GPU review: torch.manual_seed inside fork_rng(devices=[]) reseeded CUDA's generator
    for good (fork_rng put back the CPU's only), so a later draw on the GPU got that fixed seed."""
    from flowerbed.training import cpu_seeded

    torch.random.default_generator.manual_seed(5)
    expected = torch.rand(3)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: pytest.fail("reseeded CUDA"))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: pytest.fail("reseeded CUDA"))
    before = torch.random.get_rng_state()
    with cpu_seeded(5):
        assert torch.equal(torch.rand(3), expected)  # the same draws as torch.manual_seed gave
    assert torch.equal(torch.random.get_rng_state(), before)
