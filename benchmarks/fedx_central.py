"""Centralised SimCLR with FedX's CPU-preset encoder, augmentations and probe: the reference
for how many self-supervised steps the CNN needs before its linear probe passes the random-init
encoder's (the floor of issue #3's targets).

The whole preset training set (20k Fashion-MNIST samples, labels unused) in one process, NT-Xent
(tau = presets/fedx-cpu.toml's ssl-tau), SGD with the preset's momentum and weight decay, the
linear probe of ``flowerbed.strategies.ssl.probe`` after every epoch.
Usage: .venv/bin/python -m benchmarks.fedx_central [--epochs 20] [--batch-size 256] [--lr 0.05]
"""

from __future__ import annotations

import argparse
import time

import torch
from flwr.common.config import parse_config_args

from benchmarks.common import ROOT, run_main, write_result
from flowerbed.cli import int_in
from flowerbed.clients.fedsimclr import make_ssl_model
from flowerbed.config import Config
from flowerbed.datasets.augment import Augmenter
from flowerbed.datasets.federated import test_set, train_set
from flowerbed.losses import nt_xent
from flowerbed.strategies.ssl import probe
from flowerbed.training import seeded_generator, ssl_epochs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int_in(1), default=20)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    cfg = Config.from_run_config({**parse_config_args([str(ROOT / "presets" / "fedx-cpu.toml")]),
                                  "method": "fedsimclr"})
    train, test = train_set(cfg), test_set(cfg)
    torch.manual_seed(cfg.seed)
    model = make_ssl_model(cfg, train)
    device = torch.device("cpu")
    augment, gen = Augmenter(*train.shape[:2]), seeded_generator(cfg.seed)
    unlabelled = train.without_labels()
    floor = probe(model, train, test, device, cfg)[1]
    print(f"random-init probe {100 * floor:.2f} %", flush=True)
    curve, t0 = [], time.time()
    for epoch in range(1, args.epochs + 1):
        loss, steps = ssl_epochs(
            model, unlabelled, epochs=1, batch_size=args.batch_size, lr=args.lr,
            momentum=cfg.momentum, weight_decay=cfg.weight_decay, device=device, generator=gen,
            augment=augment, step=lambda x1, x2, _xr, _idx: nt_xent(model(x1)[1], model(x2)[1], cfg.ssl_tau))
        acc = probe(model, train, test, device, cfg)[1]
        curve.append({"epoch": epoch, "steps": epoch * steps, "ssl-loss": loss, "probe": acc})
        print(f"epoch {epoch}: loss {loss:.3f}, probe {100 * acc:.2f} %", flush=True)
    best = max(curve, key=lambda r: r["probe"])
    write_result("fedx_central", {
        "samples": len(train), "epochs": args.epochs, "batch-size": args.batch_size, "lr": args.lr,
        "random-init-probe": floor, "curve": curve, "best-probe": best["probe"],
        "best-epoch": best["epoch"], "wall-seconds": round(time.time() - t0, 1),
        "checks": {"centralised simclr best probe > random-init probe": best["probe"] > floor,
                   "centralised simclr best probe >= random-init + 10pp": best["probe"] >= floor + 0.10}})


if __name__ == "__main__":
    run_main(main)
