"""FedFew's weights and update, IFCA's clustering, FedRep's split, Ditto's and APFL's two models,
and the personalised clients."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from flowerbed.config import Config
from flowerbed.registry import METHODS
from flowerbed.strategies.fedavg import FedAvgStrategy
from flowerbed.strategies.fedfew import FedFewStrategy, fedfew_weights
from flowerbed.strategies.ifca import IFCAStrategy
from flowerbed.strategies.personal import pack, unpack
from tests.conftest import bn_record, prepared, reply, sent, train_messages


def direct(losses, n, mu):
    scaled = (n / n.sum())[:, None] * losses
    e = np.exp(-scaled / mu)
    s = e.sum(1)
    return e / s[:, None], (1 / s) / (1 / s).sum()


@pytest.mark.parametrize("mu", [0.01, 0.5, 10.0])
def test_weights_sum_to_one_and_match_direct_computation(mu):
    rng = np.random.default_rng(0)
    losses, n = rng.uniform(0.1, 2.0, (5, 3)), rng.integers(10, 100, 5).astype(float)
    w, alpha = fedfew_weights(losses, n, mu)
    assert np.allclose(w.sum(1), 1) and alpha.sum() == pytest.approx(1)
    w2, a2 = direct(losses, n, mu)
    assert np.allclose(w, w2) and np.allclose(alpha, a2)


def test_weights_at_extreme_mu():
    losses = np.array([[0.2, 1.0, 3.0], [2.0, 0.1, 0.5]])
    n = np.array([50.0, 50.0])
    w, alpha = fedfew_weights(losses, n, 1e-6)  # direct exp would underflow: log space copes
    assert np.isfinite(w).all() and np.allclose(w.sum(1), 1) and alpha.sum() == pytest.approx(1)
    assert w[0].argmax() == 0 and w[1].argmax() == 1 and w.max(1) == pytest.approx([1, 1])
    assert alpha[0] == pytest.approx(1.0)  # client 0's best loss (0.1 scaled) is worse: all weight
    w, alpha = fedfew_weights(losses, n, 1e6)  # very smooth: uniform
    assert np.allclose(w, 1 / 3, atol=1e-5) and np.allclose(alpha, 0.5, atol=1e-5)


SHAPES = {"w": (2, 2)}


def rec(v):
    return ArrayRecord({k: Array(np.full(s, v, np.float32)) for k, s in SHAPES.items()})


def test_k1_update_equals_fedavg_when_clients_tie():
    cfg = Config.from_run_config({"method": "fedfew", "num-models": 1, "min-clients": 1})
    few, avg = FedFewStrategy(cfg), FedAvgStrategy(cfg.replace(method="fedavg"))
    msgs_f, msgs_a = prepared(few, list(range(100, 103))), prepared(avg, list(range(100, 103)))
    few._models, few._reference = [rec(0.0)], rec(0.0)
    avg._reference = rec(0.0)
    vals = [1.0, 2.0, 6.0]
    rf = [reply(m, RecordDict({"model.0": rec(v), "m": MetricRecord({"num-examples": 10,
                                                                     "losses": [0.5]})}))
          for m, v in zip(msgs_f, vals, strict=True)]
    ra = [reply(m, RecordDict({"arrays": rec(v), "m": MetricRecord({"num-examples": 10})}))
          for m, v in zip(msgs_a, vals, strict=True)]
    out_f, _ = few.aggregate_train(1, rf)
    out_a, _ = avg.aggregate_train(1, ra)
    assert np.allclose(unpack(out_f, 1)[0]["w"].numpy(), out_a["w"].numpy())


@pytest.mark.parametrize(("server_lr", "step"), [(1.0, "paper"), (2.0, "paper"),
                                                 (1.0, "normalised")])
def test_fedfew_update_by_hand(server_lr, step):
    cfg = Config.from_run_config({"method": "fedfew", "num-models": 2, "min-clients": 1,
                                  "fedfew-mu": 0.5, "fedfew-server-lr": server_lr,
                                  "fedfew-step": step})
    s = FedFewStrategy(cfg)
    msgs = prepared(s, list(range(100, 102)))
    s._models, s._reference = [rec(0.0), rec(1.0)], rec(0.0)
    losses, n = np.array([[0.2, 1.0], [1.5, 0.3]]), np.array([30.0, 10.0])
    reps = [reply(msgs[i], RecordDict({"model.0": rec(2.0 + i), "model.1": rec(5.0 + i),
                                       "m": MetricRecord({"num-examples": int(n[i]),
                                                          "losses": losses[i].tolist()})}))
            for i in range(2)]
    out, metrics = s.aggregate_train(1, reps)
    w, alpha = direct(losses, n, 0.5)
    c = alpha[:, None] * w
    if step == "normalised":  # each model: the c-weighted average of its clients' models
        c = c / c.sum(0)
    m0 = 0.0 + server_lr * sum(c[i, 0] * ((2.0 + i) - 0.0) for i in range(2))
    m1 = 1.0 + server_lr * sum(c[i, 1] * ((5.0 + i) - 1.0) for i in range(2))
    if step == "normalised":
        assert 2.0 <= m0 <= 3.0 and 5.0 <= m1 <= 6.0  # within its clients' models
    got = unpack(out, 2)
    assert got[0]["w"].numpy() == pytest.approx(np.full((2, 2), m0), rel=1e-5)
    assert got[1]["w"].numpy() == pytest.approx(np.full((2, 2), m1), rel=1e-5)
    assert metrics["model-0-weight"] + metrics["model-1-weight"] == pytest.approx(1.0)


def test_fedfew_server_lr_steps_parameters_not_buffers():
    """A buffer (BatchNorm's running variance) moves by eta_s = 1, a convex combination: at
    eta_s = 3 with one model taking the weight, 1 and 0.1 extrapolated to -1.7."""
    from torch import nn

    cfg = Config.from_run_config({"method": "fedfew", "num-models": 1, "min-clients": 1,
                                  "fedfew-server-lr": 3.0})
    s = FedFewStrategy(cfg)
    s.model = nn.BatchNorm1d(2)
    msgs = prepared(s, [100])
    s._models, s._reference = [bn_record(0.0, 1.0)], bn_record(0.0, 1.0)
    content = RecordDict({"model.0": bn_record(1.0, 0.1),
                          "m": MetricRecord({"num-examples": 10, "losses": [0.5]})})
    out, _ = s.aggregate_train(1, [reply(msgs[0], content)])
    got = unpack(out, 1)[0]
    assert np.allclose(got["weight"].numpy(), 3.0) and np.allclose(got["running_mean"].numpy(), 1.0)
    assert np.allclose(got["running_var"].numpy(), 0.1)


def test_ifca_averages_within_clusters():
    cfg = Config.from_run_config({"method": "ifca", "num-models": 2, "min-clients": 1})
    s = IFCAStrategy(cfg)
    msgs = prepared(s, list(range(100, 103)))
    s._models, s._reference = [rec(0.0), rec(9.0)], rec(0.0)
    reps = [reply(msgs[0], RecordDict({"arrays": rec(1.0), "m": MetricRecord({"num-examples": 10,
                                                                              "cluster": 0})})),
            reply(msgs[1], RecordDict({"arrays": rec(3.0), "m": MetricRecord({"num-examples": 30,
                                                                              "cluster": 0})})),
            reply(msgs[2], RecordDict({"arrays": rec(7.0), "m": MetricRecord({"num-examples": 5,
                                                                              "cluster": 5})}))]
    out, metrics = s.aggregate_train(1, reps)
    got = unpack(out, 2)
    assert np.allclose(got[0]["w"].numpy(), 2.5)  # (1*10 + 3*30) / 40
    assert np.allclose(got[1]["w"].numpy(), 9.0)  # nobody chose it: unchanged
    assert [f["partition"] for f in s.round.failed] == [2]  # cluster 5 does not exist


def test_pack_round_trip():
    models = [rec(1.0), rec(2.0), rec(3.0)]
    back = unpack(pack(models), 3)
    assert [float(m["w"].numpy()[0, 0]) for m in back] == [1.0, 2.0, 3.0]


SMALL = {"train-samples": 1000, "test-samples": 100, "batch-size": 32, "local-test-fraction": 0.25,
         "num-models": 2, "partition": "pathological:2"}


def client(method):
    cfg = Config.from_run_config({**SMALL, "method": method})
    ctx = Context(run_id=1, node_id=4, node_config={"partition-id": 2, "num-partitions": 5},
                  state=RecordDict(), run_config=cfg.to_run_config())
    return METHODS[method].client(cfg, ctx), cfg, ctx


def test_fedfew_client_returns_k_models_and_losses_and_picks_by_train_loss():
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import to_record

    c, cfg, _ = client("fedfew")
    models = {f"model.{k}": to_record(make_model(cfg, train_set(cfg))) for k in range(2)}
    out = c.train(sent(4, RecordDict({**models, "config": ConfigRecord({"server-round": 1})})))
    assert set(out.content.array_records) == {"model.0", "model.1"}
    assert len(out.content["metrics"]["losses"]) == 2
    ev = c.evaluate(sent(4, RecordDict({**{k: out.content[k] for k in models},
                                        "config": ConfigRecord({"server-round": 1})})))
    assert ev.content["metrics"]["chosen-model"] in (0, 1)
    assert 0 <= ev.content["metrics"]["accuracy"] <= 1


def test_fedrep_keeps_the_head_and_uploads_the_body():
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import to_record

    c, cfg, ctx = client("fedrep")
    full = to_record(make_model(cfg, train_set(cfg)))
    out = c.train(sent(4, RecordDict({"arrays": full, "config": ConfigRecord({"server-round": 1})})))
    assert not any(k.startswith("fc2.") for k in out.content["arrays"])
    assert set(ctx.state["fedrep.head"]) == {"fc2.weight", "fc2.bias"}
    head = ctx.state["fedrep.head"]["fc2.weight"].numpy()
    assert not np.allclose(head, full["fc2.weight"].numpy())  # the head trained locally


def test_ditto_uploads_fedavgs_update_and_scores_its_personal_model():
    """The global update is FedAvg's to the bit (the personal model draws its own batch order);
    the personal model is filed in context.state, carried into the next round, and evaluated."""
    from flowerbed.clients.base import make_model
    from flowerbed.clients.ditto import STATE
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import evaluate, load_record, to_record

    ditto, cfg, ctx = client("ditto")
    fedavg, _, _ = client("fedavg")
    full = to_record(make_model(cfg, train_set(cfg)))

    def train(c, rnd, arrays):
        return c.train(sent(4, RecordDict({"arrays": arrays,
                                           "config": ConfigRecord({"server-round": rnd})})))

    out = train(ditto, 1, full)
    same = train(fedavg, 1, full)
    assert all(np.array_equal(out.content["arrays"][k].numpy(), same.content["arrays"][k].numpy())
               for k in full)
    first = ctx.state[STATE]
    assert not np.allclose(first["fc2.weight"].numpy(), full["fc2.weight"].numpy())  # v trained
    assert not np.allclose(first["fc2.weight"].numpy(), out.content["arrays"]["fc2.weight"].numpy())
    ev = ditto.evaluate(sent(4, RecordDict({"arrays": out.content["arrays"],
                                            "config": ConfigRecord({"server-round": 1})})))
    mine = evaluate(load_record(make_model(cfg, train_set(cfg)), first), ditto.test_data, ditto.device)
    assert ev.content["metrics"]["accuracy"] == mine[1]
    assert ev.content["metrics"]["personal-model"] == 1.0
    untrained, _, _ = client("ditto")  # no v yet: scored with the received model, and says so
    ev = untrained.evaluate(sent(4, RecordDict({"arrays": full,
                                                "config": ConfigRecord({"server-round": 1})})))
    assert ev.content["metrics"]["personal-model"] == 0.0
    # round 2 trains v on from round 1's v, not from the new global model
    train(ditto, 2, out.content["arrays"])
    fresh, _, fresh_ctx = client("ditto")
    train(fresh, 2, out.content["arrays"])
    assert not np.allclose(ctx.state[STATE]["fc2.weight"].numpy(),
                           fresh_ctx.state[STATE]["fc2.weight"].numpy())


def client_with(method, **rc):
    cfg = Config.from_run_config({**SMALL, "method": method, **rc})
    ctx = Context(run_id=1, node_id=4, node_config={"partition-id": 2, "num-partitions": 5},
                  state=RecordDict(), run_config=cfg.to_run_config())
    return METHODS[method].client(cfg, ctx), cfg, ctx


def test_apfl_step_by_hand_and_its_upload_is_fedavgs():
    """One full-batch step: v <- v - lr alpha grad f(v_bar), alpha <- alpha - lr_a <v - w, grad f(v_bar)>
    with v_bar = alpha v + (1 - alpha) w and w before its own step; w's update is FedAvg's."""
    import torch
    from torch.func import functional_call
    from torch.nn import functional as F

    from flowerbed.clients.apfl import ALPHA, PERSONAL
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import load_record, to_record

    rc = {"batch-size": 1000, "momentum": 0.0, "weight-decay": 0.0, "apfl-alpha-lr": 0.5}
    apfl, cfg, ctx = client_with("apfl", **rc)
    fedavg, _, _ = client_with("fedavg", **rc)
    torch.manual_seed(1)
    w0, v0 = make_model(cfg, train_set(cfg)), make_model(cfg, train_set(cfg))
    ctx.state[PERSONAL], ctx.state[ALPHA] = to_record(v0), MetricRecord({"alpha": 0.3})
    msg = RecordDict({"arrays": to_record(w0), "config": ConfigRecord({"server-round": 1})})
    out, same = apfl.train(sent(4, msg)), fedavg.train(sent(4, msg))
    assert all(np.array_equal(out.content["arrays"][k].numpy(), same.content["arrays"][k].numpy())
               for k in out.content["arrays"])

    data = apfl.train_data
    mixed = {k: (0.3 * p + 0.7 * dict(w0.named_parameters())[k]).detach().requires_grad_()
             for k, p in v0.named_parameters()}
    F.cross_entropy(functional_call(v0, mixed, (data.normalise(data.x),)), data.y).backward()
    grads = {k: m.grad for k, m in mixed.items()}
    wp = dict(w0.named_parameters())
    dot = sum(float(((p - wp[k]) * grads[k]).sum().detach()) for k, p in v0.named_parameters())
    assert abs(dot) > 0.01 and 0 < 0.3 - 0.5 * dot < 1  # a real step, inside [0, 1]
    assert ctx.state[ALPHA]["alpha"] == pytest.approx(0.3 - 0.5 * dot, abs=1e-5)
    v1 = load_record(make_model(cfg, train_set(cfg)), ctx.state[PERSONAL])
    for k, p in v0.named_parameters():
        assert torch.allclose(v1.get_parameter(k), p - cfg.lr * 0.3 * grads[k], atol=1e-6), k


def test_apfl_alpha_turns_nan_not_0_when_its_gradient_does():
    """From a review: min(1, max(0, nan)) is 0, so a diverged personal model reported alpha 0."""
    import torch

    from flowerbed.clients.apfl import ALPHA, PERSONAL
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import to_record

    apfl, cfg, ctx = client_with("apfl")
    w, v = make_model(cfg, train_set(cfg)), make_model(cfg, train_set(cfg))
    with torch.no_grad():
        next(v.parameters()).fill_(float("nan"))
    ctx.state[PERSONAL], ctx.state[ALPHA] = to_record(v), MetricRecord({"alpha": 0.5})
    out = apfl.train(sent(4, RecordDict({"arrays": to_record(w),
                                         "config": ConfigRecord({"server-round": 1})})))
    assert np.isnan(out.content["metrics"]["alpha"])  # so the server refuses the reply, naming it
    assert all(np.isfinite(a.numpy()).all() for a in out.content["arrays"].values())  # w unharmed
    # from a review: v and alpha stayed NaN, so every later reply (and evaluation) was refused;
    # now both are dropped, and the next round starts them afresh
    assert PERSONAL not in ctx.state and ALPHA not in ctx.state
    ev = apfl.evaluate(sent(4, RecordDict({"arrays": to_record(w),
                                           "config": ConfigRecord({"server-round": 1})})))
    assert ev.content["metrics"]["personal-model"] == 0.0 and np.isfinite(ev.content["metrics"]["loss"])
    out = apfl.train(sent(4, RecordDict({"arrays": to_record(w),
                                         "config": ConfigRecord({"server-round": 2})})))
    assert np.isfinite(out.content["metrics"]["alpha"]) and PERSONAL in ctx.state


@pytest.mark.parametrize("method", ["ditto", "fedrep", "local", "fedsoft"])
def test_a_diverged_personal_model_is_dropped_not_kept(method, caplog):
    """From a review: a personal model (Ditto's v, FedRep's head, Local's and FedSoft's own
    model) that went NaN was filed and kept, so the client's replies were refused for the rest
    of the run; now it is dropped with a warning and the client starts it afresh."""

    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import to_record

    c, cfg, ctx = client_with(method)
    key = {"ditto": "ditto.personal", "fedrep": "fedrep.head", "local": "local.model",
           "fedsoft": "fedsoft.model"}[method]
    model = make_model(cfg, train_set(cfg))
    broken = {k: v for k, v in to_record(model).items() if method != "fedrep" or k.startswith("fc2.")}
    ctx.state[key] = type(to_record(model))({k: type(v)(np.full_like(v.numpy(), np.nan))
                                             for k, v in broken.items()})
    arrays = to_record(model)
    content = ({f"model.{k}": arrays for k in range(cfg.num_models)} if method == "fedsoft"
               else {"arrays": arrays})
    def message(rnd):
        return sent(4, RecordDict({**content, "config": ConfigRecord({"server-round": rnd})}))

    c.train(message(1))
    assert key not in ctx.state and f"its {key} diverged" in caplog.text
    assert c.evaluate(message(1)).content["metrics"]["personal-model"] == 0.0  # and says so
    c.train(message(2))
    assert key in ctx.state and all(np.isfinite(v.numpy()).all() for v in ctx.state[key].values())
    assert c.evaluate(message(2)).content["metrics"]["personal-model"] == 1.0


def test_apfl_scores_the_mixture_with_the_received_model():
    import torch

    from flowerbed.clients.apfl import ALPHA, PERSONAL
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import evaluate, to_record

    apfl, cfg, ctx = client_with("apfl")
    torch.manual_seed(2)
    w, v = make_model(cfg, train_set(cfg)), make_model(cfg, train_set(cfg))
    msg = RecordDict({"arrays": to_record(w), "config": ConfigRecord({"server-round": 1})})
    alone = apfl.evaluate(sent(4, msg)).content["metrics"]  # no v yet: w, and it says so
    assert alone["personal-model"] == 0.0
    assert alone["accuracy"] == evaluate(w, apfl.test_data, apfl.device)[1]
    ctx.state[PERSONAL], ctx.state[ALPHA] = to_record(v), MetricRecord({"alpha": 0.25})
    mixed = make_model(cfg, train_set(cfg))
    with torch.no_grad():
        for (k, p), q in zip(mixed.named_parameters(), v.parameters(), strict=True):
            p.copy_(0.25 * q + 0.75 * w.get_parameter(k))
    got = apfl.evaluate(sent(4, msg)).content["metrics"]
    assert got["personal-model"] == 1.0
    assert got["accuracy"] == evaluate(mixed, apfl.test_data, apfl.device)[1]


def test_proximal_term_pulls_towards_the_anchor_as_it_was():
    """FedProx's and Ditto's (mu/2)||w - a||^2: its gradient is mu (w - a), a fixed when made."""
    import torch

    from flowerbed.clients.fedavg import proximal

    model, anchor = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    term = proximal(anchor, 0.5)
    with torch.no_grad():
        anchor.weight.add_(10.0)  # later changes to the anchor do not move the target
    before = anchor.weight.detach() - 10.0
    term(model).backward()
    assert torch.allclose(model.weight.grad, 0.5 * (model.weight.detach() - before))


def test_fedfew_local_scores_need_their_sample_count():
    """fedfew-eval = local: a 'personal-accuracy' without a positive 'eval-examples' raised
    KeyError (or made the round's accuracy NaN) after the models had been updated."""
    cfg = Config.from_run_config({"method": "fedfew", "num-models": 1, "min-clients": 1,
                                  "fedfew-eval": "local"})
    s = FedFewStrategy(cfg)
    msgs = prepared(s, [100, 101, 102])
    s._models, s._reference = [rec(0.0)], rec(0.0)

    def content(**m):
        return RecordDict({"model.0": rec(1.0), "m": MetricRecord({"num-examples": 10,
                                                                   "losses": [0.5], **m})})

    scored = {"personal-accuracy": 0.5, "personal-loss": 1.0}
    reps = [reply(msgs[0], content(**scored, **{"eval-examples": 4})),
            reply(msgs[1], content(**scored)), reply(msgs[2], content(**scored, **{"eval-examples": 0}))]
    s.aggregate_train(1, reps)
    assert [f["partition"] for f in s.round.failed] == [1, 2]
    assert "needs a positive 'eval-examples'" in s.round.failed[0]["reason"]
    assert s.round.eval_metrics["accuracy"] == pytest.approx(0.5)


def test_fedrep_refuses_a_body_that_is_not_the_whole_body():
    """Each key is averaged over the replies that hold it with every reply's weight: a reply
    without a body key, or with the head, would average it with too little weight."""
    from flowerbed.strategies.fedrep import FedRepStrategy

    s = FedRepStrategy(Config.from_run_config({"method": "fedrep", "min-clients": 1}))
    msgs = prepared(s, [101, 102, 103, 104])
    layer = {"conv1.weight": (2, 2), "fc2.weight": (2, 2)}  # fc2: the head
    s._reference = ArrayRecord({k: Array(np.zeros(sh, np.float32)) for k, sh in layer.items()})

    def body(**arrs):
        return RecordDict({"arrays": ArrayRecord({k: Array(np.full((2, 2), v, np.float32))
                                                  for k, v in arrs.items()}),
                           "m": MetricRecord({"num-examples": 10})})

    reps = [reply(msgs[0], body(**{"conv1.weight": 1.0})),
            reply(msgs[1], body(**{"conv1.weight": 3.0, "fc2.weight": 5.0})),
            reply(msgs[2], body()), reply(msgs[3], body(**{"conv1.weight": 3.0}))]
    out, _ = s.aggregate_train(1, reps)
    assert np.allclose(out["conv1.weight"].numpy(), 2.0)  # partitions 0 and 3
    assert np.allclose(out["fc2.weight"].numpy(), 0.0)  # the server's head, untouched
    failed = {f["partition"]: f["reason"] for f in s.round.failed}
    assert "unexpected ['fc2.weight']" in failed[1] and "is empty" in failed[2]


@pytest.mark.parametrize("strategy", [FedFewStrategy, IFCAStrategy])
def test_fedfew_counts_the_clients_choices_instead_of_averaging_model_indices(strategy):
    """Found by a review: 'client-chosen-model' was the weighted mean of the indices (0.45);
    IFCA, whose clients choose the same way, kept the mean until a later walk-through."""
    cfg = Config.from_run_config({"method": "fedfew", "num-models": 3, "min-clients": 1})
    s = strategy(cfg)
    msgs = [sent(n, mtype="evaluate") for n in (100, 101, 102)]
    prepared(s, [100, 101, 102])
    s._sent = msgs
    reps = [reply(m, RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 0.5,
                                                    "chosen-model": k})}))
            for m, k in zip(msgs, (0, 2, 2), strict=True)]
    metrics = s.aggregate_evaluate(1, reps)
    assert "chosen-model" not in metrics
    assert [metrics[f"model-{k}-chosen"] for k in range(3)] == [1, 0, 2]
    assert s.round.eval_metrics["model-2-chosen"] == 2


def test_fedrep_sends_the_head_only_to_a_client_without_its_own():
    """The head travels down until the client's training reply shows it filed its own; a client
    that replies with an error (its state may be lost) gets the whole model again."""
    from flowerbed.strategies.base import record_bytes
    from flowerbed.strategies.fedrep import FedRepStrategy
    from tests.conftest import FakeGrid, error_reply

    s = FedRepStrategy(Config.from_run_config({"method": "fedrep", "min-clients": 1}))
    nodes = [101, 102, 103]
    prepared(s, nodes)
    layer = {"conv1.weight": (4, 4), "fc2.weight": (2, 2)}  # fc2: the head
    model = ArrayRecord({k: Array(np.zeros(sh, np.float32)) for k, sh in layer.items()})

    def sent_keys(msgs):
        return {m.metadata.dst_node_id: set(m.content["arrays"]) for m in msgs}

    def configure(rnd):
        return train_messages(s, rnd, model, FakeGrid(nodes))

    msgs = configure(1)
    assert all(k == set(layer) for k in sent_keys(msgs).values())
    body = RecordDict({"arrays": ArrayRecord({"conv1.weight": Array(np.ones((4, 4), np.float32))}),
                       "m": MetricRecord({"num-examples": 10})})
    s.aggregate_train(1, [reply(msgs[0], body), reply(msgs[1], body), error_reply(msgs[2])])
    msgs = configure(2)
    assert sent_keys(msgs) == {101: {"conv1.weight"}, 102: {"conv1.weight"}, 103: set(layer)}
    assert s.round.bytes_down == sum(record_bytes(m.content) for m in msgs)
    assert record_bytes(msgs[0].content) < record_bytes(msgs[2].content)
    s._sent = [sent(101, mtype="evaluate")]
    s.aggregate_evaluate(2, [error_reply(s._sent[0])])
    evals = list(s.configure_evaluate(2, model, ConfigRecord(), FakeGrid(nodes)))
    assert sent_keys(evals) == {101: set(layer), 102: {"conv1.weight"}, 103: set(layer)}
    # found by a review: a new node serving partition 1 has none of the old node's state
    nodes[1] = 202
    s.discover(FakeGrid([101, 103]))  # node 102 leaves ...
    s.node_of[1], s.partition_of[202] = 202, 1  # ... and 202 takes over its partition
    evals = list(s.configure_evaluate(3, model, ConfigRecord(), FakeGrid(nodes)))
    assert sent_keys(evals)[202] == set(layer)


def test_a_client_without_its_personal_layers_says_so():
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.training import to_record

    c, cfg, ctx = client("fedrep")
    full = to_record(make_model(cfg, train_set(cfg)))
    body = ArrayRecord({k: v for k, v in full.items() if not k.startswith("fc2.")})
    msg = RecordDict({"arrays": body, "config": ConfigRecord({"server-round": 1})})
    with pytest.raises(RuntimeError, match="partition 2: the message has no fc2.weight, fc2.bias "
                                           "and this client holds none of its own"):
        c.train(sent(4, msg))
    c.train(sent(4, RecordDict({"arrays": full, "config": ConfigRecord({"server-round": 1})})))
    head = ctx.state["fedrep.head"]["fc2.weight"].numpy()
    out = c.evaluate(sent(4, msg, mtype="evaluate"))  # the body alone: its own head in place
    model = c.personal_model(sent(4, msg))
    assert np.allclose(model.state_dict()["fc2.weight"].numpy(), head)
    assert 0 <= out.content["metrics"]["accuracy"] <= 1


def test_scaffold_client_refuses_a_control_variate_of_another_shape():
    """A (1,)-shaped c would have been added to every gradient element by broadcasting."""
    from flowerbed.clients.base import make_model
    from flowerbed.datasets.federated import train_set
    from flowerbed.strategies.scaffold import SERVER_CV
    from flowerbed.training import to_record

    c, cfg, _ = client("scaffold")
    model = to_record(make_model(cfg, train_set(cfg)))
    cv = ArrayRecord({"fc2.weight": Array(np.full(1, 0.5, np.float32))})
    with pytest.raises(ValueError, match=r"control variate 'fc2.weight' has shape \(1,\)"):
        c.train(sent(4, RecordDict({"arrays": model, SERVER_CV: cv,
                                    "config": ConfigRecord({"server-round": 1})})))


def test_scaffold_client_adopts_its_c_i_only_once_the_server_took_its_delta(caplog):
    """Regression: a client used to keep its new c_i even when the server refused the reply
    (timeout, validation), so c drifted from the mean of the c_i."""
    from flowerbed.clients.base import make_model
    from flowerbed.clients.scaffold import PENDING, STATE_KEY
    from flowerbed.datasets.federated import train_set
    from flowerbed.strategies.scaffold import ACCEPTED
    from flowerbed.training import to_record

    c, cfg, ctx = client("scaffold")
    fresh, _, fresh_ctx = client("scaffold")
    model = to_record(make_model(cfg, train_set(cfg)))

    def train(cl, rnd, accepted):
        return cl.train(sent(4, RecordDict({"arrays": model, ACCEPTED: ConfigRecord(accepted),
                                            "config": ConfigRecord({"server-round": rnd})})))

    def bias(ctx_, key):
        return ctx_.state[key]["fc2.bias"].numpy().copy()

    train(c, 1, {})
    assert STATE_KEY not in ctx.state and PENDING in ctx.state  # c_i+ waits for the server
    train(c, 2, {"2": 0})  # round 1's reply was refused: c_i stays 0 ...
    assert STATE_KEY not in ctx.state
    train(fresh, 2, {})  # ... so round 2 trains as a client that never had a c_i
    assert np.array_equal(bias(ctx, PENDING), bias(fresh_ctx, PENDING))
    second = bias(ctx, PENDING)
    train(c, 3, {"2": 2})  # round 2's delta was taken: its c_i+ is adopted
    assert np.array_equal(bias(ctx, STATE_KEY), second)
    # a client that lost its state while the server holds its partition's contribution says so
    # (from a review: c then counts that contribution twice, silently)
    lost, _, _ = client("scaffold")
    train(lost, 4, {"2": 3})
    assert "took this partition's control variate in round 3" in caplog.text
    assert caplog.text.count("took this partition's") == 1  # (not the client that holds its c_i)


def test_fedfew_reports_the_last_local_epochs_loss():
    """L_ik is the mean loss of the last local epoch (papers.md §5.7, 2), not of all epochs."""
    import copy

    from flowerbed.clients.base import make_model
    from flowerbed.training import seeded_generator, to_record, train_epochs

    _, cfg, ctx = client("fedfew")
    cfg = cfg.replace(local_epochs=2)
    c = METHODS["fedfew"].client(cfg, ctx)
    model = make_model(cfg, c.train_data)
    out = c.train(sent(4, RecordDict({"model.0": to_record(model),
                                      "config": ConfigRecord({"server-round": 1})})))

    def mean_loss(last):  # model 0 of round 1 trained again, the same way
        return train_epochs(copy.deepcopy(model), c.train_data, epochs=2, batch_size=cfg.batch_size,
                            lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                            device=c.device, generator=seeded_generator(cfg.seed, 2, 1, 0),
                            last_epoch=last)[0]

    last, both = mean_loss(True), mean_loss(False)
    assert last < both
    assert out.content["metrics"]["losses"][0] == pytest.approx(last, rel=1e-6)


# ------------------------------------------------ found by a mutation review (session 37)


def test_fedfew_train_loss_is_the_weighted_best_model_loss():
    """F1: FedFew's reported train-loss is sum_i n_i min_k L_ik / sum_i n_i."""
    from flowerbed.strategies.fedfew import FedFewStrategy

    cfg = Config.from_run_config({"method": "fedfew", "num-models": 2, "min-clients": 1})
    s = FedFewStrategy(cfg)
    msgs = prepared(s, [100, 101])
    s._models, s._reference = [rec(0.0), rec(1.0)], rec(0.0)
    losses, n = [[0.2, 1.0], [1.5, 0.3]], [30, 10]
    reps = [reply(msgs[i], RecordDict({"model.0": rec(1.0), "model.1": rec(1.0),
                                       "m": MetricRecord({"num-examples": n[i], "losses": losses[i]})}))
            for i in range(2)]
    _, metrics = s.aggregate_train(1, reps)
    assert metrics["train-loss"] == pytest.approx((30 * 0.2 + 10 * 0.3) / 40)


def test_fedfew_local_accuracy_is_weighted_by_eval_examples():
    """F2: fedfew-eval=local pools the clients' scores weighted by their local test sizes."""
    from flowerbed.strategies.fedfew import FedFewStrategy

    cfg = Config.from_run_config({"method": "fedfew", "num-models": 1, "min-clients": 1,
                                  "fedfew-eval": "local"})
    s = FedFewStrategy(cfg)
    msgs = prepared(s, [100, 101])
    s._models, s._reference = [rec(0.0)], rec(0.0)

    def c(acc, loss, ne):
        return RecordDict({"model.0": rec(1.0), "m": MetricRecord({
            "num-examples": 10, "losses": [0.5], "personal-accuracy": acc, "personal-loss": loss,
            "eval-examples": ne})})

    s.aggregate_train(1, [reply(msgs[0], c(1.0, 0.0, 1)), reply(msgs[1], c(0.0, 2.0, 3))])
    assert s.round.eval_metrics["accuracy"] == pytest.approx(0.25)
    assert s.round.eval_metrics["loss"] == pytest.approx(1.5)


def test_multi_model_client_picks_the_lowest_training_loss(monkeypatch):
    """F4: IFCA's cluster (and FedFew's served model) is the model with the LOWEST loss."""
    import flowerbed.clients.fedfew as ff

    losses = {"a": 2.0, "b": 0.5, "c": 1.0}
    monkeypatch.setattr(ff, "evaluate", lambda m, data, device: (losses[m], 0.0))
    k, got = ff.MultiModelClient.best_model(SimpleNamespace(train_data=None, device=None),
                                            ["a", "b", "c"])
    assert k == 1 and got == [2.0, 0.5, 1.0]
    # a diverged model's NaN loss ranks last wherever it sits (min() took a NaN in first place)
    for losses in ({"a": float("nan"), "b": 0.5, "c": 1.0}, {"a": 2.0, "b": float("nan"), "c": 1.0}):
        k, _ = ff.MultiModelClient.best_model(SimpleNamespace(train_data=None, device=None),
                                              ["a", "b", "c"])
        assert k == (1 if losses["b"] == 0.5 else 2)


@pytest.mark.parametrize("strategy", [FedFewStrategy, IFCAStrategy])
def test_more_models_than_clients_is_warned(strategy, caplog):
    cfg = Config.from_run_config({"method": "fedfew", "num-models": 5, "local-test-fraction": 0.25})
    strategy(cfg).check_setup(3)
    assert "num-models=5 is more than the 3 clients: at least 2 models can serve no client" in caplog.text
    if strategy is FedFewStrategy:  # said once under the launchers: by the up-front check
        from flowerbed import cli  # where the ServerApp's stream goes to a log (compare)

        rc = {**cfg.to_run_config(), "train-samples": 600}
        caplog.clear()
        cli.preflight(rc, 3, 0.0)
        assert "num-models=5 is more than" in caplog.text
        caplog.clear()
        cli.preflight(rc, 3, 0.0, warn=False)  # by the ServerApp where it reaches the console (run)
        assert "num-models" not in caplog.text
        logging.getLogger("flowerbed").warning("still on")
        assert "still on" in caplog.text
        logging.disable(logging.INFO)  # a caller's own setting survives the check
        try:
            cli.preflight(rc, 3, 0.0, warn=False)
            assert logging.root.manager.disable == logging.INFO
        finally:
            logging.disable(logging.NOTSET)


def test_feddyn_client_regulariser_and_its_state_by_hand():
    """Round 1 (grad L_k = 0) trains as FedProx with mu = alpha; the new grad L_k =
    -alpha (theta_k - theta_s) waits for the server; adopted once taken, it enters the loss."""
    from flowerbed.clients.base import make_model
    from flowerbed.clients.feddyn import STATE_KEY
    from flowerbed.datasets.federated import train_set
    from flowerbed.strategies.synced import ACCEPTED
    from flowerbed.training import to_record

    c, cfg, ctx = client_with("feddyn", **{"feddyn-alpha": 0.5})
    prox, _, _ = client_with("fedprox", **{"proximal-mu": 0.5})
    net = make_model(cfg, train_set(cfg))
    start, params = to_record(net), [k for k, _ in net.named_parameters()]

    def train(cl, rnd, accepted, **extra):
        return cl.train(sent(4, RecordDict({"arrays": start, ACCEPTED: ConfigRecord(accepted),
                                            "config": ConfigRecord({"server-round": rnd, **extra})})))

    first = train(c, 1, {})
    same = train(prox, 1, {}, **{"proximal-mu": 0.5})
    assert all(np.array_equal(first.content["arrays"][k].numpy(), same.content["arrays"][k].numpy())
               for k in start)
    grad = {k: -0.5 * (first.content["arrays"][k].numpy() - start[k].numpy()) for k in params}
    assert STATE_KEY not in ctx.state and set(ctx.state[f"{STATE_KEY}-pending"]) == set(grad)
    assert all(np.allclose(ctx.state[f"{STATE_KEY}-pending"][k].numpy(), g) for k, g in grad.items())
    second = train(c, 2, {"2": 1})  # taken: adopted, and the linear term changes the update
    assert all(np.allclose(ctx.state[STATE_KEY][k].numpy(), g) for k, g in grad.items())
    again = train(prox, 2, {}, **{"proximal-mu": 0.5})
    assert not np.allclose(second.content["arrays"]["fc2.weight"].numpy(),
                           again.content["arrays"]["fc2.weight"].numpy())


def test_fedamp_attention_by_hand_and_its_bound():
    from flowerbed.config import ConfigError
    from flowerbed.strategies.fedamp import FedAMPStrategy, attention, squared_distances

    flat = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    d = squared_distances(flat)
    assert np.allclose(d, [[0, 1, 4], [1, 0, 5], [4, 5, 0]])
    xi = attention(d, 0.2, 2.0)
    a = lambda x: 0.2 * np.exp(-x / 2.0) / 2.0  # noqa: E731  (alpha_k A'(x))
    assert np.allclose(xi[0], [1 - a(1) - a(4), a(1), a(4)]) and np.allclose(xi.sum(1), 1.0)
    assert (np.diag(xi) >= 0).all()
    cfg = Config.from_run_config({**SMALL, "method": "fedamp", "fedamp-alpha": 0.5, "fedamp-sigma": 1.0})
    FedAMPStrategy(cfg).check_setup(3)  # 0.5 * 2 <= 1
    with pytest.raises(ConfigError, match="fedamp-alpha.*<= 0.25"):
        FedAMPStrategy(cfg).check_setup(5)


def test_fedamp_sends_each_client_its_cloud_model_and_scores_its_own():
    """Training: client i gets u_i = sum_j xi_ij w_j (a client the server holds no model of: the
    round's model) and proximal-mu = lambda/alpha_k; evaluation: its own uploaded w_i."""
    from flowerbed.strategies.fedamp import FedAMPStrategy, attention, squared_distances
    from tests.conftest import FakeGrid

    cfg = Config.from_run_config({**SMALL, "method": "fedamp", "fedamp-alpha": 0.2, "fedamp-sigma": 2.0,
                                  "fedamp-lambda": 0.1, "min-clients": 1})
    s = FedAMPStrategy(cfg)
    msgs = prepared(s, [101, 102, 103])
    s._reference = rec(0.0)
    s._sent = msgs[:2]
    s.aggregate_train(1, [reply(msgs[0], RecordDict({"arrays": rec(1.0), "metrics": MetricRecord(
        {"num-examples": 1})})), reply(msgs[1], RecordDict({"arrays": rec(3.0), "metrics": MetricRecord(
            {"num-examples": 3})}))])
    out = list(s.configure_train(2, rec(2.5), ConfigRecord(), FakeGrid([101, 102, 103])))
    xi = attention(squared_distances(np.array([np.full(4, 1.0), np.full(4, 3.0)])), 0.2, 2.0)
    got = [m.content["arrays"]["w"].numpy() for m in out]
    assert np.allclose(got[0], xi[0, 0] * 1.0 + xi[0, 1] * 3.0)
    assert np.allclose(got[1], xi[1, 0] * 1.0 + xi[1, 1] * 3.0)
    assert np.allclose(got[2], 2.5)  # partition 2: no model held yet
    assert out[0].content["config"]["proximal-mu"] == pytest.approx(0.5)
    evals = list(s.configure_evaluate(2, rec(2.5), ConfigRecord(), FakeGrid([101, 102, 103])))
    assert [float(m.content["arrays"]["w"].numpy()[0, 0]) for m in evals] == [1.0, 3.0, 2.5]


def test_fedamp_distances_cover_parameters_and_buffers_are_mixed_in_their_dtype():
    from torch import nn

    from flowerbed.strategies.fedamp import FedAMPStrategy, attention
    from tests.conftest import FakeGrid

    cfg = Config.from_run_config({**SMALL, "method": "fedamp", "fedamp-alpha": 0.2, "fedamp-sigma": 2.0,
                                  "min-clients": 1})
    s = FedAMPStrategy(cfg)
    s.model = nn.BatchNorm1d(2)  # parameters weight, bias; buffers running_*, num_batches_tracked

    def bn(v: float, mean: float, n: int) -> ArrayRecord:
        return ArrayRecord({"weight": Array(np.full(2, v, np.float32)),
                            "bias": Array(np.zeros(2, np.float32)),
                            "running_mean": Array(np.full(2, mean, np.float32)),
                            "running_var": Array(np.ones(2, np.float32)),
                            "num_batches_tracked": Array(np.array(n, np.int64))})

    prepared(s, [101, 102])
    s.personal = {"0": bn(0.0, 100.0, 3), "1": bn(1.0, -100.0, 8)}  # buffers far apart, weights not
    out = list(s.configure_train(2, bn(0.0, 0.0, 0), ConfigRecord(), FakeGrid([101, 102])))
    xi = attention(np.array([[0.0, 2.0], [2.0, 0.0]]), 0.2, 2.0)  # d = 2 over weight (2 x 1.0^2)
    u0 = out[0].content["arrays"]
    assert list(u0) == list(bn(0.0, 0.0, 0))  # the model's key order
    assert np.allclose(u0["weight"].numpy(), xi[0, 1] * 1.0)
    assert np.allclose(u0["running_mean"].numpy(), xi[0, 0] * 100.0 - xi[0, 1] * 100.0, rtol=1e-5)
    n = u0["num_batches_tracked"].numpy()
    assert n.dtype == np.int64 and n == round(xi[0, 0] * 3 + xi[0, 1] * 8)
