"""FedXDS: the mask, clipping, noise calibration, attribution methods, and what leaves a client."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from scipy.stats import norm

from flowerbed.attribution import METHODS, attribute
from flowerbed.clients.base import make_model
from flowerbed.config import Config, ConfigError
from flowerbed.datasets.federated import train_set
from flowerbed.models import build_model
from flowerbed.privacy import classic_sigma, clip_l2, epsilon_for, sigma_for, sparsify
from flowerbed.registry import METHODS as ALL_METHODS
from flowerbed.training import to_record
from tests.conftest import FakeGrid, error_reply, prepared, reply, sent, train_messages


@pytest.mark.parametrize("s", [0.0, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("kind", ["binary", "soft"])
def test_mask_keeps_exactly_the_requested_fraction(s, kind):
    heat = torch.randn(6, 28, 28)
    heat[0] = 0.0  # a flat heatmap (all ties) still keeps exactly the requested count
    m = sparsify(heat, s, kind)
    keep = round(28 * 28 * (1 - s))
    support = (sparsify(heat, s, "binary") > 0).reshape(6, -1).sum(1)
    assert (support == keep).all()
    assert ((m >= 0) & (m <= 1)).all()
    if kind == "binary":
        assert set(m.unique().tolist()) <= {0.0, 1.0}
    # kept pixels are the most relevant ones
    flat, mf = heat[1].flatten(), sparsify(heat, s, "binary")[1].flatten()
    if 0 < keep < flat.numel():
        assert flat[mf > 0].min() >= flat[mf == 0].max()


def test_clipping_bounds_every_norm():
    x = torch.randn(20, 1, 28, 28) * torch.linspace(0.01, 10, 20).view(-1, 1, 1, 1)
    c = clip_l2(x, 3.0)
    norms = c.reshape(20, -1).norm(dim=1)
    assert (norms <= 3.0 + 1e-5).all()
    small = x.reshape(20, -1).norm(dim=1) <= 3.0
    assert torch.allclose(c[small], x[small])  # below the bound: unchanged


def analytic_delta(sigma, eps):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity 1 (Balle & Wang, 2018)."""
    return norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)


@pytest.mark.parametrize("eps,delta", [(0.5, 1e-5), (2.0, 1e-5), (8.0, 1e-6)])
def test_sigma_from_epsilon_delta_is_a_valid_gaussian_mechanism(eps, delta):
    s = sigma_for(eps, delta)
    assert analytic_delta(s, eps) <= delta  # the exact privacy curve meets the target
    assert epsilon_for(s, delta) == pytest.approx(eps, rel=0.01)  # round trip through opacus
    if eps < 1:
        assert s <= classic_sigma(eps, delta) * 1.05  # no looser than the textbook bound


@pytest.mark.parametrize("model_name", ["cnn", "resnet8"])
@pytest.mark.parametrize("method", METHODS)
def test_each_attribution_method_runs_on_cnn_and_resnet(model_name, method):
    torch.manual_seed(0)
    model = build_model(model_name, 1, 10, 28)
    x, y = torch.randn(3, 1, 28, 28), torch.tensor([1, 4, 7])
    a = attribute(model, x, y, method)
    assert a.shape == (3, 28, 28) and torch.isfinite(a).all() and a.abs().sum() > 0
    assert not any(hasattr(m, "rule") for m in model.modules())  # LRP rules removed again


@pytest.mark.parametrize("model_name", ["cnn", "resnet8"])
def test_lrp_keeps_its_rules_in_every_batch(model_name):
    """captum removes LRP's rules after each call; batches after the first must still get them
    (with captum's default ε-rule the CNN's LRP would be Input×Gradient, and the ResNet's
    nn.Identity has no default rule at all)."""
    torch.manual_seed(0)
    model = build_model(model_name, 1, 10, 28)
    x, y = torch.randn(6, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4, 5])
    whole = attribute(model, x, y, "lrp", batch_size=6)
    in_batches = attribute(model, x, y, "lrp", batch_size=2)
    assert torch.allclose(whole, in_batches, atol=1e-5)
    assert not any(hasattr(m, "rule") for m in model.modules())


@pytest.mark.parametrize("model_name", ["cnn", "resnet8"])
def test_lrp_first_layer_uses_the_flat_rule(model_name):
    """The paper's EpsilonPlusFlat composite: the relevance reaching the first layer's output is
    spread evenly over each receptive field (unit weights, unit inputs), checked against captum's
    relevance at that layer's output spread by hand; the caller's input is left untouched."""
    from captum.attr import LayerLRP
    from captum.attr._utils.lrp_rules import EpsilonRule

    from flowerbed.attribution import _set_lrp_rules

    torch.manual_seed(0)
    model = build_model(model_name, 1, 10, 28)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([1, 4, 7, 2])
    x0 = x.clone()
    got = attribute(model, x, y, "lrp")
    assert torch.equal(x, x0)
    _set_lrp_rules(model)
    conv = model.conv1
    conv.rule = EpsilonRule()  # any rule: the relevance at conv1's output does not depend on it
    r_out = LayerLRP(model, conv).attribute(x.clone().requires_grad_(True), target=y)
    ones = torch.ones_like(conv.weight)
    z = torch.nn.functional.conv2d(torch.ones_like(x), ones, None, conv.stride, conv.padding)
    want = torch.nn.functional.conv_transpose2d(r_out / z, ones, None, conv.stride,
                                                conv.padding).sum(1)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-4)
    assert torch.allclose(got.sum((1, 2)), r_out.sum((1, 2, 3)), atol=1e-6)  # flat conserves


def test_lrp_first_layer_rule_by_flag():
    """``fedxds-lrp-first='alpha1beta0'`` gives the first layer α1β0 like the other
    convolutions: another map than the flat rule's, and still LRP (not Input×Gradient)."""
    torch.manual_seed(0)
    model = build_model("cnn", 1, 10, 28)
    x, y = torch.randn(2, 1, 28, 28), torch.tensor([0, 1])
    ab = attribute(model, x, y, "lrp", lrp_first="alpha1beta0")
    assert torch.isfinite(ab).all() and ab.abs().sum() > 0
    assert not torch.allclose(ab, attribute(model, x, y, "lrp"), atol=1e-3)
    assert not torch.allclose(ab, attribute(model, x, y, "ixg"), atol=1e-3)
    with pytest.raises(ValueError, match="first-layer rule 'gamma'"):
        attribute(model, x, y, "lrp", lrp_first="gamma")
    with pytest.raises(ConfigError, match="fedxds-lrp-first"):
        Config.from_run_config({"fedxds-lrp-first": "gamma"})


def test_lrp_is_not_input_times_gradient():
    torch.manual_seed(0)
    model = build_model("cnn", 1, 10, 28)
    x, y = torch.randn(2, 1, 28, 28), torch.tensor([0, 1])
    assert not torch.allclose(attribute(model, x, y, "lrp"), attribute(model, x, y, "ixg"), atol=1e-3)


SMALL = {"method": "fedxds", "train-samples": 1000, "test-samples": 100, "batch-size": 32,
         "fedxds-share-fraction": 0.2, "fedxds-sigma": 0.15, "fedxds-sparsity": 0.8}


def share(**extra):
    cfg = Config.from_run_config({**SMALL, **extra})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 4},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = ALL_METHODS["fedxds"].client(cfg, ctx)
    torch.manual_seed(0)  # the same model every call
    model = to_record(make_model(cfg, train_set(cfg)))
    out = client.train(sent(3, RecordDict({"arrays": model, "config": ConfigRecord(
        {"server-round": 3, "fedxds-phase": "share"})})))
    return out.content["shared"]["x"].numpy().astype(np.float32), cfg


# A large clip keeps magnitudes, and a small sigma separates signal from noise: in normalised
# space Fashion-MNIST's background is -0.81, far above 5 sigma = 0.25.
LOUD = {"fedxds-clip": 1e4, "fedxds-sigma": 0.05}


@pytest.mark.parametrize("kind", ["binary", "soft"])
def test_only_masked_and_noised_samples_leave_the_client(kind):
    x, cfg = share(**{"fedxds-mask": kind, **LOUD})
    n, sigma = len(x), cfg.fedxds_sigma
    flat = np.abs(x.reshape(n, -1))
    # masked-out pixels carry noise only: |v| > 5σ happens there with probability ~6e-7
    signal = (flat > 5 * sigma).mean(1)
    assert (signal <= 0.2 + 0.01).all(), "more pixels than the mask keeps carry signal: unmasked?"
    # and that noise is there: the smallest 70 % of values per sample spread like N(0, σ²)
    quiet = np.sort(flat, 1)[:, : int(0.7 * flat.shape[1])]
    assert (quiet.mean(1) > 0.3 * sigma).all(), "masked-out pixels are exactly 0: no noise?"
    unmasked, _ = share(**{"fedxds-mask": "none", **LOUD})  # the baseline is caught by the same check
    assert ((np.abs(unmasked.reshape(n, -1)) > 5 * sigma).mean(1) > 0.2).all()


def test_the_server_cannot_regenerate_the_noise():
    """Regression: the noise was drawn from (seed, partition, round), all in the run config, so
    the server could rebuild it and subtract it exactly. By default it now comes from the OS;
    'seeded' (reproducible runs) says so."""
    first, _ = share(**LOUD)
    again, _ = share(**LOUD)  # the same client, model, samples and round
    assert np.abs(first - again).mean() > 0.5 * LOUD["fedxds-sigma"]  # fresh noise each time
    seeded = [share(**LOUD, **{"fedxds-noise": "seeded"})[0] for _ in range(2)]
    assert np.array_equal(*seeded)
    from flowerbed.strategies.fedxds import FedXDSStrategy  # config.json claims no ε for it

    plain = FedXDSStrategy(Config.from_run_config(SMALL)).describe()
    assert plain["fedxds-epsilon-per-unit-l2"] > 0
    told = FedXDSStrategy(Config.from_run_config({**SMALL, "fedxds-noise": "seeded"})).describe()
    assert told["fedxds-epsilon-per-unit-l2"] is None and "no privacy" in told["fedxds-epsilon-note"]
    with pytest.raises(ConfigError, match="'fedxds-sparsity' = 0.9995"):  # would keep no pixel
        Config.from_run_config({**SMALL, "fedxds-sparsity": 0.9995})


def test_a_repeated_share_round_resends_the_same_release(tmp_path):
    """Two releases of the same images with independent noise add up to σ/√2; the recorded ε is
    for one. A retried share round, or one a resumed run repeats because the server died before
    its checkpoint, gets the first release again: filed once, before it leaves, beside the
    client's state but not in it (context.state is carried with every message and filed every
    round; the release is up to hundreds of MB on SVHN)."""
    from flowerbed import client_state
    from flowerbed.clients.fedxds import RELEASE_FILE, RELEASED

    cfg = Config.from_run_config({**SMALL, **LOUD, "client-state-dir": str(tmp_path)})

    def context(state=None):
        return Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 4},
                       state=state or RecordDict(), run_config=cfg.to_run_config())

    ctx = context()
    model = to_record(make_model(cfg, train_set(cfg)))

    def ask(c, run_key="run-a"):
        return ALL_METHODS["fedxds"].client(cfg, c).train(sent(3, RecordDict({"arrays": model, "config": (
            ConfigRecord({"server-round": 3, "fedxds-phase": "share", "run-key": run_key}))}))
        ).content["shared"]["x"].numpy()

    first = ask(ctx)
    filed = tmp_path / "run-a" / "partition-0" / RELEASE_FILE
    assert filed.is_file() and not ctx.state.array_records  # filed, not in the context
    assert np.array_equal(first, ask(ctx))  # retried in the same run
    client_state.save(cfg, ctx, "run-a", 0, 3)  # filed after round 3, then the server died
    assert (tmp_path / "run-a" / "partition-0" / "round-3.attempt-0.pt").stat().st_size < 10_000
    resumed = context()
    client_state.restore(cfg.replace(resume="x"), resumed, "run-a", 0, 3)  # resumes at round 3
    assert np.array_equal(first, ask(resumed))
    filed.write_bytes(b"damaged")  # never a second draw in its place
    with pytest.raises(RuntimeError, match="fedxds-release.pt is unreadable.*weaken the stated"):
        ask(context())
    # a release an older flowerbed filed with the client's state is re-sent, and moved to the file
    older = context(RecordDict({RELEASED: ArrayRecord({"x": Array(first), "y": Array(np.zeros(
        len(first), np.int64))})}))
    assert np.array_equal(first, ask(older, "run-b")) and not older.state.array_records
    assert (tmp_path / "run-b" / "partition-0" / RELEASE_FILE).is_file()
    assert not np.array_equal(first, ask(context(), "run-c"))  # another run draws its own


def test_a_release_survives_a_rename_a_broken_copy_and_a_concurrent_draw(tmp_path, monkeypatch):
    """From a review of the release file: (1) a renamed run copies its clients' folders to the new
    name; a copy cut short (a full disk) left a folder without the release, and the repeated
    share round drew again. The copy is now whole or absent, and the release is also looked up
    under the run's former name. (2) Two handlers of one partition at once (a hung one of the
    crashed attempt, say) both drew and the second replaced the first on disk, after both were
    sent: the first filed is the one both send. (3) A release an older flowerbed kept in the
    filed state leaves the context in any round, not only a repeated share round."""
    import shutil

    from flowerbed import client_state
    from flowerbed.clients.fedxds import RELEASE_FILE, RELEASED

    cfg = Config.from_run_config({**SMALL, **LOUD, "client-state-dir": str(tmp_path)})
    model = to_record(make_model(cfg, train_set(cfg)))

    def context(state=None):
        return Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 4},
                       state=state or RecordDict(), run_config=cfg.to_run_config())

    def ask(c, run_key, phase="share", client_cfg=cfg):
        reply = ALL_METHODS["fedxds"].client(client_cfg, c).train(sent(3, RecordDict({
            "arrays": model, "config": ConfigRecord({"server-round": 3, "fedxds-phase": phase,
                                                     "run-key": run_key})})))
        return reply.content["shared"]["x"].numpy() if phase == "share" else reply

    first = ask(context(), "r-0123abcdef")
    client_state.save(cfg, context(), "r-0123abcdef", 0, 3)
    copytree = shutil.copytree

    def full_disk(src, dst, **kw):
        if str(src).endswith(RELEASE_FILE):
            raise OSError(28, "No space left on device")
        return shutil.copy2(src, dst, **kw)

    monkeypatch.setattr(shutil, "copytree", lambda *a, **kw: copytree(*a, **kw, copy_function=full_disk))
    resumed, resumed_cfg = context(), cfg.replace(resume="x")
    client_state.restore(resumed_cfg, resumed, "moved-0123abcdef", 0, 3)
    monkeypatch.setattr(shutil, "copytree", copytree)
    assert not (tmp_path / "moved-0123abcdef" / "partition-0").exists()  # no half copy
    assert not list((tmp_path / "moved-0123abcdef").glob(".partition-0*"))
    assert np.array_equal(first, ask(resumed, "moved-0123abcdef", client_cfg=resumed_cfg))
    # and kept under the new name too: the former name's folder may be deleted as a leftover
    shutil.rmtree(tmp_path / "r-0123abcdef")
    assert np.array_equal(first, ask(context(), "moved-0123abcdef", client_cfg=resumed_cfg))
    # (2) another handler files its draw while this one draws: this one sends that one
    from flowerbed.clients.fedxds import FedXDSClient

    drawn = FedXDSClient.shared_samples

    draws = []

    def raced(self, m, rnd):
        draws.append(drawn(self, m, rnd))  # this handler's
        draws.append(drawn(self, m, rnd))  # the other handler's, filed first
        self._file_release("r-race", draws[-1])
        return draws[0]

    monkeypatch.setattr(FedXDSClient, "shared_samples", raced)
    sent_here = ask(context(), "r-race")
    filed = torch.load(tmp_path / "r-race" / "partition-0" / RELEASE_FILE)["x"].numpy()
    assert np.array_equal(sent_here, filed) and np.array_equal(sent_here, draws[1]["x"].numpy())
    assert not np.array_equal(sent_here, draws[0]["x"].numpy())
    monkeypatch.setattr(FedXDSClient, "shared_samples", drawn)
    # (3) restored with an older flowerbed's state, asked a main round: filed, out of the context
    older = context(RecordDict({RELEASED: ArrayRecord({"x": Array(first), "y": Array(np.zeros(
        len(first), np.int64))})}))
    ask(older, "r-older", phase="warmup")
    assert not older.state.array_records
    assert np.array_equal(first, ask(context(), "r-older"))


def test_d_g_is_kept_in_one_file_not_in_the_context(tmp_path):
    """D_g (tens to hundreds of MB) used to sit in context.state: carried with every message
    Flower passes a context, and filed again with the client's state every round. It is now
    written once beside that state, the context holding its digest; a client whose file is
    gone says it holds no D_g, so the server sends it again."""
    from flowerbed import client_state

    cfg = Config.from_run_config({**SMALL, "client-state-dir": str(tmp_path)})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 4},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = ALL_METHODS["fedxds"].client(cfg, ctx)
    model = to_record(make_model(cfg, train_set(cfg)))
    pool = ArrayRecord({"x": Array(np.zeros((40, 1, 28, 28), np.float16)),
                        "y": Array(np.arange(40, dtype=np.int64) % 10)})

    def main_round(rnd, **shared):
        return client.train(sent(3, RecordDict({"arrays": model, **shared, "config": ConfigRecord(
            {"server-round": rnd, "fedxds-phase": "main", "run-key": "run-a"})})))

    assert main_round(4, shared=pool).content["metrics"]["has-pool"] == 1
    assert not ctx.state.array_records  # nothing of D_g in the context
    (kept,) = tmp_path.glob("run-a/fedxds-pool-*.pt")
    client_state.save(cfg, ctx, "run-a", 0, 4)
    assert (tmp_path / "run-a" / "partition-0" / "round-4.attempt-0.pt").stat().st_size < 10_000
    assert main_round(5).content["metrics"]["has-pool"] == 1  # from the file
    kept.unlink()
    lost = main_round(6).content  # without D_g it does not train (from a review: it did, without
    # the shared term, and that update was averaged); the server refuses the reply (below)
    assert lost["metrics"]["has-pool"] == 0 and "train-loss" not in lost["metrics"]
    assert np.array_equal(lost["arrays"]["conv1.weight"].numpy(), model["conv1.weight"].numpy())
    from flowerbed.strategies.fedxds import FedXDSStrategy

    s = FedXDSStrategy(cfg)
    s.pool = pool
    reason = s.check_reply(reply(sent(3), RecordDict({"arrays": model, "metrics": lost["metrics"]})), True)
    assert "holds no D_g" in reason
    assert s.check_reply(reply(sent(3), main_round(4, shared=pool).content), True) is None
    kept.unlink()
    # a damaged file (a crash mid-write, a full disk) counts as missing, and goes: the resent
    # D_g is written afresh (it used to be kept, so the client failed every round after)
    assert main_round(7, shared=pool).content["metrics"]["has-pool"] == 1
    kept.write_bytes(b"PK\x03\x04 half a zip")
    from flowerbed.clients import fedxds as fedxds_client

    fedxds_client._load_pool.cache_clear()  # a new process (a deployed ClientApp per message)
    assert main_round(8).content["metrics"]["has-pool"] == 0 and not kept.exists()
    assert main_round(9, shared=pool).content["metrics"]["has-pool"] == 1


def test_noise_is_mandatory():
    with pytest.raises(ConfigError, match="'fedxds-sigma'.*noise is mandatory"):
        Config.from_run_config({**SMALL, "fedxds-sigma": 0.0})
    cfg = Config.from_run_config({**SMALL, "fedxds-sigma": 0.0, "fedxds-epsilon": 4.0})
    assert cfg.resolved_sigma() == pytest.approx(sigma_for(4.0, 1e-5))


def test_sharing_needs_a_warm_up_round():
    """Clients share in the last warm-up round; with none D_g would never exist."""
    with pytest.raises(ConfigError, match="'fedxds-warmup-rounds' = 0 is invalid"):
        Config.from_run_config({**SMALL, "fedxds-warmup-rounds": 0})


def test_every_client_shares_whatever_fraction_trains():
    from flowerbed.strategies.fedxds import FedXDSStrategy

    cfg = Config.from_run_config({**SMALL, "fraction-train": 0.5, "min-clients": 1,
                                  "fedxds-warmup-rounds": 2})
    s, grid = FedXDSStrategy(cfg), FakeGrid([101, 102, 103, 104])
    prepared(s, grid.nodes)
    arrays = to_record(make_model(cfg, train_set(cfg)))
    sizes = [len(list(s.configure_train(r, arrays, ConfigRecord(), grid))) for r in (1, 2, 3)]
    assert sizes == [2, 4, 2]  # warm-up, share (everyone), main


def client_reply(cfg: Config, msg, partition: int, num_partitions: int = 2):
    """The real FedXDS client's answer to ``msg`` (fresh state)."""
    ctx = Context(run_id=1, node_id=msg.metadata.dst_node_id, state=RecordDict(),
                  node_config={"partition-id": partition, "num-partitions": num_partitions},
                  run_config=cfg.to_run_config())
    return ALL_METHODS["fedxds"].client(cfg, ctx).train(msg)


def test_every_released_upload_is_pooled_even_when_the_round_is_skipped():
    """Fewer valid replies than min-clients: the model is kept, but the samples that did arrive
    are pooled (asking again would release them a second time, with fresh noise); no retry."""
    from flowerbed.strategies.fedxds import FedXDSStrategy, check_shared

    cfg = Config.from_run_config({**SMALL, "min-clients": 2, "fedxds-warmup-rounds": 1,
                                  "num-server-rounds": 3})
    s, grid = FedXDSStrategy(cfg), FakeGrid([101, 102])
    prepared(s, grid.nodes)
    arrays = s.initial_arrays(make_model(cfg, train_set(cfg)))
    msgs = train_messages(s, 1, arrays, grid)
    ok = client_reply(cfg, msgs[1], 1)
    n = len(ok.content["shared"]["y"].numpy())
    assert s.aggregate_train(1, [error_reply(msgs[0]), ok]) == (None, None)  # < min-clients
    assert s.pool is not None and len(s.pool["y"].numpy()) == n and s.phase(2) == "main"
    assert "shared" not in ok.content  # stripped: FedAvg would see the model only
    bad = ArrayRecord({"x": Array(np.zeros((2, 3, 32, 32), np.float16)),
                       "y": Array(np.zeros(2, np.int64))})
    assert "fashion-mnist's are (1, 28, 28)" in check_shared(bad, "fashion-mnist")


def test_who_holds_d_g_is_learnt_from_a_skipped_round_too():
    """A main round with fewer than min-clients valid replies: the clients that did reply and
    now hold D_g were forgotten, and D_g (600 MB per client on CIFAR-10) was sent again."""
    from flowerbed.strategies.fedxds import FedXDSStrategy

    cfg = Config.from_run_config({**SMALL, "min-clients": 3, "num-server-rounds": 6})
    s = FedXDSStrategy(cfg)
    msgs = prepared(s, [11, 12, 13])
    s._reference = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    replies = [reply(m, RecordDict({"arrays": s._reference, "metrics": MetricRecord(
        {"num-examples": 5, "train-loss": 0.1, "has-pool": 1})})) for m in msgs[:2]]
    assert s.aggregate_train(5, replies) == (None, None) and s.round.skipped
    assert s.has_pool == {0, 1}
    # a node that takes partition 1 over holds none of the old node's files: it gets D_g
    # (from a review: it trained main rounds without the shared term until it said so)
    s.pool = ArrayRecord({"x": Array(np.zeros((1, 1, 28, 28), np.float16)),
                          "y": Array(np.zeros(1, np.int64))})
    main = RecordDict({"config": ConfigRecord({"fedxds-phase": "main"})})
    assert "shared" not in s.content_for(12, main)
    s.node_of[1], s.partition_of[14] = 14, 1
    assert "shared" in s.content_for(14, main)
    # a reply refused for its model still says whether the client holds D_g (from a review:
    # a client that diverged got D_g again; one that lost it was not known to need it)
    s.node_of[1], s.partition_of[12] = 12, 1
    msgs = prepared(s, [11, 12, 13])
    nan = ArrayRecord({"w": Array(np.full(2, np.nan, np.float32))})
    replies = [reply(m, RecordDict({"arrays": arrays, "metrics": MetricRecord(
        {"num-examples": 5, "train-loss": 0.1, "has-pool": flag})}))
        for m, arrays, flag in ((msgs[1], nan, 1), (msgs[0], nan, 0))]
    s.take_round_log()
    s.aggregate_train(6, replies)
    assert len(s.round.failed) == 3 and s.has_pool == {1}  # (and partition 2 never replied)


def test_a_share_round_without_valid_uploads_is_repeated_in_the_next_round():
    """Every client fails in the share round: the next round asks everyone to share again (and
    is not a main round that runs without D_g); the retried share pools D_g, the round after
    it is the first main round (restarted from the initial weights) and sends D_g."""
    from flowerbed.strategies.fedxds import FedXDSStrategy

    cfg = Config.from_run_config({**SMALL, "fraction-train": 0.5, "min-clients": 1,
                                  "fedxds-warmup-rounds": 2, "num-server-rounds": 5})
    s, grid = FedXDSStrategy(cfg), FakeGrid([101, 102])
    prepared(s, grid.nodes)
    initial = s.initial_arrays(make_model(cfg, train_set(cfg)))
    warm = ArrayRecord({k: Array(v.numpy() + 1.0) for k, v in initial.items()})

    msgs = train_messages(s, 2, warm, grid)
    assert [m.content["config"]["fedxds-phase"] for m in msgs] == ["share", "share"]
    assert s.aggregate_train(2, [error_reply(m) for m in msgs]) == (None, None)
    assert s.pool is None and s.phase(3) == "share" and s.phase(4) == "main"

    msgs = train_messages(s, 3, warm, grid)
    assert len(msgs) == 2 and {m.content["config"]["fedxds-phase"] for m in msgs} == {"share"}
    replies = [client_reply(cfg, m, i) for i, m in enumerate(msgs)]
    arrays, _ = s.aggregate_train(3, replies)
    assert arrays is not None and s.pool is not None and s.checkpoint_state()["share_round"] == 3

    msgs = train_messages(s, 4, warm, grid)
    assert {m.content["config"]["fedxds-phase"] for m in msgs} == {"main"}
    assert all("shared" in m.content for m in msgs)
    for m in msgs:  # fedxds-init = scratch: the first main round restarts from the initial weights
        assert all(np.array_equal(m.content["arrays"][k].numpy(), v.numpy())
                   for k, v in initial.items())


def test_shared_labels_must_be_class_indices():
    """Labels outside the classes, or not integers, or an empty upload, are refused before they
    reach D_g (where every client's cross-entropy would fail in every main round)."""
    from flowerbed.strategies.fedxds import check_shared

    def upload(y, n=None):
        n = len(y) if n is None else n
        return ArrayRecord({"x": Array(np.zeros((n, 1, 28, 28), np.float16)), "y": Array(np.asarray(y))})

    assert check_shared(upload(np.array([0, 9], np.int64)), "fashion-mnist") is None
    assert "outside 0..9" in check_shared(upload(np.array([99, 2], np.int64)), "fashion-mnist")
    assert "outside 0..9" in check_shared(upload(np.array([-7, 2], np.int64)), "fashion-mnist")
    assert "dtype float64" in check_shared(upload(np.array([1.0, 2.5])), "fashion-mnist")
    assert check_shared(upload(np.zeros(0, np.int64)), "fashion-mnist") == "no shared samples"


def test_a_skipped_first_main_round_still_restarts_from_the_initial_weights():
    """fedxds-init = scratch: when the first main round has too few valid replies, the model
    still moves to the initial weights, so the next round does not train the warm-up model."""
    from flowerbed.strategies.fedxds import FedXDSStrategy

    cfg = Config.from_run_config({**SMALL, "min-clients": 1, "fedxds-warmup-rounds": 1,
                                  "num-server-rounds": 4})
    s, grid = FedXDSStrategy(cfg), FakeGrid([101, 102])
    prepared(s, grid.nodes)
    initial = s.initial_arrays(make_model(cfg, train_set(cfg)))
    warm = ArrayRecord({k: Array(v.numpy() + 1.0) for k, v in initial.items()})
    msgs = train_messages(s, 1, warm, grid)
    assert s.aggregate_train(1, [client_reply(cfg, m, i) for i, m in enumerate(msgs)])[0] is not None
    msgs = train_messages(s, 2, warm, grid)  # the first main round: every client fails
    arrays, _ = s.aggregate_train(2, [error_reply(m) for m in msgs])
    assert arrays is initial
    msgs = train_messages(s, 3, warm, grid)  # no second reset: round 3 sends what it is given
    assert all(np.array_equal(m.content["arrays"][k].numpy(), warm[k].numpy())
               for m in msgs for k in warm)


def test_calibrating_sigma_leaves_the_root_logger_alone():
    """opacus' import called logging.basicConfig, and every Flower line was printed twice."""
    import logging

    before = list(logging.getLogger().handlers)
    sigma_for(2.0, 1e-5)
    assert logging.getLogger().handlers == before


def test_lrp_on_a_resnet_does_not_depend_on_the_batch():
    """BatchNorm had captum's default ε-rule, which divides by near-zero inputs: in float32 a
    sample's relevance changed by 1.7 % with the batch it was attributed in, and the relevance
    sums were 100x the logits. It now passes relevance through (identity)."""
    torch.manual_seed(0)
    model = build_model("resnet8", 3, 10, 32)
    model.train()
    model(torch.randn(16, 3, 32, 32))  # BatchNorm statistics that are not the defaults
    x, y = torch.randn(5, 3, 32, 32), torch.tensor([0, 1, 2, 3, 4])
    batched, single = (attribute(model, x, y, "lrp", batch_size=b) for b in (5, 1))
    assert (batched - single).abs().max() <= 1e-4 * single.abs().max()


def test_lrp_splits_the_relevance_at_a_residual_sum():
    """From a review: the ResNet's residual ``out + shortcut(x)`` was functional, so captum gave
    each branch the whole relevance and the sum came to about 7x the logit on resnet8; with the
    sum as a module (ε-rule, as captum's Addition_Module) it stays near the logit."""
    torch.manual_seed(0)
    model = build_model("resnet8", 3, 10, 32)
    with torch.no_grad():
        model.linear.bias.zero_()  # no relevance absorbed by the classifier's bias
    model.train()
    model(torch.randn(64, 3, 32, 32))
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        logits = model(x)
    y = logits.argmax(1)
    ratio = attribute(model, x, y, "lrp").flatten(1).sum(1) / logits[range(4), y]
    assert ((ratio > 0.5) & (ratio < 1.5)).all(), ratio


# ------------------------------------------------ found by a mutation review (session 37)


def test_privatise_clips_before_it_adds_the_noise():
    """P1/P2: the released sample is clip(mask * x) + N(0, sigma^2): clipping bounds the
    sensitivity the noise is calibrated for. No clip (P1) or clipping the noisy sample (P2)
    breaks the (epsilon, delta) claim."""
    from flowerbed.privacy import clip_l2, privatise, sparsify

    torch.manual_seed(0)
    x, heat = 50 * torch.randn(4, 1, 8, 8), torch.rand(4, 8, 8)
    out = privatise(x, heat, sparsity=0.5, mask_kind="binary", clip=1.0, sigma=0.5,
                    generator=torch.Generator().manual_seed(7))
    signal = clip_l2(x * sparsify(heat, 0.5, "binary").unsqueeze(1), 1.0)
    noise = 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(out, signal + noise, atol=1e-6)


def test_noise_is_the_seeded_cpu_draw_wherever_the_sample_lies():
    """The noise comes from the seeded CPU generator and is added on the sample's device: on a
    GPU, FedFed's every training step noises x_s there (it had copied x_s to the CPU and back).
    The meta device stands in for CUDA (the CPU draw added to it raised there, as on CUDA)."""
    from flowerbed.privacy import add_noise

    out = add_noise(torch.zeros(2, 3, device="meta"), 0.5, torch.Generator().manual_seed(7))
    assert out.device.type == "meta" and out.shape == (2, 3)
    x = torch.ones(2, 3)
    want = x + 0.5 * torch.randn(2, 3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(add_noise(x, 0.5, torch.Generator().manual_seed(7)), want)


def test_shared_labels_equal_to_the_class_count_are_refused():
    """P3: label 10 is outside fashion-mnist's 0..9 (off-by-one at the upper bound)."""
    from flowerbed.strategies.fedxds import check_shared

    up = ArrayRecord({"x": Array(np.zeros((2, 1, 28, 28), np.float16)),
                      "y": Array(np.array([0, 10], np.int64))})
    assert "outside 0..9" in check_shared(up, "fashion-mnist")
