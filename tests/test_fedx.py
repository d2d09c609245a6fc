"""FedX and the self-supervised bases: losses by hand, frozen global copy, EMA, no labels."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from flowerbed.clients.fedbyol import TARGET, ema_update
from flowerbed.clients.fedmoco import KEY_ENCODER, QUEUE
from flowerbed.clients.fedsimclr import make_ssl_model
from flowerbed.config import Config, ConfigError
from flowerbed.datasets.federated import train_set
from flowerbed.losses import byol_loss, moco_loss, nt_xent, relational_loss
from flowerbed.registry import METHODS
from flowerbed.training import to_record
from tests.conftest import sent


def test_nt_xent_by_hand():
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # every row has one positive (sim 1) and two negatives (sim 0) at tau = 1
    assert nt_xent(u, u.clone(), 1.0).item() == pytest.approx(math.log(1 + 2 / math.e), rel=1e-6)
    # at tau = 0.5 the sims double
    assert nt_xent(u, u.clone(), 0.5).item() == pytest.approx(math.log(1 + 2 / math.e ** 2), rel=1e-6)


def test_relational_loss_by_hand():
    u1, u2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    anchors = torch.eye(2)
    s = math.e / (1 + math.e)  # softmax([1, 0])[0]
    official = math.log(0.5) - 0.5 * math.log(s * (1 - s))       # ½[KL(M‖P1) + KL(M‖P2)], M = ½
    js = s * math.log(2 * s) + (1 - s) * math.log(2 * (1 - s))    # ½KL(P1‖M) + ½KL(P2‖M)
    assert relational_loss(u1, u2, anchors, 1.0, 1.0, "official").item() == pytest.approx(official, rel=1e-5)
    assert relational_loss(u1, u2, anchors, 1.0, 1.0, "js").item() == pytest.approx(js, rel=1e-5)
    # identical views agree: zero loss in both forms
    assert relational_loss(u1, u1, anchors, 1.0, 1.0, "js").item() == pytest.approx(0.0, abs=1e-7)
    # a small τ: softmax entries underflow to 0; the JS form stays finite (it was NaN), and the
    # views are nearly one-hot on different anchors, so it nears its maximum ln 2
    u1.requires_grad_(True)
    loss = relational_loss(u1, u2, anchors, 0.005, 0.005, "js")
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), rel=1e-4) and torch.isfinite(u1.grad).all()
    # the official form too (its target M is not detached: M log M's gradient was NaN at M = 0;
    # a run with fedx-tau-target=0.002 failed every client in round 1)
    u1.grad = None
    loss = relational_loss(u1, u2, anchors, 0.005, 0.002, "official")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(u1.grad).all()


def test_official_target_is_not_detached():
    u1 = torch.tensor([[1.0, 0.2]], requires_grad=True)
    u2 = torch.tensor([[0.3, 1.0]])
    relational_loss(u1, u2, torch.eye(2), 0.1, 0.5, "official").backward()
    assert u1.grad is not None and u1.grad.abs().sum() > 0


def test_byol_loss_and_ema():
    p, z = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    assert byol_loss(p, z).item() == pytest.approx(2.0)
    assert byol_loss(p, p * 3).item() == pytest.approx(0.0, abs=1e-6)
    t, o = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        t.weight.fill_(1.0), t.bias.fill_(0.0), o.weight.fill_(3.0), o.bias.fill_(1.0)
    ema_update(t, o, 0.9)
    assert torch.allclose(t.weight, torch.full((1, 2), 0.9 * 1 + 0.1 * 3))
    assert torch.allclose(t.bias, torch.tensor([0.1]))


SMALL = {"train-samples": 400, "test-samples": 100, "batch-size": 32, "local-test-fraction": 0.0}


def make_client(method, **extra):
    cfg = Config.from_run_config({**SMALL, "method": method, **extra})
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                  state=RecordDict(), run_config=cfg.to_run_config())
    model = make_ssl_model(cfg, train_set(cfg))
    msg = sent(7, RecordDict({"arrays": to_record(model), "config": ConfigRecord({"server-round": 1})}))
    return METHODS[method].client(cfg, ctx), model, msg, ctx


@pytest.mark.parametrize("method,extra", [("fedsimclr", {}), ("fedbyol", {}), ("fedu", {}),
                                          ("fedmoco", {}), ("fedx", {"fedx-base": "moco"}),
                                          ("moon-unsup", {}),
                                          ("fedprotocl", {"protocl-warmup-rounds": 0}),
                                          ("fedx", {"fedx-base": "protocl", "protocl-warmup-rounds": 0}),
                                          ("fedx", {"fedx-base": "simclr"}),
                                          ("fedx", {"fedx-base": "byol"}),
                                          ("fedx", {"fedx-base": "fedu"}),
                                          ("fedx", {"fedx-base": "byol", "ssl-head-bn": True,
                                                    "fedx-head": "separate"})])
def test_ssl_clients_never_see_labels(method, extra):
    client, _, msg, ctx = make_client(method, **extra)
    assert (client.train_data.y == -1).all(), "labels must be removed before training code"
    out = client.train(msg)  # cross-entropy on a -1 label would raise here
    assert set(out.content.array_records) == {"arrays"}
    assert np.isfinite(out.content["metrics"]["train-loss"])
    if method in ("fedbyol", "fedu") or extra.get("fedx-base") in ("byol", "fedu"):
        assert TARGET in ctx.state.array_records  # the EMA target stays on the client
    if method in ("fedmoco", "fedprotocl") or extra.get("fedx-base") in ("moco", "protocl"):
        assert {KEY_ENCODER, QUEUE} <= set(ctx.state.array_records)  # key encoder and queue too
    if method == "moon-unsup":  # the upload, kept as next round's previous local model
        assert np.array_equal(ctx.state["moon.previous"]["backbone.conv1.weight"].numpy(),
                              out.content["arrays"]["backbone.conv1.weight"].numpy())


def test_a_partition_too_small_for_a_contrastive_batch_reports_no_loss():
    """One sample: no batch of 2, no step, so no train-loss (0.0 pulled the round's mean down)."""
    client, model, msg, _ = make_client("fedsimclr")
    client.train_data = client.train_data.subset([0])
    out = client.train(msg).content
    assert "train-loss" not in out["metrics"] and out["metrics"]["num-examples"] == 1
    assert np.array_equal(out["arrays"]["backbone.conv1.weight"].numpy(),
                          model.state_dict()["backbone.conv1.weight"].numpy())


@pytest.mark.parametrize("method,key,extra", [("fedbyol", TARGET, {}), ("fedu", "fedu.online", {}),
                                              ("fedmoco", QUEUE, {}), ("fedmoco", KEY_ENCODER, {}),
                                              ("fedprotocl", QUEUE, {"protocl-warmup-rounds": 0}),
                                              ("moon-unsup", "moon.previous", {}),
                                              ("fedx", TARGET, {"fedx-base": "byol"})])
def test_kept_state_gone_nan_is_dropped_not_kept(method, key, extra, caplog):
    """From a review: an EMA target, key encoder, queue or previous model gone NaN was filed
    again every round, so every later reply of that client was NaN and refused. Now the round
    it spoils still shows it, and the next round starts that state afresh."""
    client, model, msg, ctx = make_client(method, **extra)
    client.train(msg)
    rec = ctx.state[key]
    ctx.state[key] = type(rec)({k: type(v)(np.full_like(v.numpy(), np.nan)) if v.numpy().dtype.kind == "f"
                                else v for k, v in rec.items()})

    def round_(rnd):
        return client.train(sent(7, RecordDict({"arrays": to_record(model),
                                                "config": ConfigRecord({"server-round": rnd})})))

    spoilt = round_(2).content["arrays"]
    if method != "fedu":  # (FedU leaves a NaN local model out of its comparison, then files anew)
        assert not all(np.isfinite(a.numpy()).all() for a in spoilt.values())
        assert key not in ctx.state.array_records and "diverged" in caplog.text
    healthy = round_(3)
    assert all(np.isfinite(a.numpy()).all() for a in healthy.content["arrays"].values())
    assert np.isfinite(healthy.content["metrics"]["train-loss"]) and key in ctx.state.array_records


def test_fedu_compares_the_encoder_only_and_reports_no_divergence_before_it_has_a_local_model():
    """From a review: FedX's separate KD head counted in FedU's encoder distance, and a client
    without a local model yet reported a divergence of 0.0 into the round's mean."""
    client, model, msg, ctx = make_client("fedx", **{"fedx-base": "fedu", "fedx-head": "separate"})
    first = client.train(msg).content["metrics"]
    assert "fedu-divergence" not in first and "fedu-kept-local-predictor" not in first
    sent_model = to_record(model)
    ctx.state["fedu.online"] = type(sent_model)(  # only the KD head differs from the model sent
        {k: type(v)(v.numpy() + (1.0 if k.startswith("kd_head.") else 0.0)) for k, v in sent_model.items()})
    client.prepare(model, msg)
    assert client.divergence == pytest.approx(0.0, abs=1e-6)


def test_moco_loss_by_hand():
    q, k = torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    queue = torch.tensor([[0.0, 3.0], [-1.0, 0.0]])  # cosines 0 and -1 with q
    want = -math.log(math.e / (math.e + 1 + math.exp(-1)))  # tau = 1
    assert moco_loss(q, k, queue, 1.0).item() == pytest.approx(want, rel=1e-6)
    want = -math.log(math.e ** 2 / (math.e ** 2 + 1 + math.exp(-2)))  # tau = 0.5 doubles every logit
    assert moco_loss(q, k, queue, 0.5).item() == pytest.approx(want, rel=1e-6)
    # the keys and the queue are the momentum encoder's: no gradient reaches them
    q.requires_grad_(True), k.requires_grad_(True), queue.requires_grad_(True)
    moco_loss(q, k, queue, 0.5).backward()
    assert q.grad is not None and k.grad is None and queue.grad is None


def test_moco_queue_is_fifo_and_kept_between_rounds():
    client, model, msg, ctx = make_client("fedmoco", **{"moco-queue": 5, "ssl-dim": 4})
    client.prepare(model, msg)
    start = client.queue.clone()
    assert client.queue.shape == (5, 4) and torch.allclose(client.queue.norm(dim=1), torch.ones(5))
    keys = torch.arange(1.0, 13.0).reshape(3, 4)
    client.enqueue(keys)
    assert client.ptr == 3 and torch.allclose(client.queue[3:], start[3:])
    assert torch.allclose(client.queue[:3], torch.nn.functional.normalize(keys, dim=1))
    client.enqueue(keys[:1] * -1)
    client.enqueue(keys)  # wraps round: rows 4, 0, 1
    assert client.ptr == 2
    assert torch.allclose(client.queue[[4, 0, 1]], torch.nn.functional.normalize(keys, dim=1))
    client.finish(model)
    kept = client.queue.clone()
    again = METHODS["fedmoco"].client(client.cfg, ctx)  # a new round's client reads the state
    again.prepare(model, msg)
    assert again.ptr == 2 and torch.equal(again.queue, kept)
    # the same seed and partition start from the same queue
    other, model2, msg2, _ = make_client("fedmoco", **{"moco-queue": 5, "ssl-dim": 4})
    other.prepare(model2, msg2)
    assert torch.equal(other.queue, start)
    with pytest.raises(ValueError, match=r"kept MoCo queue has shape \(5, 4\)"):
        METHODS["fedmoco"].client(Config.from_run_config(
            {**SMALL, "method": "fedmoco", "moco-queue": 6, "ssl-dim": 4}), ctx).prepare(model, msg)


def test_moco_keys_of_a_batchnorm_network_come_from_shuffled_groups():
    """Shuffle BN: each key is normalised by its group's statistics (not the query's batch's),
    and comes back in its sample's place."""
    client, model, msg, _ = make_client("fedmoco", **{"ssl-head-bn": True})
    client.prepare(model, msg)
    x = client.train_data.normalise(client.train_data.x[:16])
    x1, x2 = x[:8], x[8:].flip(3)
    with torch.no_grad():
        _, whole, _ = client.target(torch.cat([x1, x2]))
    grouped = torch.cat(client.target_projections(x1, x2))
    assert not torch.allclose(grouped, whole, atol=1e-4)  # train mode: the groups' own statistics
    client.target.eval()  # running statistics: a key no longer depends on its group
    with torch.no_grad():
        _, whole, _ = client.target(torch.cat([x1, x2]))
    assert torch.allclose(torch.cat(client.target_projections(x1, x2)), whole, atol=1e-5)  # in order
    client.target.train()
    k1, k2 = client.target_projections(x[:3], x[3:5])  # 5 samples: groups of 3 and 2, never of 1
    assert k1.shape == (3, client.cfg.ssl_dim) and k2.shape == (2, client.cfg.ssl_dim)


def test_moco_keys_come_from_the_ema_key_encoder():
    client, model, msg, ctx = make_client("fedmoco", **{"moco-momentum": 0.5})
    client.prepare(model, msg)
    x = client.train_data.normalise(client.train_data.x[:8])
    loss = client.loss(model, client.views(model, x, x.flip(3), None), x, x.flip(3), None)
    loss.backward()
    assert all(p.grad is None for p in client.target.parameters())
    assert client.keys.shape == (16, client.cfg.ssl_dim)
    before = [p.clone() for p in client.target.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    client.after_step(model)
    for b, t, o in zip(before, client.target.parameters(), model.parameters(), strict=True):
        assert torch.allclose(t, 0.5 * b + 0.5 * o)
    assert client.ptr == 16


def test_fedu_divergence_counts_encoder_weights_only():
    """FedU's ||local - global|| is over the encoder's parameters: BatchNorm buffers (running
    stats, num_batches_tracked, which counts local steps) and the predictor do not count."""
    from flowerbed.clients.fedu import LOCAL

    client, model, msg, ctx = make_client("fedu", **{"ssl-head-bn": True})
    local = {k: v.clone() for k, v in model.state_dict().items()}
    for k in local:
        if "num_batches_tracked" in k or "running_" in k or k.startswith("predictor."):
            local[k] = local[k] + 100
    local["backbone.conv1.bias"][0] += 3.0
    local["projector.0.bias"][1] += 4.0
    ctx.state[LOCAL] = ArrayRecord(local)
    client.prepare(model, msg)
    assert client.divergence == pytest.approx(5.0, rel=1e-5)


def test_head_batch_norm_is_in_both_heads_only_when_asked():
    for bn in (False, True):
        _, model, _, _ = make_client("fedbyol", **{"ssl-head-bn": bn})
        for head in (model.projector, model.predictor):
            assert any(isinstance(m, torch.nn.BatchNorm1d) for m in head) is bn


def test_fedx_global_copy_is_frozen_and_local_model_learns():
    client, model, msg, _ = make_client("fedx")
    client.prepare(model, msg)
    x = client.train_data.normalise(client.train_data.x[:8])
    v = client.views(model, x, x.flip(3), x.roll(1, 0))
    loss = client.loss(model, v, x, x.flip(3), x.roll(1, 0))
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in client.global_model.parameters())
    assert not client.global_model.training
    assert model.predictor[0].weight.grad is not None  # the prediction head takes the global terms
    assert model.backbone.conv1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("extra,terms", [
    ({}, {"base", "local-relational", "global-contrastive", "global-relational"}),
    ({"fedx-global": "prox"}, {"base", "local-relational", "prox"}),
    ({"fedx-local-kd": False, "fedx-global-kd": False}, {"base"})])
def test_fedx_reports_each_loss_term(extra, terms):
    """Each term's mean over the round's samples is in the reply's metrics; they add up to the
    round's loss, also with a last batch shorter than the others (a mean over steps did not)."""
    client, _, msg, _ = make_client("fedx", **{"train-samples": 400, "batch-size": 32, **extra})
    m = client.train(msg).content["metrics"]
    got = {k.removeprefix("fedx-loss-"): v for k, v in m.items() if k.startswith("fedx-loss-")}
    assert set(got) == terms and len(client.train_data) % 32 not in (0, 1)
    assert sum(got.values()) == pytest.approx(m["train-loss"], rel=1e-5)
    assert got["base"] > 0


def test_fedx_separate_head_over_byol_takes_the_global_terms():
    """fedx-head='separate': FedX's global terms go through a head of its own, not BYOL's
    predictor (which BYOL's loss still trains); it only makes sense over BYOL."""
    client, model, msg, _ = make_client("fedx", **{"fedx-base": "byol", "fedx-head": "separate"})
    client.prepare(model, msg)
    x = client.train_data.normalise(client.train_data.x[:8])
    v = client.views(model, x, x.flip(3), x.roll(1, 0))
    client.loss(model, v, x, x.flip(3), x.roll(1, 0)).backward()
    assert model.kd_head[0].weight.grad.abs().sum() > 0
    assert model.predictor[0].weight.grad.abs().sum() > 0
    assert make_client("fedx", **{"fedx-base": "byol"})[1].kd_head is None  # shared: the default
    with pytest.raises(ConfigError, match="'separate' needs method='fedx' with fedx-base='byol'"):
        Config.from_run_config({"method": "fedx", "fedx-head": "separate"})


def test_fedx_ablations_change_the_loss():
    losses = {}
    for local, glob in [(True, True), (False, True), (True, False), (False, False)]:
        torch.manual_seed(0)  # the same model for every ablation (an audit found 14 % of the
        # random states before this test made the four models differ enough to break the order)
        client, model, msg, _ = make_client("fedx", **{"fedx-local-kd": local, "fedx-global-kd": glob})
        client.prepare(model, msg)
        torch.manual_seed(0)
        x = client.train_data.normalise(client.train_data.x[:8])
        v = client.views(model, x, x.flip(3), x.roll(1, 0))
        losses[(local, glob)] = client.loss(model, v, x, x.flip(3), x.roll(1, 0)).item()
    assert losses[(True, True)] > losses[(False, True)] > losses[(False, False)]
    assert losses[(True, True)] > losses[(True, False)] > losses[(False, False)]


@pytest.mark.parametrize("mode", ["per-sample", "batched"])
def test_grey_scale_views_are_seeded_and_distort_intensity(mode):
    """1-channel views jitter brightness/contrast (crop + flip alone keep a uniform image as it
    is, so two views would share their intensity histogram), and a seed fixes them; batched
    views (kornia) draw their own crop, flip and jitter for every sample, as per-sample ones do."""
    from flowerbed.datasets.augment import Augmenter

    augment, flat = Augmenter(1, 28, mode), torch.full((64, 1, 28, 28), 128, dtype=torch.uint8)
    torch.manual_seed(3)
    a = augment(flat)
    torch.manual_seed(3)
    assert torch.equal(a, augment(flat)) and a.shape == flat.shape
    assert a.dtype == (torch.float32 if mode == "batched" else torch.uint8)
    assert 0 <= float(a.min()) and float(a.max()) <= 255
    means = a.float().mean(dim=(1, 2, 3))
    assert (means != 128).float().mean() > 0.5 and means.std() > 5
    # crops and flips per sample: one left-to-right ramp, 64 different views (3 channels too)
    for c, size in ((1, 28), (3, 32)):
        ramp = torch.arange(size, dtype=torch.uint8).mul(8).expand(64, c, size, size).contiguous()
        views = Augmenter(c, size, mode)(ramp).float()
        assert views.shape == ramp.shape
        assert len({tuple(v[0, size // 2, ::4].round().tolist()) for v in views}) > 50
        flipped = (views[:, 0, :, -1] < views[:, 0, :, 0]).all(1)  # the ramp descends
        assert 10 < int(flipped.sum()) < 54


def test_views_are_batched_on_a_gpu_by_default_and_per_sample_on_the_cpu():
    """ssl-augment='auto': every CPU figure in the README was made with the per-sample views."""
    from flowerbed.datasets.augment import Augmenter

    assert not Augmenter(1, 28, "auto", torch.device("cpu")).batched
    assert Augmenter(1, 28, "auto", torch.device("cuda")).batched  # (built without touching the GPU)
    assert Augmenter(1, 28, "batched").batched and not Augmenter(1, 28, "per-sample").batched
    with pytest.raises(ConfigError, match=r"'ssl-augment' = 'gpu' is invalid: use auto \| per-sample \| b"):
        Config.from_run_config({"method": "fedx", "ssl-augment": "gpu"})


def test_fedx_trains_on_batched_views(tmp_path, monkeypatch):
    from inprocess import run_inprocess

    from flowerbed.datasets import augment

    built = []
    monkeypatch.setattr(augment, "batched_ssl_transform",
                        lambda *a, f=augment.batched_ssl_transform: built.append(a) or f(*a))
    summary = run_inprocess({**SMALL, "method": "fedx", "ssl-augment": "batched", "num-server-rounds": 1,
                             "probe-epochs": 1, "min-clients": 2, "output-dir": str(tmp_path),
                             "run-name": "batched"}, 2)
    assert 0.1 < summary["final-accuracy"] <= 1 and built  # (the clients' views were kornia's)


# ------------------------------------------------ found by a mutation review (session 37)


def _kl(p, q):
    return float(np.sum(p * (np.log(p) - np.log(q))))


def _softmax(v):
    e = np.exp(v - v.max())
    return e / e.sum()


def test_official_relational_loss_uses_the_target_temperature():
    """L1: FedX's official target M is built at tau_target, the predictions at tau."""
    from flowerbed.losses import relational_loss

    u1, u2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.6, 0.8]])
    tau, tau_t = 1.0, 0.25
    s1, s2 = np.array([1.0, 0.0]), np.array([0.6, 0.8])  # unit rows against the unit anchors
    p1, p2 = _softmax(s1 / tau), _softmax(s2 / tau)
    m = 0.5 * (_softmax(s1 / tau_t) + _softmax(s2 / tau_t))
    want = 0.5 * (_kl(m, p1) + _kl(m, p2))
    got = relational_loss(u1, u2, torch.eye(2), tau, tau_t, "official").item()
    assert got == pytest.approx(want, rel=1e-5)


def test_relational_loss_normalises_the_anchors():
    """L2: similarities are cosines: scaling the anchors changes nothing."""
    from flowerbed.losses import relational_loss

    u1, u2 = torch.tensor([[1.0, 0.2]]), torch.tensor([[0.3, 1.0]])
    for form in ("official", "js"):
        a = relational_loss(u1, u2, torch.eye(2), 0.5, 0.5, form).item()
        b = relational_loss(u1, u2, 5 * torch.eye(2), 0.5, 0.5, form).item()
        assert a == pytest.approx(b, rel=1e-6)


def test_byol_target_gets_no_gradient():
    """L4: BYOL's target branch is a stop-gradient."""
    from flowerbed.losses import byol_loss

    p = torch.tensor([[1.0, 0.5]], requires_grad=True)
    z = torch.tensor([[0.2, 1.0]], requires_grad=True)
    byol_loss(p, z).backward()
    assert p.grad is not None and z.grad is None


def test_fedx_over_fedu_keeps_fedus_predictor_rule_and_adds_the_global_terms():
    """fedx-base='fedu': a client whose last local encoder diverged keeps its own predictor (FedU),
    its frozen global copy is the received encoder and projector, and FedX's terms are added."""
    from flowerbed.clients.fedu import LOCAL
    from flowerbed.clients.fedx import FedXFedUClient

    client, model, msg, ctx = make_client("fedx", **{"fedx-base": "fedu", "fedu-mu": 0.5})
    assert isinstance(client, FedXFedUClient)
    received = {k: v.clone() for k, v in model.state_dict().items()}
    local = {k: v + 1.0 if v.is_floating_point() else v for k, v in received.items()}
    ctx.state[LOCAL] = ArrayRecord(local)
    client.prepare(model, msg)
    assert client.divergence > 0.5
    sd, gsd = model.state_dict(), client.global_model.state_dict()
    assert torch.equal(sd["predictor.0.weight"], local["predictor.0.weight"])  # kept its own
    assert torch.equal(sd["projector.0.weight"], received["projector.0.weight"])  # global encoder
    assert torch.equal(gsd["projector.0.weight"], received["projector.0.weight"])
    assert not client.global_model.training
    x = client.train_data.normalise(client.train_data.x[:8])
    v = client.views(model, x, x.flip(3), x.roll(1, 0))
    with_kd = client.loss(model, v, x, x.flip(3), x.roll(1, 0))
    bare = METHODS["fedu"].client(client.cfg, ctx)
    bare.prepare(model, msg)
    assert with_kd.item() > bare.loss(model, v, x, x.flip(3), x.roll(1, 0)).item()
    with pytest.raises(ConfigError, match="fedx-base='byol' or 'fedu'"):
        Config.from_run_config({"method": "fedx", "fedx-base": "simclr", "fedx-head": "separate"})


def test_fedx_global_prox_replaces_the_global_terms_with_fedprox_term():
    """fedx-global='prox' (the paper's Table 2 comparison): base + local relational loss +
    (mu/2)||w - w_g||^2 to the received model, without the global contrastive/relational terms."""
    client, model, msg, _ = make_client("fedx", **{"fedx-global": "prox", "proximal-mu": 0.5})
    client.prepare(model, msg)
    x = client.train_data.normalise(client.train_data.x[:8])
    args = (x, x.flip(3), x.roll(1, 0))
    no_global = make_client("fedx", **{"fedx-global-kd": False})[0]
    no_global.prepare(model, msg)
    v = client.views(model, *args)
    assert client.loss(model, v, *args).item() == pytest.approx(no_global.loss(model, v, *args).item())
    with torch.no_grad():
        model.backbone.conv1.bias.add_(2.0)  # ||w - w_g||^2 = 4 x the bias's size
    v = client.views(model, *args)
    extra = 0.5 / 2 * 4.0 * model.backbone.conv1.bias.numel()
    assert client.loss(model, v, *args).item() == pytest.approx(
        no_global.loss(model, v, *args).item() + extra, rel=1e-5)
    with pytest.raises(ConfigError, match="'fedx-global' = 'l2'"):
        Config.from_run_config({"method": "fedx", "fedx-global": "l2"})
    # a README walk-through: with fedx-global-kd=false (or mu = 0) the run had no global term at
    # all, and config.json said 'prox'
    with pytest.raises(ConfigError, match="'fedx-global' = 'prox'.*fedx-global-kd=false switches off"):
        Config.from_run_config({"method": "fedx", "fedx-global": "prox", "fedx-global-kd": False})
    with pytest.raises(ConfigError, match="'proximal-mu' = 0.0.*needs a pull > 0"):
        Config.from_run_config({"method": "fedx", "fedx-global": "prox", "proximal-mu": 0.0})


def test_fedx_global_scaffold_corrects_each_step_in_place_of_the_global_terms():
    """fedx-global='scaffold' (the paper's other Table 2 comparison): base + local relational loss,
    each step's gradient corrected by c - c_i, c_i kept as SCAFFOLD's client keeps it."""
    from flowerbed.clients.scaffold import PENDING
    from flowerbed.strategies.scaffold import CV_DELTA, SERVER_CV

    def trained(extra, c=None):
        torch.manual_seed(0)  # the same initial model each time
        client, model, msg, ctx = make_client("fedx", **extra)
        if c is not None:
            msg.content[SERVER_CV] = ArrayRecord({k: Array(np.full(p.shape, c, np.float32))
                                                  for k, p in model.named_parameters()})
        return client, client.train(msg), ctx, to_record(model)

    _, plain, _, start = trained({"fedx-global-kd": False})
    client, zero, ctx, _ = trained({"fedx-global": "scaffold"})  # c = c_i = 0: no correction
    assert all(np.array_equal(zero.content["arrays"][k].numpy(), plain.content["arrays"][k].numpy())
               for k in start)
    assert set(zero.content.array_records) == {"arrays", CV_DELTA} and PENDING in ctx.state.array_records
    client, moved, _, _ = trained({"fedx-global": "scaffold"}, c=0.01)
    k, cfg = "backbone.conv1.weight", client.cfg
    y, x = moved.content["arrays"][k].numpy(), start[k].numpy()
    assert not np.array_equal(y, plain.content["arrays"][k].numpy())
    # option II with c_i = 0: delta c_i = -c + (x - y) / (K lr / (1 - momentum))
    assert client.steps == -(-len(client.train_data) // cfg.batch_size)  # every batch has >= 2 samples
    want = -0.01 + (x - y) / (client.steps * cfg.lr / (1 - cfg.momentum))
    assert np.allclose(moved.content[CV_DELTA][k].numpy(), want, atol=1e-5)
    with pytest.raises(ConfigError, match="'fedx-global' = 'scaffold'.*fedx-global-kd=false switches off"):
        Config.from_run_config({"method": "fedx", "fedx-global": "scaffold", "fedx-global-kd": False})


def test_fedx_global_scaffold_over_byol_resumes_as_an_unbroken_run(tmp_path):
    """Both kinds of client state (BYOL's target, SCAFFOLD's c_i) and the server's c survive a
    crash after round 1."""
    from inprocess import run_inprocess

    from flowerbed import faults
    from flowerbed.results import read_metrics

    def rc(name, **more):
        return {**SMALL, "method": "fedx", "fedx-base": "byol", "fedx-global": "scaffold",
                "num-server-rounds": 3, "probe-every": 3, "probe-epochs": 1, "min-clients": 2,
                "output-dir": str(tmp_path), "run-name": name, "client-state-dir": str(tmp_path / "s"),
                **more}

    def rows(name):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(tmp_path / name)]

    full = run_inprocess(rc("full"), 2)
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(rc("halt", **{"fault-crash-after": 1}), 2)
    resumed = run_inprocess(rc("halt", resume=str(tmp_path / "halt")), 2)
    assert rows("halt") == rows("full") and resumed["final-accuracy"] == full["final-accuracy"]
    # the states that make it SCAFFOLD: a server c that moved, and c_i filed on the clients
    from flowerbed import checkpoint

    c = checkpoint.load(tmp_path / "full")["strategy"]["c"]
    assert c and any(np.abs(v).max() > 0 for v in c.values())
    filed = [torch.load(f, weights_only=True) for f in (tmp_path / "s").rglob("round-*.pt")]
    assert filed and all({"scaffold.c_i", "byol.target"} <= set(f["arrays"]) for f in filed)


def test_model_contrastive_loss_by_hand():
    """MOON's term: −log(e^{cos(z, zg)/τ} / (e^{cos(z, zg)/τ} + e^{cos(z, zp)/τ})), no gradient to
    the global and previous projections."""
    from flowerbed.losses import model_contrastive

    z, zg, zp = torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 5.0]])
    want = -math.log(math.e ** 2 / (math.e ** 2 + 1))  # cosines 1 and 0 at tau = 0.5
    assert model_contrastive(z, zg, zp, 0.5).item() == pytest.approx(want, rel=1e-6)
    z.requires_grad_(True), zg.requires_grad_(True), zp.requires_grad_(True)
    model_contrastive(z, zg, zp, 0.5).backward()
    assert z.grad is not None and zg.grad is None and zp.grad is None


def test_moon_unsup_loss_by_hand_and_nt_xent_alone_before_a_previous_model():
    """Round 1 (no previous model): FedSimCLR's loss alone. Then NT-Xent + μ·MOON's term, the frozen
    global copy the positive and the filed previous model the negative, at moon-tau (not ssl-tau),
    both copies in eval mode (BatchNorm heads) and without gradient; the term's gradient reaches
    the local model."""
    from flowerbed.clients.moon_unsup import PREVIOUS
    from flowerbed.losses import model_contrastive

    client, model, msg, ctx = make_client("moon-unsup", **{"moon-mu": 2.5, "moon-tau": 0.7,
                                                           "ssl-head-bn": True})
    client.prepare(model, msg)
    x = client.train_data.normalise(client.train_data.x[:8])
    v = client.views(model, x, x.flip(3), None)
    assert client.previous is None
    assert client.loss(model, v, x, x.flip(3), None).item() == pytest.approx(
        nt_xent(v["z1"], v["z2"], client.cfg.ssl_tau).item(), rel=1e-6)
    torch.manual_seed(3)
    ctx.state[PREVIOUS] = to_record(make_ssl_model(client.cfg, client.train_data))
    client.prepare(model, msg)
    assert not client.previous.training and not client.global_model.training
    v = client.views(model, x, x.flip(3), None)
    with torch.no_grad():
        _, zg, _ = client.global_model(torch.cat([x, x.flip(3)]))
        _, zp, _ = client.previous(torch.cat([x, x.flip(3)]))
    z = torch.cat([v["z1"], v["z2"]])
    want = nt_xent(v["z1"], v["z2"], client.cfg.ssl_tau) + 2.5 * model_contrastive(z, zg, zp, 0.7)
    loss = client.loss(model, v, x, x.flip(3), None)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert loss.item() != pytest.approx((nt_xent(v["z1"], v["z2"], client.cfg.ssl_tau)
                                         + 2.5 * model_contrastive(z, zp, zg, 0.7)).item(), rel=1e-3)
    loss.backward()
    assert model.backbone.conv1.weight.grad.abs().sum() > 0
    assert all(p.grad is None for m in (client.global_model, client.previous) for p in m.parameters())


def test_the_probe_leaves_a_feature_dead_on_the_training_set_unscaled():
    """From a review: standardised by std + 1e-6, a unit that is 0 on every training image but
    fires on a test image gave it a value of about a million, and a short probe misread it."""
    from flowerbed.training import linear_probe

    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 2
    informative = (y.float() * 2 - 1).unsqueeze(1) + 0.1 * torch.randn(200, 1, generator=g)
    train_f = torch.cat([informative, torch.zeros(200, 1)], 1)  # column 1: dead on training data
    test_f = train_f.clone()
    test_f[:20, 1] = 3.0  # fires on a few test images
    _, acc = linear_probe(train_f, y, test_f, y, 2, epochs=20, lr=0.1, batch_size=50, seed=0)
    assert acc == 1.0
