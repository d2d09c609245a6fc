"""Fed-ADE: schedules, the Markov chain, the estimators, learning-rate bounds, BBSE."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Context, RecordDict
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.fedade import bbse_weights, lr_from
from flowerbed.config import Config, ConfigError, parse_partition
from flowerbed.datasets.streams import client_batch, client_weight, corrupt, schedule, severity
from flowerbed.registry import METHODS
from tests.conftest import StreamClient, sent


def test_schedules_at_known_steps():
    lin = schedule("lin", 11)
    assert lin[0] == 0 and lin[5] == pytest.approx(0.5) and lin[10] == 1
    # half a period of sin comes out as 0.5000000000000001: level 3, not 4
    assert [severity(w) for w in schedule("sin", 20)[:4]] == [3, 5, 3, 1]
    sin = schedule("sin", 101)  # T' = 100, L = 10
    assert sin[0] == pytest.approx(0.5) and sin[10] == pytest.approx(0.5)
    assert sin[int(10 / 4)] == pytest.approx(0.5 * (1 + math.sin(2 * math.pi * 2 / 10)))
    squ = schedule("squ", 100)  # T' = 99, L = 9: 0/1 alternating every 4 steps
    assert squ[:12].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert severity(0.0) == 1 and severity(0.5) == 3 and severity(1.0) == 5


def test_ber_is_a_markov_chain_with_the_flip_rate():
    w = schedule("ber", 20000, seed=3)
    assert set(np.unique(w)) == {0.0, 1.0} and w[0] == 0
    assert np.mean(w[1:] != w[:-1]) == pytest.approx(0.1, abs=0.01)
    assert np.array_equal(w, schedule("ber", 20000, seed=3))  # the same chain on every call
    fast = schedule("ber", 20000, seed=3, flip_p=0.5)
    assert np.mean(fast[1:] != fast[:-1]) == pytest.approx(0.5, abs=0.02)


def test_ber_chain_per_client():
    """fedade-ber-chain='client': each client its own reproducible chain; 'shared': one for all."""
    mine = [schedule("ber", 200, seed=0, chain=c) for c in range(3)]
    assert not np.array_equal(mine[0], mine[1]) and not np.array_equal(mine[1], mine[2])
    assert not np.array_equal(mine[0], schedule("ber", 200, seed=0))  # client 0 is not the shared one
    assert np.array_equal(mine[1], schedule("ber", 200, seed=0, chain=1))
    base = {"fedade-schedule": "ber", "fedade-rounds-per-step": 1, "num-server-rounds": 200}
    for scope in ("shared", "client"):
        cfg = Config.from_run_config({**base, "fedade-ber-chain": scope})
        ws = [[client_weight(cfg, c, t) for t in range(200)] for c in range(3)]
        assert (ws[0] == ws[1] == ws[2]) == (scope == "shared")
        assert ws[1] == schedule("ber", 200, 0, 0.1, 1 if scope == "client" else None).tolist()


def test_learning_rate_bounds():
    assert lr_from(0.0, 1e-5, 1e-3) == 1e-5 and lr_from(1.0, 1e-5, 1e-3) == 1e-3
    assert lr_from(7.0, 1e-5, 1e-3) == 1e-3 and lr_from(-1.0, 1e-5, 1e-3) == 1e-5
    assert lr_from(0.5, 0.0, 1.0) == pytest.approx(0.5)
    assert lr_from(float("nan"), 1e-5, 1e-3) == 1e-5  # a NaN S (a diverged model): eta_min, not NaN


def test_bbse_recovers_a_known_label_shift():
    rng = np.random.default_rng(0)
    c = 4
    cond = np.full((c, c), 0.1) + np.eye(c) * 0.6  # P(ŷ | y): 70 % correct
    q0 = np.full(c, 1 / c)
    conf = cond * q0  # M[ŷ, y] = P(ŷ | y) q0_y
    q_true = np.array([0.6, 0.2, 0.15, 0.05])
    ys = rng.choice(c, size=200000, p=q_true)
    preds = np.array([rng.choice(c, p=cond[:, y]) for y in ys[:20000]])
    freq = np.bincount(preds, minlength=c) / len(preds)
    w = bbse_weights(conf, freq)
    assert w * q0 == pytest.approx(q_true, abs=0.02)


SMALL = {"method": "fedade", "train-samples": 2000, "num-server-rounds": 4,
         "fedade-rounds-per-step": 2, "fedade-batch": 20, "partition": "dirichlet:0.5",
         "fedade-pretrain-epochs": 1, "min-partition-size": 6}


def test_streams_are_deterministic_and_shift():
    cfg = Config.from_run_config(SMALL)
    x1, y1 = client_batch(cfg, 1, 3, 0)
    x2, y2 = client_batch(cfg, 1, 3, 0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (20, 1, 28, 28)
    cov = Config.from_run_config({**SMALL, "fedade-shift": "covariate"})
    xa, _ = client_batch(cov, 0, 3, 0)
    assert xa.dtype == torch.uint8
    x = torch.full((2, 1, 28, 28), 128, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    assert (corrupt(x, "gaussian_noise", 5, g).float() - 128).abs().mean() > (
        corrupt(x, "gaussian_noise", 1, g).float() - 128).abs().mean()


def test_estimators_on_constructed_inputs():
    cfg = Config.from_run_config(SMALL)
    ctx = Context(run_id=1, node_id=2, node_config={"partition-id": 0, "num-partitions": 3},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS["fedade"].client(cfg, ctx)
    model = client.new_model()
    x = torch.randn(16, 1, 28, 28)
    assert client.shift(model, x, 0) == (0.0, 0.0)  # first sight
    s_unc, s_rep = client.shift(model, x, 1)  # the same batch one step later: no shift
    assert s_unc == pytest.approx(0.0, abs=1e-9) and s_rep == pytest.approx(0.0, abs=1e-9)
    s_unc, s_rep = client.shift(model, -5 * x.abs(), 2)  # a very different batch
    assert 0 < s_unc <= 1 and 0 < s_rep <= 1
    # later rounds of step 2 reuse step 2's estimate (S^t compares steps, not rounds)
    assert client.shift(model, -5 * x.abs(), 2) == (s_unc, s_rep)
    assert client.shift(model, x, 2) == (s_unc, s_rep)
    # its first log line names the stream it adapts on, not the seeded split it never trains on
    assert client.data_line() == (f"an unlabelled {cfg.fedade_shift}-shift stream ({cfg.fedade_schedule}) "
                                  f"of {cfg.num_server_rounds // cfg.fedade_rounds_per_step} time "
                                  f"steps x {cfg.fedade_batch} samples from the post-deployment pool")


@pytest.mark.parametrize("extra", [{}, {"fedade-risk": "bbse"}, {"fedade-lr-mode": "none"},
                                   {"fedade-sync": False, "fedade-unc": "hist", "fedade-rep-ref": "ema"},
                                   {"fedade-pixels": "raw", "fedade-risk": "bbse"}])
def test_client_round_uploads_shared_layers_only(extra):
    from flowerbed.clients.fedade import BLACK_BOX

    cfg = Config.from_run_config({**SMALL, **extra})
    run = StreamClient(cfg.to_run_config())
    out, ctx = run.train(1), run.ctx
    assert not any(k.startswith(("fc1.", "fc2.")) for k in out.content["arrays"])
    assert set(ctx.state["fedade.personal"]) >= {"fc1.weight", "fc2.weight"}
    # BBSE's fixed classifier (the pre-trained model) comes with the first message and stays
    bbse = cfg.fedade_risk == "bbse"
    assert (BLACK_BOX in run.message(1).content) == bbse and (BLACK_BOX in ctx.state) == bbse
    m = out.content["metrics"]
    assert m["pre-n"] == 20 and (m["lr"] == 0 if extra.get("fedade-lr-mode") == "none"
                                 else cfg.fedade_lr_min <= m["lr"] <= cfg.fedade_lr_max)


@pytest.mark.parametrize("sync", [True, False])
def test_local_only_adaptation_shares_nothing(sync):
    """fedade-sync=false: the server keeps sending the pre-trained model, so a client that has
    not adapted yet does not receive the others' adapted shared layers."""
    from tests.conftest import reply

    cfg = Config.from_run_config({**SMALL, "fedade-sync": sync, "min-clients": 1,
                                  "fedade-lr-mode": "fixed", "fedade-fixed-lr": 0.1})
    run = StreamClient(cfg.to_run_config())
    strategy, arrays, client = run.strategy, run.arrays, run.client
    msg = sent(2, strategy.train_content(1, arrays, ConfigRecord({"server-round": 1})))
    strategy.node_of[1], strategy.partition_of[2], strategy.num_partitions = 2, 1, 3
    strategy._sent, strategy._reference = [msg], arrays
    upload = client.train(msg).content
    out, _ = strategy.aggregate_train(1, [reply(msg, upload)])
    key = next(iter(upload["arrays"]))  # a shared layer
    adapted = np.allclose(out[key].numpy(), upload["arrays"][key].numpy())
    assert adapted == sync
    assert np.allclose(out[key].numpy(), arrays[key].numpy()) != sync


def test_online_accuracy_does_not_need_a_local_test_split(tmp_path):
    """Fed-ADE's clients score their stream batch; with local-test-fraction=0 no client was
    asked to evaluate (as if it had no local test split): no online accuracy at all."""
    from inprocess import run_inprocess

    from flowerbed.config import ConfigError

    rc = {**SMALL, "local-test-fraction": 0.0, "num-server-rounds": 2, "output-dir": str(tmp_path),
          "run-name": "no-split", "client-state-dir": str(tmp_path / "state")}
    summary = run_inprocess(rc, 3)
    assert summary["final-accuracy"] is not None and summary["mean-accuracy"] is not None
    with pytest.raises(ConfigError, match="'fraction-evaluate'.*fedade is scored by its clients"):
        Config.from_run_config({**SMALL, "fraction-evaluate": 0.0})


def test_predict_then_update_scores_the_next_batch_before_adapting():
    """A step's evaluation also predicts the next step's batch with the model the client starts
    that step with; the server records it, pooled, in the next step's first round."""
    from tests.conftest import reply

    cfg = Config.from_run_config({**SMALL, "fedade-lr-mode": "none", "min-clients": 1})
    run = StreamClient(cfg.to_run_config())
    strategy, arrays, client = run.strategy, run.arrays, run.client

    def evaluate(step):
        content = strategy.eval_content(arrays)
        content["config"] = ConfigRecord({"server-round": 2 * step + 2, "fedade-step": step})
        return sent(2, content, "evaluate")

    msg0 = evaluate(0)
    m0 = client.evaluate(msg0).content["metrics"]
    m1 = client.evaluate(evaluate(1)).content["metrics"]
    # without adaptation the model does not change: step 1's prediction made at step 0's end
    # is step 1's online accuracy
    assert m0["next-correct"] == round(m1["accuracy"] * m1["num-examples"])
    assert m0["next-n"] == m1["num-examples"] and "next-n" not in m1  # 2 steps: no step 2
    strategy.node_of[1], strategy.partition_of[2], strategy.num_partitions = 2, 1, 3
    strategy._sent = [msg0]
    strategy.aggregate_evaluate(2, [reply(msg0, client.evaluate(msg0).content)])
    assert "next-correct" not in strategy.round.eval_metrics
    assert strategy._next_pre == m0["next-correct"] / m0["next-n"]


def test_raw_pixels_reach_the_model_and_pretrain_apart(tmp_path, monkeypatch):
    """fedade-pixels='raw': the model sees 0-255 floats (the official CIFAR code's input) in
    pre-training, streams and BBSE's reference set, from a pre-trained model of its own."""
    from flowerbed import pretrain

    monkeypatch.setenv("FLOWERBED_CACHE", str(tmp_path))
    raw = Config.from_run_config({**SMALL, "fedade-pixels": "raw"})
    std = Config.from_run_config(SMALL)
    pre, held, post = pretrain.pools(raw)
    assert {pre.pixels, held.pixels, post.pixels} == {"raw"}
    assert post.subset([0, 1]).pixels == "raw" and post.without_labels().pixels == "raw"
    x, _ = client_batch(raw, 0, 3, 0)
    assert torch.equal(post.normalise(x), x.float()) and float(x.max()) > 1
    assert pretrain.pools(std)[2].normalise(x).abs().max() < 5  # standardised
    pretrain.pretrained(raw)
    pretrain.pretrained(std)
    assert len(list((tmp_path / "pretrained").glob("*.pt"))) == 2  # one model per input scale


def test_prediction_counts_are_checked_before_they_are_pooled():
    """A reply with 'pre-n' but no 'pre-correct' raised KeyError after aggregation, and clients
    that made no predictions divided by zero."""
    from flowerbed.strategies.fedade import counts_problem, pooled

    assert counts_problem({"num-examples": 5}) is None
    assert counts_problem({"pre-n": 10, "pre-correct": 7, "next-n": 0, "next-correct": 0}) is None
    assert "'pre-correct' (None)" in counts_problem({"pre-n": 10})
    assert "need 0 <= correct <= n" in counts_problem({"next-n": 3, "next-correct": 5})
    assert pooled([{"train-pre-n": 0, "train-pre-correct": 0}], "train-pre") is None
    assert pooled([{"train-pre-n": 4, "train-pre-correct": 1}, {"x": 1}], "train-pre") == 0.25


def test_an_impossible_target_split_is_named_before_round_1():
    """The label-shift targets split the post-deployment pool (20 % of the training set): too
    small for the clients, it used to fail in every client at its first stream step, with a
    hint to lower min-partition-size, which does not apply to it."""
    from flowerbed.config import ConfigError
    from flowerbed.strategies.fedade import FedADEStrategy

    cfg = Config.from_run_config({"method": "fedade", "train-samples": 1500, "partition": "dirichlet:0.1",
                                  "min-partition-size": 1, "num-server-rounds": 4})
    with pytest.raises(ConfigError, match=r"post-deployment pool \(300 samples.*over 60 clients"):
        FedADEStrategy(cfg).check_setup(60)
    FedADEStrategy(cfg).check_setup(2)  # possible: no error


def test_a_dirichlet_target_split_is_redrawn_until_every_client_has_its_minimum():
    """From a review: flwr-datasets gives up after 10 draws, and the paper's setting (100 CIFAR-10
    clients, alpha 0.1) succeeds about once in 400, so its preset could never start; the
    official code redraws until it succeeds. The first draw stays the run's own seed's."""
    from flowerbed.datasets.partition import partition_indices
    from flowerbed.datasets.streams import TARGET_MIN_SIZE, target_partitions
    from flowerbed.pretrain import pools

    cfg = Config.from_run_config({"method": "fedade", "train-samples": 1500, "partition": "dirichlet:0.1",
                                  "min-partition-size": 1, "num-server-rounds": 4})
    labels = pools(cfg)[2].y.numpy()
    with pytest.raises(ConfigError, match="max number of attempts"):  # flwr-datasets' 10 draws
        partition_indices(labels, cfg.partition, 20, cfg.seed, min_partition_size=TARGET_MIN_SIZE)
    parts = target_partitions(cfg, 20)
    assert min(len(p) for p in parts) >= TARGET_MIN_SIZE and sum(map(len, parts)) == len(labels)
    assert [p.tolist() for p in target_partitions(cfg.replace(partition=parse_partition("dirichlet:5")), 3)] \
        == [p.tolist() for p in partition_indices(labels, parse_partition("dirichlet:5"), 3, cfg.seed,
                                                   min_partition_size=TARGET_MIN_SIZE)]


def test_a_batch_beyond_the_pool_and_streams_that_never_shift_are_named(caplog):
    """From a bad-input audit: a label-shift fedade-batch of 2**31 passed and ran out of memory
    in the clients; a run of one time step (or fedade-ber-p=0) finished without a word, its
    learning rate never moving from fedade-lr-min, as its stream never left the pre-training mix."""
    from flowerbed.config import ConfigError
    from flowerbed.strategies.fedade import FedADEStrategy

    base = {"method": "fedade", "train-samples": 1500, "num-server-rounds": 4}
    with pytest.raises(ConfigError, match=r"'fedade-batch' = 301 .*at most the 300 samples"):
        FedADEStrategy(Config.from_run_config({**base, "fedade-batch": 301})).check_setup(2)
    FedADEStrategy(Config.from_run_config(base)).check_setup(2)  # lin over 2 steps: shifts
    assert "never shift" not in caplog.text
    FedADEStrategy(Config.from_run_config({**base, "num-server-rounds": 2})).check_setup(2)
    assert "never shift (w = 0 at every step: a single time step)" in caplog.text
    caplog.clear()
    FedADEStrategy(Config.from_run_config({**base, "fedade-schedule": "ber", "fedade-ber-p": 0.0,
                                           "fedade-shift": "covariate"})).check_setup(2)
    assert "fedade-ber-p=0: no chain flips in 2 steps" in caplog.text
    assert "corruption at its lowest severity (1)" in caplog.text


def test_pretraining_cache_is_keyed_by_the_pool_itself():
    """Regression: the key held the pool's size, and train-samples 9999 and 10000 give pools of
    7200 samples with 1234 other images: the second run reused a model trained on the first's
    pool, some of which was in its own post-deployment stream."""
    from flowerbed.pretrain import cache_path, pools

    a, b = (Config.from_run_config({"method": "fedade", "train-samples": n,
                                                     "num-server-rounds": 4}) for n in (9999, 10000))
    (pa, _, _), (pb, _, _) = pools(a), pools(b)
    assert len(pa) == len(pb) and cache_path(a, pa) != cache_path(b, pb)
    assert cache_path(a, pa) == cache_path(a, pools(a)[0])


# ------------------------------------------------ found by a mutation review (session 37)


def _ade_cfg(**extra):
    return Config.from_run_config({"method": "fedade", "num-server-rounds": 4,
                                   "fedade-lr-min": 0.0, "fedade-lr-max": 1.0, **extra})


def test_fedade_learning_rate_uses_the_mean_of_both_estimators():
    """D1: S = (S_unc + S_rep) / 2, eta = eta_min + (eta_max - eta_min) S."""
    from flowerbed.clients.fedade import FedADEClient

    me = SimpleNamespace(cfg=_ade_cfg())
    assert FedADEClient.learning_rate(me, 0.2, 0.4) == pytest.approx(0.3)
    me = SimpleNamespace(cfg=_ade_cfg(**{"fedade-estimators": "rep"}))
    assert FedADEClient.learning_rate(me, 0.2, 0.4) == pytest.approx(0.4)


class _Feat(nn.Module):
    """trunk(x) = x (2 features), logits = x: shifts computed by hand."""

    def trunk(self, x):
        return x

    def forward(self, x):
        return x


def test_fedade_shift_estimators_by_hand():
    """D2: S_rep = (1 - cos(z_prev, z)) / 2 and S_unc = 1 - cos(q_prev, q)."""
    from flowerbed.clients.base import Client
    from flowerbed.clients.fedade import FedADEClient

    me = SimpleNamespace(cfg=_ade_cfg(), partition_id=0, context=Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    me.keep_model = lambda *a, **k: Client.keep_model(me, *a, **k)
    x0, x1 = torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    assert FedADEClient.shift(me, _Feat(), x0, 0) == (0.0, 0.0)
    s_unc, s_rep = FedADEClient.shift(me, _Feat(), x1, 1)
    assert s_rep == pytest.approx(0.5)  # orthogonal features: cos 0 -> 1/2, not 1
    q0, q1 = torch.softmax(x0, 1)[0].double(), torch.softmax(x1, 1)[0].double()
    assert s_unc == pytest.approx(1 - float(F.cosine_similarity(q0, q1, dim=0)))


def test_bbse_recovers_a_label_shift_from_a_non_uniform_source():
    """D3: M must be column-normalised by q0 (the existing test's q0 is uniform, which hides it)."""
    from flowerbed.clients.fedade import bbse_weights

    cond = np.array([[0.8, 0.3], [0.2, 0.7]])  # P(y_hat | y)
    q0, q_true = np.array([0.7, 0.3]), np.array([0.4, 0.6])
    w = bbse_weights(cond * q0, cond @ q_true)
    assert w == pytest.approx(q_true / q0)


def test_bbse_risk_is_the_reweighted_class_risk():
    """D4: risk = sum_y w_y q0_y R_y (= sum_y Q_y R_y), with R_y the mean CE of class y."""
    from flowerbed.clients.fedade import FedADEClient, bbse_weights

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    conf = np.array([[0.56, 0.09], [0.14, 0.21]])  # q0 = [0.7, 0.3]
    rx, ry = torch.randn(6, 3), torch.tensor([0, 0, 0, 0, 1, 1])
    x = torch.randn(8, 3)
    f0 = nn.Linear(3, 2)  # BBSE's fixed classifier, whose confusion matrix conf is
    me = SimpleNamespace(cfg=_ade_cfg(**{"fedade-risk": "bbse"}), device=torch.device("cpu"),
                         model_input=lambda t: t.float(), black_box=lambda msg: f0)
    msg = SimpleNamespace(content={"bbse": {"confusion": Array(conf), "ref_x": Array(rx.numpy()),
                                            "ref_y": Array(ry.numpy())}})
    got = FedADEClient.risk_on(me, x, msg)(model).item()
    with torch.no_grad():  # the label mix from f0's predictions (from a review: it was the adapted model's)
        freq = np.bincount(f0(x).argmax(1).numpy(), minlength=2) / len(x)
        assert not np.array_equal(freq, np.bincount(model(x).argmax(1).numpy(), minlength=2) / len(x))
        w = bbse_weights(conf, freq)
        ce = F.cross_entropy(model(rx), ry, reduction="none").numpy()
    q0 = conf.sum(0)
    want = sum(w[y] * q0[y] * ce[ry.numpy() == y].mean() for y in range(2))
    assert got == pytest.approx(want, rel=1e-5)


# ------------------------------------------------ FTH (Follow The History), a paper baseline


def test_reweighted_predictions_follow_the_weights_and_keep_a_finite_loss():
    from flowerbed.clients.fedade import reweighted

    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 1.0]])
    assert torch.allclose(reweighted(logits, None), torch.log_softmax(logits, 1))
    assert torch.allclose(reweighted(logits, np.ones(3)), torch.log_softmax(logits, 1))
    w = np.array([0.0, 4.0, 1.0])  # class 0 estimated absent
    logp = reweighted(logits, w)
    p = torch.softmax(logits, 1) * torch.tensor([1e-8, 4.0, 1.0])
    assert torch.allclose(logp.exp(), p / p.sum(1, keepdim=True), atol=1e-6)
    assert logp.argmax(1).tolist() == [1, 1] and torch.isfinite(logp).all()


def test_fth_weights_are_the_mean_bbse_estimate_of_the_past_steps():
    """p̂_t / q0 with p̂_t the mean of steps 0..t-1's unprojected BBSE estimates, projected onto
    the simplex, each made once (kept in context.state), and weights 1 at step 0."""
    from flowerbed.clients.fedade import FTH, FedADEClient, bbse_raw, to_simplex

    conf = np.array([[0.5, 0.1], [0.1, 0.3]])  # q0 = [0.6, 0.4]
    batches = {0: torch.tensor([[1.0, 0.0]] * 3 + [[0.0, 1.0]]),  # predicted 0, 0, 0, 1
               1: torch.tensor([[0.0, 1.0]] * 4), 2: torch.tensor([[1.0, 0.0]] * 4)}
    made = []

    def step_batch(t):
        made.append(t)
        return batches[t], None

    me = SimpleNamespace(cfg=_ade_cfg(**{"fedade-lr-mode": "none", "fedade-correction": "fth",
                                         "num-server-rounds": 8}),  # 4 steps
                         context=Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                         run_config={}), step_batch=step_batch)
    msg = SimpleNamespace(content={"bbse": {"confusion": Array(conf)}})
    model = nn.Identity()
    assert FedADEClient.fth_weights(me, model, msg, 0).tolist() == [1.0, 1.0] and made == []
    e0, e1 = bbse_raw(conf, np.array([0.75, 0.25])), bbse_raw(conf, np.array([0.0, 1.0]))
    assert e1.min() < 0  # an unbiased estimate can leave the simplex: averaged first, then projected
    got = FedADEClient.fth_weights(me, model, msg, 2)
    assert got == pytest.approx(to_simplex((e0 + e1) / 2) / conf.sum(0)) and made == [0, 1]
    assert FedADEClient.fth_weights(me, model, msg, 1) == pytest.approx(to_simplex(e0) / conf.sum(0))
    assert made == [0, 1] and int(me.context.state[FTH]["done"].numpy()[0]) == 2  # not redone
    FedADEClient.fth_weights(me, model, msg, 3)
    assert made == [0, 1, 2]


def test_fth_runs_on_a_fixed_model_and_scores_with_reweighted_predictions():
    from flowerbed.config import ConfigError

    with pytest.raises(ConfigError, match="'fedade-correction' = 'fth'.*fedade-lr-mode='none'"):
        Config.from_run_config({**SMALL, "fedade-correction": "fth"})
    # under another method an unread key is warned about, not refused (a README walk-through)
    Config.from_run_config({"method": "fedavg", "fedade-correction": "fth"})
    cfg = Config.from_run_config({**SMALL, "fedade-lr-mode": "none", "fedade-correction": "fth",
                                  "num-server-rounds": 6})
    run = StreamClient(cfg.to_run_config())
    strategy, arrays, client = run.strategy, run.arrays, run.client
    content = strategy.eval_content(arrays)
    assert set(content["bbse"]) == {"confusion"}  # what FTH needs, in every evaluation message
    content["config"] = ConfigRecord({"server-round": 4, "fedade-step": 1})
    m = client.evaluate(sent(2, content, "evaluate")).content["metrics"]
    model = client.model_for(sent(2, content, "evaluate")).eval()
    x, y = client.step_batch(1)
    w = client.fth_weights(model, sent(2, content, "evaluate"), 1)
    with torch.no_grad():
        probs = torch.softmax(model(x), 1) * torch.as_tensor(np.maximum(w, 1e-8), dtype=torch.float32)
    assert m["accuracy"] == pytest.approx(float((probs.argmax(1) == y).float().mean()))
    assert math.isfinite(m["loss"]) and not np.allclose(w, 1.0)


def test_a_client_whose_layers_went_nan_drops_them_and_reports_no_risk_it_did_not_compute(caplog):
    """From a review: NaN personal layers were filed and kept (and the estimator buffers and
    learning rate turned NaN from them), so every later reply and evaluation was refused; and a
    client at learning rate 0 reported a risk of 0.0 it never computed."""
    from flowerbed.clients.fedade import BUFFERS, PERSONAL

    run = StreamClient({**SMALL, "fedade-lr-mode": "fixed", "fedade-fixed-lr": 1e-3})
    run.train(1)
    rec = run.ctx.state[PERSONAL]
    run.ctx.state[PERSONAL] = type(rec)({k: type(v)(np.full_like(v.numpy(), np.nan)) for k, v in rec.items()})
    spoilt = run.train(3).content  # refused by the server: its risk is NaN (a review)
    assert not np.isfinite(spoilt["metrics"]["risk"])
    assert PERSONAL not in run.ctx.state and BUFFERS not in run.ctx.state and "diverged" in caplog.text
    healthy = run.train(3).content  # the whole model again, as the server sends after a refusal
    assert all(np.isfinite(a.numpy()).all() for a in healthy["arrays"].values())
    assert np.isfinite(healthy["metrics"]["risk"]) and PERSONAL in run.ctx.state
    still = StreamClient({**SMALL, "fedade-lr-mode": "none"}).train(1).content["metrics"]
    assert "risk" not in still and still["lr"] == 0


@pytest.mark.parametrize("method", ["fedade", "fedpoe", "atlas"])
def test_bbse_runs_end_to_end_with_the_fixed_classifier_sent_once(method, tmp_path):
    from inprocess import run_inprocess
    from methods import EXTRA

    from flowerbed.results import read_metrics

    rc = {**SMALL, **EXTRA[method], "method": method, "fedade-risk": "bbse", "min-clients": 2,
          "output-dir": str(tmp_path), "run-name": "bbse", "client-state-dir": str(tmp_path / "s")}
    summary = run_inprocess(rc, 3)
    rows = read_metrics(tmp_path / "bbse")
    assert summary["mean-accuracy"] is not None and all(r.get("clients-ok", 3) == 3 for r in rows[1:])
    # the pre-trained model (BBSE's classifier; Fed-ADE's and ATLAS's start) goes in round 1 only
    assert rows[1]["bytes-down"] > rows[3]["bytes-down"] + 3 * 6e6


@pytest.mark.parametrize("method", ["fedade", "fedpoe", "atlas"])
def test_bbse_label_mix_is_estimated_once_per_round_not_per_step(method):
    """f_0's predictions on the batch do not change while a model adapts: one pass a round
    (from a review: risk() ran f_0 at every SGD step of every model)."""
    from methods import EXTRA

    run = StreamClient({**SMALL, **EXTRA[method], "method": method, "fedade-risk": "bbse", "fedade-steps": 3})
    msg = run.message(1)
    calls = []
    run.client.black_box(msg).register_forward_hook(lambda *_: calls.append(1))
    reply = run.client.train(msg).content
    assert len(calls) == 1 and np.isfinite(reply["metrics"]["risk"])
