"""ATLAS on Fed-ADE's streams: the step-size pool and the weight average by hand, and a whole run
in-process (Hedge moving once a step, the pre-trained model down once, metrics only up)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inprocess import run_inprocess
from methods import EXTRA
from torch import nn

from flowerbed.clients.atlas import weight_average
from flowerbed.config import Config, ConfigError
from flowerbed.results import read_metrics


def test_the_pool_is_the_official_codes_geometric_grid_and_bad_grids_are_refused():
    cfg = Config.from_run_config({"method": "atlas", "num-server-rounds": 4})
    # η_min·2^k while <= η_max, then one more (the first above it)
    assert cfg.atlas_pool() == pytest.approx([1e-5 * 2 ** k for k in range(8)])
    wide = Config.from_run_config({"method": "atlas", "num-server-rounds": 4, "atlas-grid": 10.0})
    assert wide.atlas_pool() == pytest.approx([1e-5, 1e-4, 1e-3, 1e-2])
    for bad, match in [({"atlas-grid": 1.0}, "atlas-grid.*> 1"), ({"atlas-grid": 1.01}, "more than 64"),
                       ({"fedade-lr-min": 0.0}, "fedade-lr-min.*> 0 for ATLAS"),
                       ({"atlas-meta-lr": -1.0}, "atlas-meta-lr"),
                       ({"atlas-combine": "mean"}, "weight | output")]:
        with pytest.raises(ConfigError, match=match):
            Config.from_run_config({"method": "atlas", "num-server-rounds": 4, **bad})
    Config.from_run_config({"method": "fedade", "num-server-rounds": 4, "fedade-lr-min": 0.0})  # Fed-ADE's


def test_weight_average_is_the_hedge_weighted_mean_of_the_parameters_and_buffers():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)) for _ in range(3)]
    for i, m in enumerate(models):
        m[1].running_mean.fill_(float(i))
        m[1].num_batches_tracked.fill_(7 + i)
    log_w = np.log(np.array([1.0, 2.0, 5.0]))  # unnormalised: 1/8, 2/8, 5/8
    out = weight_average(models, log_w, nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    want = sum(w * m[0].weight for w, m in zip([1 / 8, 2 / 8, 5 / 8], models, strict=True))
    assert torch.allclose(out[0].weight, want, atol=1e-6)
    assert torch.allclose(out[1].running_mean, torch.full((2,), 2 / 8 + 2 * 5 / 8))
    assert int(out[1].num_batches_tracked) == 7  # an integer buffer: the first base's


def run(tmp_path, name, method, **more):
    rc = {"num-server-rounds": 4, "test-samples": 200, "min-clients": 2, **EXTRA[method],
          "fedade-rounds-per-step": 2, "method": method, "output-dir": str(tmp_path), "run-name": name,
          "client-state-dir": str(tmp_path / "state"), **more}
    summary = run_inprocess(rc, 3)
    return summary, read_metrics(tmp_path / name)


def test_hedge_moves_once_a_step_and_only_the_first_message_carries_a_model(tmp_path):
    """Step 0: every base is the pre-trained model (uniform weights, and the step's
    predict-then-update accuracy is no adaptation's); step 1: the weights move at the step's first
    round, and stay in its second. The pre-trained model goes down in round 1 only, and replies
    carry metrics only."""
    summary, rows = run(tmp_path, "atlas", "atlas")
    _, still = run(tmp_path, "ade0", "fedade", **{"fedade-lr-mode": "none"})
    assert rows[1]["pre-accuracy"] == still[1]["pre-accuracy"]
    assert summary["mean-accuracy"] is not None
    top = [r["per-client"][p]["train-top-weight"] for r in rows[1:] for p in ("0", "1", "2")]
    assert top[:6] == [0.25] * 6 and all(w > 0.25 for w in top[6:9]) and top[9:] == top[6:9]
    pool = [1e-5, 1e-4, 1e-3, 1e-2]
    assert rows[1]["lr"] == pytest.approx(np.mean(pool)) and rows[3]["lr"] != rows[1]["lr"]
    # 3 x the CNN, then no model
    assert rows[1]["bytes-down"] > 3e6 and max(r["bytes-down"] for r in rows[2:]) < 1000
    assert max(r["bytes-up"] for r in rows[1:]) < 1000


def test_a_diverged_base_is_left_out_of_either_combination_and_a_mixture_evaluates_its_parts():
    """From a review: 0·NaN in the weighted mean (and −inf + NaN in the mixture) let one diverged
    base spoil the combined model for good; Mixture.eval() left its parts in train mode."""
    from flwr.app import Context, RecordDict

    from flowerbed.clients.fedpoe import Mixture
    from flowerbed.registry import METHODS

    for combine in ("weight", "output"):
        cfg = Config.from_run_config({"method": "atlas", "num-server-rounds": 4, **EXTRA["atlas"],
                                      "atlas-combine": combine})
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                      state=RecordDict(), run_config=cfg.to_run_config())
        client = METHODS["atlas"].client(cfg, ctx)
        bases = [client.new_model() for _ in range(3)]
        with torch.no_grad():
            next(bases[1].parameters()).fill_(float("nan"))
        out = client.combined(bases, np.zeros(3)).eval()(torch.zeros(2, 1, 28, 28))
        assert torch.isfinite(out).all(), combine
    parts = [nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)) for _ in range(2)]
    mix = Mixture(parts, np.zeros(2)).eval()
    assert not any(p.training for p in parts)
    assert not any(p.training for p in mix.train().eval().parts) and mix.train().parts[0].training


def test_a_diverged_base_leaves_the_risk_to_the_others():
    """From a review: once one base's risk was NaN (it keeps adapting from NaN parameters), the
    client reported a risk of 0.0 in every later round, a perfect score pulling the mean down."""
    from conftest import StreamClient

    from flowerbed.clients.atlas import BASE

    run = StreamClient({"method": "atlas", "train-samples": 2000, "num-server-rounds": 4,
                        **EXTRA["atlas"], "fedade-rounds-per-step": 2, "fedade-batch": 20,
                        "partition": "dirichlet:0.5", "min-partition-size": 6})
    run.train(1)
    base = run.ctx.state[f"{BASE}0"]
    key = next(k for k in base if base[k].numpy().dtype.kind == "f")
    base[key] = type(base[key])(np.full_like(base[key].numpy(), np.nan))
    m = run.train(3).content["metrics"]
    assert np.isfinite(m["risk"]) and m["risk"] > 0
