"""FedProtoCL: the prototype term by hand, k-means, PCL's concentration, warm-up, cluster counts."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from flowerbed.clients.fedprotocl import concentration, kmeans
from flowerbed.config import Config, ConfigError
from flowerbed.losses import proto_nce
from tests.conftest import sent
from tests.test_fedx import make_client


def test_proto_nce_by_hand():
    q = torch.tensor([[1.0, 0.0]], requires_grad=True)
    protos = torch.tensor([[2.0, 0.0], [0.0, 1.0]])  # normalised inside
    phi = torch.tensor([0.5, 1.0])
    # logits: 1/0.5 = 2 for the own prototype, 0/1 = 0 for the other
    want = -math.log(math.e ** 2 / (math.e ** 2 + 1))
    loss = proto_nce(q, protos, phi, torch.tensor([0]))
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert q.grad is not None  # the query learns; prototypes and φ are constants
    assert proto_nce(q, protos, phi, torch.tensor([1])).item() == pytest.approx(
        -math.log(1 / (math.e ** 2 + 1)), rel=1e-6)


def test_kmeans_recovers_separated_clusters_and_is_seeded():
    gen = torch.Generator().manual_seed(0)
    centres = torch.tensor([[10.0, 0.0], [0.0, 10.0], [-10.0, -10.0]])
    x = torch.cat([c + torch.randn(30, 2, generator=gen) for c in centres])
    c, assign = kmeans(x, 3, torch.Generator().manual_seed(1))
    groups = [set(assign[i * 30:(i + 1) * 30].tolist()) for i in range(3)]
    assert all(len(g) == 1 for g in groups) and len(set.union(*groups)) == 3
    for i, g in enumerate(groups):
        assert torch.allclose(c[g.pop()], x[i * 30:(i + 1) * 30].mean(0), atol=1e-5)
    c2, assign2 = kmeans(x, 3, torch.Generator().manual_seed(1))
    assert torch.equal(c, c2) and torch.equal(assign, assign2)


def test_kmeans_refills_an_empty_cluster():
    x = torch.tensor([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5)  # 2 distinct points, 3 clusters
    c, assign = kmeans(x, 3, torch.Generator().manual_seed(0))
    assert c.shape == (3, 2) and torch.isfinite(c).all() and set(assign.tolist()) <= {0, 1, 2}


def pcl_density(x: np.ndarray, c: np.ndarray, assign: np.ndarray, tau: float) -> np.ndarray:
    """salesforce/PCL main_pcl.py run_kmeans' concentration, transcribed (faiss gives squared
    distances; PCL takes their square roots)."""
    k = len(c)
    dcluster = [[] for _ in range(k)]
    for i, j in enumerate(assign):
        dcluster[j].append(((x[i] - c[j]) ** 2).sum())
    density = np.zeros(k)
    for i, dist in enumerate(dcluster):
        if len(dist) > 1:
            density[i] = (np.asarray(dist) ** 0.5).mean() / np.log(len(dist) + 10)
    dmax = density.max()
    for i, dist in enumerate(dcluster):
        if len(dist) <= 1:
            density[i] = dmax
    density = density.clip(np.percentile(density, 10), np.percentile(density, 90))
    return tau * density / density.mean()


def test_concentration_matches_pcls_code():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(60, 4, generator=gen, dtype=torch.float64)
    c, assign = kmeans(x, 7, torch.Generator().manual_seed(0))
    assign[5] = 6  # make cluster 6 a single sample: it takes the largest φ
    assign[assign == 6] = 5
    assign[5] = 6
    want = pcl_density(x.numpy(), c.numpy(), assign.numpy(), 0.1)
    got = concentration(x, c, assign, 0.1)
    assert np.allclose(got.numpy(), want, rtol=1e-9) and got.mean().item() == pytest.approx(0.1)
    # a collapsed encoder (every distance 0) gets tau everywhere, not 0/0
    flat = torch.zeros(20, 4, dtype=torch.float64)
    assert torch.equal(concentration(flat, flat[:2], torch.tensor([0, 1] * 10), 0.2),
                       torch.full((2,), 0.2, dtype=torch.float64))


def test_a_cluster_of_identical_features_gets_no_vanishing_temperature():
    """From a review: 4 tight clusters (identical vectors) and a spread one, k = 5: the percentile
    clip left φ near 1e-6 for the tight ones and the prototype term near 2e5."""
    gen = torch.Generator().manual_seed(0)
    tight = torch.eye(8)[:4].repeat_interleave(20, 0)
    spread = torch.nn.functional.normalize(torch.randn(20, 8, generator=gen) + 3 * torch.eye(8)[5], dim=1)
    x = torch.cat([tight, spread])
    c, assign = kmeans(x, 5, torch.Generator().manual_seed(0))
    phi = concentration(x, c, assign, 0.1)
    assert phi.min() >= 0.1 * 0.1 * 0.5 and phi.mean().item() == pytest.approx(0.1)
    loss = proto_nce(x, c, phi, assign)
    assert torch.isfinite(loss) and loss.item() < 50


def test_cluster_counts_are_parsed_and_capped():
    with pytest.raises(ConfigError, match="protocl-clusters"):
        Config.from_run_config({"method": "fedprotocl", "protocl-clusters": "25,x"})
    with pytest.raises(ConfigError, match="protocl-clusters"):
        Config.from_run_config({"method": "fedprotocl", "protocl-clusters": "1,5"})
    with pytest.raises(ConfigError, match="quote it, protocl-clusters='25'"):  # -c protocl-clusters=25
        Config.from_run_config({"method": "fedprotocl", "protocl-clusters": 25})
    assert Config.from_run_config({"method": "fedprotocl", "protocl-clusters": "25"}).protocl_ks() == (25,)
    # a warm-up as long as the run: the prototypes would never be used
    for method, extra in (("fedprotocl", {}), ("fedx", {"fedx-base": "protocl"})):
        with pytest.raises(ConfigError, match="protocl-warmup-rounds.*no round would use the prototypes"):
            Config.from_run_config({"method": method, "num-server-rounds": 1, **extra})
    Config.from_run_config({"method": "fedprotocl", "num-server-rounds": 1, "protocl-warmup-rounds": 0})
    Config.from_run_config({"method": "fedx", "num-server-rounds": 1})  # over SimCLR: not read
    client, *_ = make_client("fedprotocl", **{"protocl-clusters": "5,25,50,100"})
    n = len(client.train_data)  # 237 of the 400 samples: at most n // 10 = 23 clusters
    assert n == 237 and client.cluster_counts() == [5, 23]


def round_two(msg):
    return sent(7, RecordDict({"arrays": msg.content["arrays"], "config": ConfigRecord({"server-round": 2})}))


def test_warm_up_is_fedmoco_then_prototypes_join_every_epoch():
    """In a warm-up round FedProtoCL is FedMoCo to the bit; after it, each epoch clusters the
    client's data anew, without drawing from the RNG the augmentations use."""
    moco, _, msg, _ = make_client("fedmoco")
    proto, *_ = make_client("fedprotocl", **{"protocl-clusters": "4,8"})
    want, got = moco.train(msg), proto.train(msg)  # round 1: the default single warm-up round
    assert not proto.protos
    assert got.content["metrics"]["train-loss"] == want.content["metrics"]["train-loss"]
    for k in want.content["arrays"]:
        assert np.array_equal(want.content["arrays"][k].numpy(), got.content["arrays"][k].numpy()), k

    later, _, msg3, ctx = make_client("fedprotocl", **{"protocl-clusters": "4,8", "local-epochs": 2})
    seen, cluster = [], later.before_epoch

    def spy(model):
        cluster(model)
        seen.append([a.clone() for *_, a in later.protos])

    later.before_epoch = spy
    out = later.train(round_two(msg3))
    assert len(seen) == 2  # once per local epoch
    for a, k in zip(seen[0], (4, 8), strict=True):
        assert len(a) == len(later.train_data) and int(a.max()) < k
    moco2, *_ = make_client("fedmoco", **{"local-epochs": 2})
    # the prototype terms (each >= 0) are added to MoCo's loss
    loss = out.content["metrics"]["train-loss"]
    assert loss > moco2.train(round_two(msg3)).content["metrics"]["train-loss"] + 1  # about 12.6 vs 10.2
    assert {"moco.key", "moco.queue"} <= set(ctx.state.array_records)  # FedMoCo's state, no more
    assert len(ctx.state.array_records) == 2
