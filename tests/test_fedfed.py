"""FedFed: the VAE's split, the loss by hand, exactly what leaves a client, and a whole run
in-process (the FL model untouched while the VAE trains, then FedXDS's main phase on D_g;
resumed in the middle of the VAE rounds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FakeGrid, prepared, sent, train_messages
from flwr.app import ConfigRecord, Context, RecordDict
from inprocess import run_inprocess
from torch.nn import functional as F

from flowerbed import faults
from flowerbed.clients.base import make_model
from flowerbed.clients.fedfed import fedfed_loss, make_fedfed_net
from flowerbed.config import Config, ConfigError, reads
from flowerbed.datasets.federated import train_set
from flowerbed.datasets.loading import STATS
from flowerbed.models.fedfed_vae import FedFedVAE
from flowerbed.privacy import clip_l2, privatise
from flowerbed.registry import METHODS
from flowerbed.results import read_metrics
from flowerbed.training import generator_of, load_record, to_record

SMALL = {"method": "fedfed", "train-samples": 400, "num-server-rounds": 4, "fedxds-warmup-rounds": 2,
         "fedxds-share-fraction": 0.5, "fedxds-noise": "seeded", "fedxds-clip": 3.0}


@pytest.mark.parametrize("shape", [(1, 28), (3, 32)])
def test_the_vae_gives_x_r_of_x_shape_and_is_deterministic_in_eval_mode(shape):
    c, side = shape
    vae = FedFedVAE(c, side)
    x = torch.randn(4, c, side, side)
    x_r, mu, logvar = vae(x)
    assert x_r.shape == x.shape and mu.shape == logvar.shape == (4, 32 * (side // 4) ** 2)
    vae.eval()
    assert torch.equal(vae(x)[0], vae(x)[0])  # z = μ
    vae.train()
    vae.generator = torch.Generator().manual_seed(0)
    first = vae(x)[0]
    vae.generator = torch.Generator().manual_seed(0)
    assert torch.equal(first, vae(x)[0]) and not torch.equal(first, vae(torch.randn_like(x))[0])


def test_the_loss_is_the_weighted_sum_of_its_four_terms():
    cfg = Config.from_run_config({**SMALL, "fedfed-re": 3.0, "fedfed-ce": 2.0, "fedfed-kl": 0.5,
                                  "fedfed-x-ce": 0.25})
    torch.manual_seed(0)
    net = make_fedfed_net(cfg)
    x, y = torch.randn(5, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4])
    out = net.eval()(x)  # z = μ: no draw
    got = fedfed_loss(net, cfg, 0.2, torch.Generator().manual_seed(1))(out, y)
    _, x_r, mu, logvar = out
    noise = torch.randn((5, 1, 28, 28), generator=torch.Generator().manual_seed(1))
    noised = clip_l2(x - x_r, 3.0) + 0.2 * noise
    std = STATS["fashion-mnist"][1][0]  # the reconstruction error in [0, 1] pixels; KL / (B·3·z)
    want = (3.0 * (((x_r - x) * std) ** 2).mean() + 2.0 * F.cross_entropy(net.classifier(noised), y)
            + 0.5 * (-0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum() / (5 * 3 * mu.shape[1]))
            + 0.25 * F.cross_entropy(net.classifier(x), y))
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    got.backward()  # every part learns: the VAE (through x_s and the reconstruction), the classifier
    assert net.vae.encoder[0].weight.grad.abs().sum() > 0 and net.classifier.fc2.weight.grad.abs().sum() > 0


def share_reply(cfg: Config):
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 4},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS["fedfed"].client(cfg, ctx)
    torch.manual_seed(0)
    vae = to_record(make_fedfed_net(cfg))
    out = client.train(sent(3, RecordDict({"arrays": vae, "config": ConfigRecord(
        {"server-round": 2, "fedxds-phase": "share"})})))
    return client, out, vae


def test_what_leaves_the_client_is_its_clipped_noised_x_minus_vae_x_and_nothing_else():
    cfg = Config.from_run_config(SMALL)
    client, out, sent_vae = share_reply(cfg)
    assert set(out.content.array_records) == {"arrays", "shared"}
    # the share round does not train: x_s comes from the federation's VAE, which goes back unchanged
    assert all(np.array_equal(out.content["arrays"][k].numpy(), sent_vae[k].numpy()) for k in sent_vae)
    released = out.content["shared"]["x"].numpy().astype(np.float32)
    net = load_record(make_fedfed_net(cfg), sent_vae).eval()
    data = client.train_data
    idx = np.sort(np.random.default_rng([cfg.seed, 0, 17]).permutation(len(data))[:len(released)])
    x = data.normalise(data.x[idx])
    with torch.no_grad():
        x_s = x - net.vae(x)[0]
    want = privatise(x_s, None, sparsity=0.0, mask_kind="none", clip=3.0, sigma=cfg.fedxds_sigma,
                     generator=generator_of(cfg.seed, 0, 2, 31337)).numpy()
    assert np.allclose(released, want, atol=2e-3)  # float16 on the wire
    assert out.content["shared"]["y"].numpy().tolist() == data.y[idx].tolist()
    # not the images themselves: their norm (about 28) is far above the clip
    assert np.linalg.norm(released.reshape(len(released), -1), axis=1).max() < 3.0 + 0.15 * 28 * 1.5


def test_fedfed_reads_fedxds_sharing_keys_but_not_its_attribution_keys():
    assert all(reads("fedfed", k) for k in ("fedxds-sigma", "fedxds-lambda", "fedfed-re"))
    assert not reads("fedfed", "fedxds-attribution") and not reads("fedfed", "fedxds-mask")
    assert not reads("fedxds", "fedfed-re")
    with pytest.raises(ConfigError, match="fedxds-warmup-rounds"):
        Config.from_run_config({**SMALL, "fedxds-warmup-rounds": 4})
    with pytest.raises(ConfigError, match="fedfed-lr"):
        Config.from_run_config({**SMALL, "fedfed-lr": 0.0})
    with pytest.raises(ConfigError, match="fedfed-kl"):
        Config.from_run_config({**SMALL, "fedfed-kl": -1.0})


def test_the_model_waits_while_the_vae_trains_then_learns_from_d_g_and_a_resume_mid_vae_agrees(tmp_path):
    rc = {**SMALL, "test-samples": 200, "min-clients": 2, "output-dir": str(tmp_path),
          "client-state-dir": str(tmp_path / "state"), "eval-every": 1, "num-server-rounds": 3}
    run_inprocess({**rc, "run-name": "full"}, 3)
    rows = read_metrics(tmp_path / "full")
    # round 1 trains the VAE, round 2 shares: the FL model is the initial one, scored the same
    assert rows[0]["accuracy"] == rows[1]["accuracy"] == rows[2]["accuracy"]
    assert rows[1]["vae-loss"] > 0 and "vae-loss" not in rows[2] and rows[1]["train-loss"] is None
    assert rows[2]["bytes-up"] > rows[1]["bytes-up"]  # the share round's upload
    assert rows[3]["accuracy"] != rows[0]["accuracy"] and rows[3]["has-pool"] == 1
    # crashed after the VAE round, resumed: the checkpoint's VAE makes the same D_g
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess({**rc, "run-name": "halt", "fault-crash-after": 1}, 3)
    run_inprocess({**rc, "run-name": "halt", "resume": str(tmp_path / "halt")}, 3)
    drop = ("seconds",)
    assert ([{k: v for k, v in r.items() if k not in drop} for r in read_metrics(tmp_path / "halt")]
            == [{k: v for k, v in r.items() if k not in drop} for r in rows])


def test_a_vae_round_averages_the_vae_and_keeps_the_model_and_the_main_phase_drops_the_vae():
    cfg = Config.from_run_config({**SMALL, "min-clients": 2})
    s, grid = METHODS["fedfed"].strategy(cfg), FakeGrid([101, 102])
    prepared(s, grid.nodes)
    torch.manual_seed(0)
    model = s.initial_arrays(make_model(cfg, train_set(cfg)))
    first = s.vae
    msgs = train_messages(s, 1, model, grid)
    assert all(set(m.content["arrays"]) == set(first) for m in msgs)  # the VAE goes out, not the model
    replies = [client_reply(cfg, m, i) for i, m in enumerate(msgs)]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is model  # the FL model waits
    assert not all(np.array_equal(s.vae[k].numpy(), first[k].numpy()) for k in first)  # the VAE moved
    share = train_messages(s, 2, model, grid)
    assert share[0].content["arrays"] is s.vae
    s.aggregate_train(2, [client_reply(cfg, m, i) for i, m in enumerate(share)])
    assert s.pool is not None and s.phase(3) == "main"
    main = train_messages(s, 3, model, grid)
    assert main[0].content["arrays"] is model and s.vae is None and "shared" in main[0].content


def client_reply(cfg: Config, msg, partition: int):
    ctx = Context(run_id=1, node_id=msg.metadata.dst_node_id, state=RecordDict(),
                  node_config={"partition-id": partition, "num-partitions": 2},
                  run_config=cfg.to_run_config())
    return METHODS["fedfed"].client(cfg, ctx).train(msg)


def test_a_warm_up_with_no_vae_round_is_warned_about(caplog):
    """From a review: fedxds-warmup-rounds=1 makes round 1 the share round, so clients share the
    features of an untrained VAE (nearly whole images) without a word."""
    from flowerbed.strategies.fedfed import FedFedStrategy

    with caplog.at_level("WARNING", logger="flowerbed"):
        FedFedStrategy(Config.from_run_config({**SMALL, "fedxds-warmup-rounds": 2})).check_setup(3)
        assert "trains no VAE" not in caplog.text
        FedFedStrategy(Config.from_run_config({**SMALL, "fedxds-warmup-rounds": 1})).check_setup(3)
    assert "fedxds-warmup-rounds=1 trains no VAE" in caplog.text
