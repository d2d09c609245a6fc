"""FedCC (and the FedDF/FedMD baselines): the calibration by hand, the server aggregation, the
public set, and that a client uploads nothing but its prediction matrix."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from flowerbed.clients.fedcc import calibrate, entropy
from flowerbed.config import Config, ConfigError
from flowerbed.datasets.federated import client_partitions, public_indices, public_set, train_set
from flowerbed.datasets.partition import label_histogram
from flowerbed.registry import METHODS
from flowerbed.strategies.distill import PREDICTIONS
from flowerbed.strategies.fedcc import FedCCStrategy, aggregate_fedcc
from tests.conftest import reply, sent

DELTA, MAJ = 1e-3, 0.02


def logits_for(p):
    """Logits whose softmax is ``p`` (plus an 'unknown' logit of -inf weight)."""
    return torch.tensor([math.log(x) for x in p] + [-30.0])


def test_calibration_by_hand_every_class_a_majority_class():
    p = [0.7, 0.2, 0.1]
    pub = torch.stack([torch.tensor([0.0, 0.0, 0.0, -30.0]), torch.tensor([10.0, 0.0, 0.0, -30.0])])
    cal = calibrate(logits_for(p), pub, delta=DELTA, majority=MAJ)
    p_s = [(1 - DELTA) * x + DELTA / 3 for x in p]
    w_l = -sum(x * math.log(x) for x in p_s)
    assert cal.w_l == pytest.approx(w_l, rel=1e-6)
    assert cal.w_u == pytest.approx(0.0) and cal.majority.tolist() == [True, True, True]
    # sample 0 is uniform: H = log 3 > w_l, so w_x = w_l and alpha = 0 -> all mass on "unknown"
    assert cal.alpha[0].item() == pytest.approx(0.0, abs=1e-7)
    assert cal.pseudo[0].tolist() == pytest.approx([0, 0, 0, 1], abs=1e-6)
    # sample 1 is confident: alpha = (w_l - H)/(w_l + 0) = 1 - H/w_l
    h = float(entropy(torch.softmax(torch.tensor([10.0, 0.0, 0.0]).double(), 0)))
    assert cal.alpha[1].item() == pytest.approx(1 - h / w_l, rel=1e-5)
    assert cal.m[1].item() == 0
    assert cal.pseudo[1].sum().item() == pytest.approx(1.0)


def test_calibration_one_hot_bias():
    bias = torch.tensor([30.0, 0.0, 0.0, 0.0])  # p ~ e_0
    pub = torch.tensor([[0.0, 5.0, 0.0, 0.0], [2.0, 2.0, 2.0, 0.0]])
    cal = calibrate(bias, pub, delta=DELTA, majority=MAJ)
    assert cal.majority.tolist() == [True, False, False]
    assert cal.w_u == pytest.approx(math.log(3))
    assert 0 < cal.w_l < 0.02  # the smoothing keeps w_l > 0
    assert (cal.alpha <= cal.w_l / (cal.w_l + cal.w_u) + 1e-7).all()
    assert cal.m.tolist() == [0, 0]  # argmax restricted to the majority class


def test_pseudo_label_argmax_is_restricted_to_majority_classes():
    cal = calibrate(logits_for([0.5, 0.49, 0.01]), torch.tensor([[0.0, 1.0, 5.0, 0.0]]),
                    delta=DELTA, majority=MAJ)
    assert cal.majority.tolist() == [True, True, False]
    assert cal.w_u == pytest.approx(math.log(2))
    assert cal.m.item() == 1


def test_unknown_in_entropy_flag_changes_the_width():
    bias = torch.tensor([1.0, 1.0, 1.0, 1.0])
    pub = torch.zeros(1, 4)
    a = calibrate(bias, pub, delta=0.0, majority=MAJ)
    b = calibrate(bias, pub, delta=0.0, majority=MAJ, unknown_in_entropy=True)
    assert a.w_l == pytest.approx(math.log(3)) and b.w_l == pytest.approx(math.log(4))


def test_server_aggregation_by_hand():
    preds = np.array([[[0.6, 0.2, 0.2]], [[0.0, 0.2, 0.8]]])  # 2 clients, 1 sample, C = 2
    out = aggregate_fedcc(preds)
    mu = np.array([0.8, 0.2])
    agg = mu[0] * preds[0, 0, :2] + mu[1] * preds[1, 0, :2]
    assert out[0] == pytest.approx(agg / agg.sum(), rel=1e-6)
    # every client says "unknown": equal weights, no class mass left -> uniform
    assert aggregate_fedcc(np.array([[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]]))[0] == pytest.approx([0.5, 0.5])


SMALL = {"train-samples": 1200, "test-samples": 200, "public-fraction": 0.1, "batch-size": 32,
         "partition": "pathological:1"}


def test_public_set_is_fixed_unlabelled_and_disjoint():
    cfg = Config.from_run_config(SMALL)
    idx = public_indices(cfg)
    assert len(idx) == 120 and np.array_equal(idx, public_indices(cfg))
    pub = public_set(cfg)
    assert (pub.y == -1).all() and len(pub) == 120
    assert len(train_set(cfg)) == 1080
    with pytest.raises(ConfigError, match="'public-fraction'.*needs a public set"):
        Config.from_run_config({"method": "fedcc"})
    with pytest.raises(ConfigError, match="'public-fraction'.*no public sample out of 1200"):
        train_set(Config.from_run_config({**SMALL, "public-fraction": 0.0004}))
    # (from a review: it blamed num-partitions, 'more clients than training samples (0)')
    with pytest.raises(ConfigError, match="'public-fraction'.*takes all 1200 training samples"):
        train_set(Config.from_run_config({**SMALL, "public-fraction": 0.9999}))


def test_pathological_one_class_each_all_classes_equal_counts():
    cfg = Config.from_run_config({**SMALL, "train-samples": 0})
    parts = client_partitions(cfg, 10)
    hist = label_histogram(train_set(cfg).y.numpy(), parts, 10)
    assert ((hist > 0).sum(1) == 1).all() and ((hist > 0).sum(0) == 1).all()
    cfg2 = cfg.replace(partition=cfg.partition.__class__("pathological", 2))
    hist2 = label_histogram(train_set(cfg2).y.numpy(), client_partitions(cfg2, 10), 10)
    for c in range(10):  # each class split equally between the two clients that hold it
        held = hist2[:, c][hist2[:, c] > 0]
        assert len(held) == 2 and abs(int(held[0]) - int(held[1])) <= 1


@pytest.mark.parametrize("model", ["cnn", "resnet8"])
def test_hetero_models_halves_the_width_of_odd_partitions(model):
    """hetero-models used to give every client the same ResNet (width reached only the CNN)."""
    cfg = Config.from_run_config({**SMALL, "method": "fedcc", "model": model})
    sizes = []
    for pid in (0, 1):
        ctx = Context(run_id=1, node_id=3, node_config={"partition-id": pid, "num-partitions": 10},
                      state=RecordDict(), run_config=cfg.to_run_config())
        net = METHODS["fedcc"].client(cfg, ctx).new_model()
        assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 11)
        sizes.append(sum(p.numel() for p in net.parameters()))
    assert sizes[1] < 0.4 * sizes[0]


@pytest.mark.parametrize("method", ["fedcc", "feddf", "fedmd"])
def test_client_uploads_only_the_prediction_matrix(method):
    cfg = Config.from_run_config({**SMALL, "method": method})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 10},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS[method].client(cfg, ctx)
    out = client.train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 1})})))
    width = 11 if method == "fedcc" else 10
    assert set(out.content.array_records) == {PREDICTIONS}
    assert list(out.content[PREDICTIONS]) == ["p"]
    assert out.content[PREDICTIONS]["p"].numpy().shape == (120, width)
    assert out.content[PREDICTIONS].count_bytes() <= 120 * width * 4 + 256  # + a header
    assert "distill.model" in ctx.state.array_records  # the model stays on the client
    # second round: distillation towards soft targets, from the kept model
    soft = ArrayRecord({"soft_targets": Array(np.full((120, 10), 0.1, np.float32))})
    out2 = client.train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 2}),
                                            "soft_targets": soft})))
    assert out2.content[PREDICTIONS]["p"].numpy().shape == (120, width)
    for shape in ((121, 10), (120, 1)):  # extra rows, or one column that would broadcast
        bad = ArrayRecord({"soft_targets": Array(np.full(shape, 0.1, np.float32))})
        with pytest.raises(ValueError, match=r"'soft_targets' has shape .* expected \(120, 10\)"):
            client.train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 3}),
                                             "soft_targets": bad})))
    bad = ArrayRecord({"soft_targets": Array(np.full((120, 10), np.inf, np.float32))})
    with pytest.raises(ValueError, match="'soft_targets' holds NaN or inf"):
        client.train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 3}),
                                         "soft_targets": bad})))


def test_feddf_can_average_logits_as_fedds_avglogits():
    """From a fidelity review: FedDF's AVGLOGITS target is softmax(mean of the clients' logits);
    ours averaged their probabilities (flatter, and it can rank classes otherwise). That stays
    the default; ``feddf-average='logits'`` uploads logits and takes the softmax of their mean."""
    from scipy.special import softmax

    from flowerbed.strategies.feddf import FedDFStrategy

    logits = [np.array([[4.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), np.array([[-6.0, 0.0, 1.0], [0.0, 1.0, 0.0]])]
    preds = {avg: np.stack([softmax(z, 1) if avg == "probabilities" else z for z in logits])
             for avg in ("probabilities", "logits")}
    targets = {}
    for avg in ("probabilities", "logits"):
        cfg = Config.from_run_config({**SMALL, "method": "feddf", "feddf-average": avg})
        targets[avg] = FedDFStrategy(cfg).combine(preds[avg])
        ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 10},
                      state=RecordDict(), run_config=cfg.to_run_config())
        up = METHODS["feddf"].client(cfg, ctx).train(sent(3, RecordDict({"config": ConfigRecord(
            {"server-round": 1})})))
        p = up.content[PREDICTIONS]["p"].numpy()
        assert np.allclose(p.sum(1), 1, atol=1e-4) == (avg == "probabilities")  # logits: any rows
    assert np.allclose(targets["logits"], softmax(np.mean(logits, 0), 1))
    assert np.allclose(targets["probabilities"], np.mean([softmax(z, 1) for z in logits], 0))
    assert targets["probabilities"][0].argmax() == 0 and targets["logits"][0].argmax() == 2  # (reranked)
    with pytest.raises(ConfigError, match="'feddf-average' = 'mean'"):
        Config.from_run_config({**SMALL, "method": "feddf", "feddf-average": "mean"})


def two_client_strategy() -> FedCCStrategy:
    """A FedCC server that has sent round-1 messages to nodes 5 and 6 (partitions 0 and 1)."""
    s = FedCCStrategy(Config.from_run_config({**SMALL, "method": "fedcc", "min-clients": 1}))
    s.num_classes = 10
    s.node_of, s.partition_of, s._reference = {0: 5, 1: 6}, {5: 0, 6: 1}, ArrayRecord()
    s._sent = [sent(5), sent(6)]
    return s


def test_server_rejects_an_upload_with_weights():
    s = two_client_strategy()
    good = np.full((120, 11), 1 / 11, np.float32)
    m = MetricRecord({"num-examples": 10})
    ok = RecordDict({PREDICTIONS: ArrayRecord({"p": Array(good)}), "metrics": m})
    leaky = RecordDict({PREDICTIONS: ArrayRecord({"p": Array(good)}), "metrics": m,
                        "arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))})})
    out, _ = s.aggregate_train(1, [reply(s._sent[0], ok), reply(s._sent[1], leaky)])
    assert out["soft_targets"].numpy().shape == (120, 10)
    assert [f["partition"] for f in s.round.failed] == [1]
    assert "only the predictions may be uploaded" in s.round.failed[0]["reason"]


def test_replies_that_would_poison_the_soft_targets_are_refused():
    """One accepted reply with a slightly negative probability (FedDF), p(unknown) above 1
    (FedCC: a negative weight 1 - p_u) or huge class scores (FedMD: a float32 mean of inf) gave
    targets on which every client's distillation loss was NaN; every later round was skipped,
    and a skipped round resends the same targets."""
    s = two_client_strategy()
    good = np.full((120, 11), 1 / 11, np.float32)
    neg = good.copy()
    neg[:, 0], neg[:, 1] = -1e-4, 1 / 11 + 1e-4

    def content(p):
        return RecordDict({PREDICTIONS: ArrayRecord({"p": Array(p)}),
                           "metrics": MetricRecord({"num-examples": 10})})

    out, _ = s.aggregate_train(1, [reply(s._sent[0], content(good)), reply(s._sent[1], content(neg))])
    assert [f["partition"] for f in s.round.failed] == [1]
    assert "not probability vectors" in s.round.failed[0]["reason"]
    assert (out["soft_targets"].numpy() >= 0).all()
    # p(unknown) a little above 1, within the sum tolerance: its weight is 0, not negative
    targets = aggregate_fedcc(np.array([[[4e-4, 0.0, 1.0005]], [[0.0, 6e-4, 0.9994]]]))
    assert (targets >= 0).all() and targets.sum() == pytest.approx(1.0)
    fedmd = METHODS["fedmd"].strategy(Config.from_run_config({**SMALL, "method": "fedmd",
                                                              "min-clients": 1}))
    fedmd.num_classes, fedmd.n_public = 10, 120
    assert "class scores beyond" in fedmd._check_matrix(
        ArrayRecord({"p": Array(np.full((120, 10), 3e38, np.float32))}), 120)


def test_server_warns_about_a_client_without_unknown(caplog):
    """A client whose probe bias covers every class (|C_J| = C) is named in a warning."""
    s = two_client_strategy()
    good = np.full((120, 11), 1 / 11, np.float32)

    def content(majority: float) -> RecordDict:
        return RecordDict({PREDICTIONS: ArrayRecord({"p": Array(good)}),
                           "metrics": MetricRecord({"num-examples": 10,
                                                    "fedcc-majority-classes": majority})})

    with caplog.at_level("WARNING", logger="flowerbed"):
        s.aggregate_train(4, [reply(s._sent[0], content(1.0)), reply(s._sent[1], content(10.0))])
    warned = [r.getMessage() for r in caplog.records if "majority class" in r.getMessage()]
    assert len(warned) == 1 and "1 client(s) (partitions 1)" in warned[0] and "[round 4]" in warned[0]


def test_a_refused_evaluation_reply_is_left_out_of_the_scores_too():
    """A reply whose test-set predictions have the wrong shape used to leave the ensemble but
    keep its accuracy in the averaged scores and the per-client statistics."""
    s = two_client_strategy()
    s._n_test = 4
    s._sent = [sent(5, mtype="evaluate"), sent(6, mtype="evaluate")]
    good = np.full((4, 11), 1 / 11, np.float32)

    def content(p, acc):
        return RecordDict({"test_predictions": ArrayRecord({"p": Array(p)}),
                           "metrics": MetricRecord({"num-examples": 10, "accuracy": acc})})

    metrics = s.aggregate_evaluate(1, [reply(s._sent[0], content(good, 0.2)),
                                       reply(s._sent[1], content(good[:3], 1.0))])
    assert metrics["accuracy"] == pytest.approx(0.2) and len(s._test_preds) == 1
    assert set(s.round.clients) == {0} and [f["partition"] for f in s.round.failed] == [1]
    assert "shape (3, 11)" in s.round.failed[0]["reason"]


def test_a_client_that_has_not_trained_is_left_out_of_the_ensemble(caplog):
    """From a review: a client evaluated before its first training round (not sampled yet, its
    first round failed, its state lost) put its seeded initial model's predictions into the
    ensemble, and FedCC's mu = 1 - p(unknown) gave it full weight."""
    s = two_client_strategy()
    s._n_test = 4
    s._sent = [sent(5, mtype="evaluate"), sent(6, mtype="evaluate")]
    good = np.full((4, 11), 1 / 11, np.float32)

    def content(acc, trained):
        return RecordDict({"test_predictions": ArrayRecord({"p": Array(good)}), "metrics": MetricRecord(
            {"num-examples": 10, "accuracy": acc, "trained": trained})})

    metrics = s.aggregate_evaluate(3, [reply(s._sent[0], content(0.2, 1.0)),
                                       reply(s._sent[1], content(0.9, 0.0))])
    assert metrics["accuracy"] == pytest.approx(0.2) and len(s._test_preds) == 1
    assert "trained" not in metrics and "round 3: partitions [1] have not trained yet" in caplog.text
    # the client says which it is
    cfg = Config.from_run_config({**SMALL, "method": "fedcc"})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 10},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS["fedcc"].client(cfg, ctx)
    msg = RecordDict({"config": ConfigRecord({"server-round": 1})})
    assert client.evaluate(sent(3, msg, "evaluate")).content["metrics"]["trained"] == 0.0
    client.train(sent(3, msg))
    assert client.evaluate(sent(3, msg, "evaluate")).content["metrics"]["trained"] == 1.0


def test_the_every_class_majority_warning_names_each_client_once(caplog):
    """Found by a README walk-through: on dirichlet:0.5 it fired every round for the same
    clients; now once per client, then an info line."""
    s = FedCCStrategy(Config.from_run_config({"method": "fedcc", "public-fraction": 0.1}))
    s.num_classes = 10
    full = {"fedcc-majority-classes": 10}
    for rnd, parts in ((1, [0, 1]), (2, [0, 1]), (3, [0, 1, 2])):
        caplog.clear()
        s.inspect(rnd, parts, [full] * len(parts))
        warned = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == (0 if rnd == 2 else 1), (rnd, caplog.text)


def test_global_test_accuracy_is_the_plain_mean_over_clients_with_or_without_a_local_split():
    """From a review: it was averaged only over clients with a local test split, weighted by its
    size, so the paper preset (local-test-fraction 0) never reported Table II's figure."""
    s = two_client_strategy()
    s._n_test = 4
    good = np.full((4, 11), 1 / 11, np.float32)

    def content(n, acc, on_global):
        return RecordDict({"test_predictions": ArrayRecord({"p": Array(good)}), "metrics": MetricRecord(
            {"num-examples": n, **({"accuracy": acc} if n else {}), "global-test-accuracy": on_global,
             "trained": 1.0})})

    for sizes, want_local in (((0, 0), None), ((30, 10), 0.3)):
        s._sent = [sent(5, mtype="evaluate"), sent(6, mtype="evaluate")]
        metrics = s.aggregate_evaluate(1, [reply(s._sent[0], content(sizes[0], 0.2, 0.8)),
                                           reply(s._sent[1], content(sizes[1], 0.6, 0.6))])
        assert metrics["global-test-accuracy"] == pytest.approx(0.7)  # not (30*0.8 + 10*0.6)/40
        assert metrics.get("accuracy") == (None if want_local is None else pytest.approx(want_local))


@pytest.mark.parametrize("method", ["fedcc", "feddf", "fedmd", "fedct"])
def test_a_local_model_gone_nan_is_dropped_and_started_afresh(method, caplog):
    """From a review: the distillation clients filed their model unchecked, so a NaN model was
    kept for the rest of the run (every upload refused) and still counted as trained."""
    from flowerbed.clients import distill

    cfg = Config.from_run_config({**SMALL, "method": method})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 10},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS[method].client(cfg, ctx)
    msg = RecordDict({"config": ConfigRecord({"server-round": 1})})
    spoil = client.local_update

    def diverge(model, targets, gen):
        out = spoil(model, targets, gen)
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
        return out

    client.local_update = diverge
    if method == "fedct":  # hard votes: a NaN model's reply is an error, not a NaN upload
        with pytest.raises(FloatingPointError, match="casts no votes"):
            client.train(sent(3, msg))
    else:
        client.train(sent(3, msg))
    assert distill.STATE not in ctx.state.array_records and "diverged" in caplog.text
    assert client.evaluate(sent(3, msg, "evaluate")).content["metrics"]["trained"] == 0.0
    client.local_update = spoil
    client.train(sent(3, msg))
    assert distill.STATE in ctx.state.array_records
