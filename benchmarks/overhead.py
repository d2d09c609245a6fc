"""Flower overhead: the same FedAvg work through flowerbed's Flower simulation and a plain loop.

Both sides use the same clients' data (flowerbed's partitions and local splits), model, seeds,
epochs, batches and training function; both evaluate each client's local test split and the
global model on the test set every round. The plain loop runs the clients one after another in
this process (torch using every core); the Flower side is `flwr run` against a local simulation
SuperLink (start-up included), `--cpus-per-client` 1.

Target (issue #2): wall-time ratio <= 1.3 for 10 clients x 20 rounds.
Usage: .venv/bin/python -m benchmarks.overhead [--rounds 20] [--clients 10]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from benchmarks.common import run_main, write_result
from flowerbed import engine
from flowerbed.cli import int_in
from flowerbed.config import Config
from flowerbed.datasets.federated import client_data, test_set, train_set
from flowerbed.models import build_model
from flowerbed.results import read_metrics
from flowerbed.training import evaluate, load_record, seeded_generator, to_record, train_epochs


def plain_fedavg(cfg: Config, clients: int) -> tuple[float, list[float]]:
    """Sequential FedAvg in one process; returns (wall seconds, test accuracy per round)."""
    t0 = time.time()
    device = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    train, test = train_set(cfg), test_set(cfg)
    c, h, _ = train.shape
    model = build_model(cfg.model, c, train.num_classes, h)
    data = [client_data(cfg, i, clients) for i in range(clients)]
    glob = to_record(model)
    accs = [evaluate(load_record(model, glob), test, device)[1]]
    for rnd in range(1, cfg.num_server_rounds + 1):
        replies = []
        for i, (tr, _) in enumerate(data):
            local = load_record(build_model(cfg.model, c, train.num_classes, h), glob)
            train_epochs(local, tr, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                         momentum=cfg.momentum, weight_decay=cfg.weight_decay, device=device,
                         generator=seeded_generator(cfg.seed, i, rnd))
            replies.append(RecordDict({"arrays": to_record(local),
                                       "m": MetricRecord({"num-examples": len(tr)})}))
        glob = aggregate_arrayrecords(replies, "num-examples")
        for _, te in data:  # client-side evaluation, as the Flower run does
            evaluate(load_record(model, glob), te, device)
        accs.append(evaluate(load_record(model, glob), test, device)[1])
        print(f"plain round {rnd}: acc {accs[-1]:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return time.time() - t0, accs


def flower_fedavg(cfg: Config, clients: int, out: Path) -> tuple[float, list[float]]:
    t0 = time.time()
    rc = {**cfg.to_run_config(), "output-dir": str(out), "run-name": "flower"}
    with engine.local_superlink() as (home, conn):
        engine.flwr_run(home, conn, rc, engine.federation_config(clients, 1), quiet=True)
    wall = time.time() - t0
    return wall, [r["accuracy"] for r in read_metrics(out / "flower")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int_in(1), default=10)
    args = ap.parse_args()
    cfg = Config.from_run_config({"num-server-rounds": args.rounds, "partition": "dirichlet:0.5"})
    train_set(cfg)  # both sides pay the data load; warm the page cache first
    plain_s, plain_acc = plain_fedavg(cfg, args.clients)
    with tempfile.TemporaryDirectory() as tmp:
        flower_s, flower_acc = flower_fedavg(cfg, args.clients, Path(tmp))
    ratio = flower_s / plain_s
    write_result("overhead", {
        "setup": f"FedAvg, fashion-mnist, dirichlet:0.5, {args.clients} clients, {args.rounds} rounds, "
                 f"1 local epoch, batch {cfg.batch_size}, CNN; Flower: --cpus-per-client 1",
        "plain-seconds": round(plain_s, 1), "flower-seconds": round(flower_s, 1),
        "ratio": round(ratio, 3), "target-ratio-max": 1.3, "met": ratio <= 1.3,
        "plain-final-accuracy": plain_acc[-1], "flower-final-accuracy": flower_acc[-1],
        "max-abs-accuracy-difference": float(np.max(np.abs(np.array(plain_acc) - np.array(flower_acc)))),
    })


if __name__ == "__main__":
    run_main(main)
