"""FedXDS's shared data under attack: membership inference and feature inversion, masked vs
unmasked at the same noise sigma, on Fashion-MNIST (in one process; no federation needed).

1. An attribution model is trained on a "client" set A (the warm-up stand-in).
2. A disjoint set S is privatised with flowerbed's own pipeline: attribution mask (LRP, s = 0.8)
   + clipping + N(0, sigma^2) ("masked"), or clipping + noise only ("unmasked").
3. Membership inference (loss threshold): a model is trained on a local set L plus
   lambda * CE on the shared S; the attack scores S's *original* images (members through
   sharing) against unseen test images by -loss; we report the AUC (0.5 = no leak).
4. Feature inversion: a small conv decoder learns shared -> original on pairs from one half of
   S and reconstructs the other half; we report the mean SSIM (lower = harder to invert).
5. The same for FedFed's shared features at the same sigma and clip (the FedXDS paper's
   comparison): a FedFed VAE and its classifier trained on A with FedFed's loss, then
   x_s = x - VAE(x) of S, clipped and noised ("fedfed"); and the attack open to FedFed's server,
   which holds the VAE: x <- x_s + VAE(x), iterated ("vae-inversion-ssim").
Usage: .venv/bin/python -m benchmarks.fedxds_privacy [--n 3000] [--epochs 3]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.functional.classification import binary_auroc
from torchmetrics.functional.image import structural_similarity_index_measure as ssim

from benchmarks.common import run_main, write_result
from flowerbed.attribution import attribute
from flowerbed.cli import int_in
from flowerbed.clients.fedfed import fedfed_loss, make_fedfed_net
from flowerbed.config import Config, ConfigError
from flowerbed.datasets.loading import load_dataset
from flowerbed.models import build_model
from flowerbed.privacy import epsilon_for, privatise
from flowerbed.training import evaluate, train_epochs


def decoder() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(32, 1, 3, padding=1))


def invert_ssim(shared: torch.Tensor, orig: torch.Tensor, epochs: int, seed: int) -> float:
    """Train shared -> original on the first half, SSIM of reconstructions on the second."""
    torch.manual_seed(seed)
    half = len(shared) // 2
    dec = decoder()
    opt = torch.optim.Adam(dec.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs * 4):
        for idx in torch.randperm(half, generator=g).split(64):
            opt.zero_grad()
            F.mse_loss(dec(shared[idx]), orig[idx]).backward()
            opt.step()
    with torch.no_grad():
        rec = dec(shared[half:])
    return pixel_ssim(rec, orig[half:], orig)


def pixel_ssim(rec: torch.Tensor, target: torch.Tensor, ref: torch.Tensor) -> float:
    """SSIM of reconstructions against their originals, both mapped to [0, 1] by ``ref``'s pixel
    range, the reconstructions clamped to it (an attacker clips to valid pixels)."""
    lo, hi = ref.min(), ref.max()
    return float(ssim(((rec - lo) / (hi - lo)).clamp(0, 1), (target - lo) / (hi - lo), data_range=1.0))


def mia_auc(model: nn.Module, members: torch.Tensor, ym: torch.Tensor, non: torch.Tensor,
            yn: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        lm = F.cross_entropy(model(members), ym, reduction="none")
        ln = F.cross_entropy(model(non), yn, reduction="none")
    scores = torch.cat([-lm, -ln])
    labels = torch.cat([torch.ones(len(lm)), torch.zeros(len(ln))]).long()
    return float(binary_auroc(scores, labels))


def fedfed_net(a_set, args: argparse.Namespace) -> torch.nn.Module:
    """A FedFed VAE and its classifier trained on ``a_set`` for ``args.epochs`` with FedFed's loss
    at the benchmark's sigma and clip (eval mode)."""
    cfg = Config.from_run_config({"method": "fedfed", "fedxds-clip": 10.0, "fedxds-sigma": args.sigma})
    torch.manual_seed(args.seed + 5)
    net = make_fedfed_net(cfg)
    net.vae.generator = torch.Generator().manual_seed(args.seed + 6)
    train_epochs(net, a_set, epochs=args.epochs, batch_size=64, lr=cfg.fedfed_lr, momentum=0.0,
                 weight_decay=0.0, device=torch.device("cpu"), generator=torch.Generator().manual_seed(1),
                 optimizer="adam", criterion=fedfed_loss(net, cfg, args.sigma,
                                                         torch.Generator().manual_seed(args.seed + 7)))
    return net.eval()


@torch.no_grad()
def vae_inversion_ssim(net: torch.nn.Module, shared: torch.Tensor, orig: torch.Tensor,
                       steps: int = 20) -> float:
    """The attack open to a server that holds FedFed's VAE: x̂ ← x̃_s + VAE(x̂) from x̂ = x̃_s, SSIM
    on the half of S the decoder attack reconstructs."""
    half = len(shared) // 2
    target, x = shared[half:], shared[half:].clone()
    for _ in range(steps):
        x = target + torch.cat([net.vae(b)[0] for b in x.split(256)])
    return pixel_ssim(x, orig[half:], orig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default=3000, help="size of each set (A, S, L, non-members)",
                    type=int_in(10, 10000, "an integer in [10, 10000] (the test set holds the non-members)"))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--sigma", type=float, default=0.15)
    ap.add_argument("--sparsity", type=float, default=0.8, help="the fraction of pixels removed, in [0, 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:  # the run's own checks (sparsity is the fraction removed, in [0, 1); noise is mandatory)
        Config.from_run_config({"method": "fedxds", "fedxds-sigma": args.sigma,
                                "fedxds-sparsity": args.sparsity})
    except ConfigError as e:
        ap.error(str(e).replace("run-config 'fedxds-", "--").replace("'", "", 1))
    torch.manual_seed(args.seed)
    train, test = load_dataset("fashion-mnist", True), load_dataset("fashion-mnist", False)
    perm = np.random.default_rng(args.seed).permutation(len(train))
    n = args.n
    a_set, s_set, l_set = (train.subset(perm[i * n:(i + 1) * n]) for i in range(3))
    non = test.subset(np.arange(n))
    dev = torch.device("cpu")
    kw = dict(batch_size=64, lr=0.01, momentum=0.9, weight_decay=0.0, device=dev)

    attr_model = build_model("cnn", 1, 10, 28)
    train_epochs(attr_model, a_set, epochs=args.epochs, generator=torch.Generator().manual_seed(1), **kw)
    xs, ys = s_set.normalise(s_set.x), s_set.y
    heat = attribute(attr_model, xs, ys, "lrp")
    out = {"sigma": args.sigma, "epsilon-per-unit-l2 (delta=1e-5)": epsilon_for(args.sigma, 1e-5),
           "sparsity": args.sparsity, "n": n}
    for kind in ("binary", "none", "fedfed"):
        source = xs
        if kind == "fedfed":  # x_s = x - VAE(x), privatised as the other rows' samples
            vae = fedfed_net(a_set, args)
            source = vae.shared_part(xs)
        shared = privatise(source, heat, sparsity=args.sparsity,
                           mask_kind="none" if kind == "fedfed" else kind, clip=10.0, sigma=args.sigma,
                           generator=torch.Generator().manual_seed(2))
        # membership: a model trained on L + lambda * CE(shared S); the same initialisation and
        # shared-batch order for masked and unmasked (invert_ssim reseeds the global RNG)
        torch.manual_seed(args.seed + 4)
        model = build_model("cnn", 1, 10, 28)
        order = torch.randperm(len(shared), generator=torch.Generator().manual_seed(4))
        it = iter(order.split(64) * (args.epochs * 100))

        def hook(m: nn.Module, it=it, shared=shared) -> torch.Tensor:
            idx = next(it)
            return 0.5 * F.cross_entropy(m(shared[idx]), ys[idx])

        train_epochs(model, l_set, epochs=args.epochs, generator=torch.Generator().manual_seed(3),
                     loss_hook=hook, **kw)
        label = {"binary": "masked", "none": "unmasked"}.get(kind, kind)
        out[label] = {
            "mia-auc": mia_auc(model, xs, ys, non.normalise(non.x), non.y),
            "inversion-ssim": invert_ssim(shared, xs, args.epochs, args.seed),
            "test-accuracy": evaluate(model, test, dev)[1],
        }
        if kind == "fedfed":
            out[label]["vae-inversion-ssim"] = vae_inversion_ssim(vae, shared, xs)
        print(label, out[label], flush=True)
    out["inversion SSIM masked < fedfed (reported, not an issue check)"] = (
        out["masked"]["inversion-ssim"] < out["fedfed"]["inversion-ssim"])
    out["checks"] = {"inversion SSIM masked < unmasked":
                     out["masked"]["inversion-ssim"] < out["unmasked"]["inversion-ssim"]}
    write_result("fedxds_privacy", out)


if __name__ == "__main__":
    run_main(main)
