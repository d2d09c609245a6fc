"""FedCC vs FedDF, FedMD and FedAvg under label skew on Fashion-MNIST (ensemble accuracy).

Same public set (a seeded 10 % of the training set, unlabelled), partitions and seeds for every
method; 10 clients; the distillation methods use two CNN widths (half the clients each), FedAvg
the full-width CNN. Targets (issue #4): with pathological:1, FedCC >= 50 %, >= FedDF + 20 pp and
>= FedAvg + 20 pp; with dirichlet:0.05 and pathological:2, FedCC >= FedDF; FedCC's upload per
client per round <= 1/10 of FedAvg's.
Usage: .venv/bin/python -m benchmarks.fedcc [--rounds 10] [--train-samples 30000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS, write_result
from flowerbed.compare import compare

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["fedcc", "feddf", "fedmd", "fedavg"]
SPLITS = ["pathological:1", "dirichlet:0.05", "pathological:2"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--train-samples", type=int, default=30000)
    ap.add_argument("--splits", default=",".join(SPLITS))
    args = ap.parse_args()
    base = {"public-fraction": 0.1, "num-server-rounds": args.rounds, "local-epochs": 1,
            "distill-epochs": 1, "fedcc-ssl-epochs": 1, "batch-size": 64, "seed": 0,
            "train-samples": args.train_samples, "eval-every": 2}
    tables, results = [], {}
    for split in args.splits.split(","):
        out = ROOT / "runs" / f"bench-fedcc-{split.replace(':', '')}"
        tables.append(f"### {split}\n\n" + compare(METHODS, {**base, "partition": split},
                                                     num_clients=10, out=out))
        results[split] = json.loads((out / "results.json").read_text())

    def acc(split: str, m: str) -> float | None:
        return results.get(split, {}).get(m, {}).get("final-accuracy")

    def up(split: str, m: str) -> float | None:
        return results.get(split, {}).get(m, {}).get("bytes-up-per-client-round")

    p1 = "pathological:1"
    checks = {
        "pathological:1 fedcc >= 0.50": _ge(acc(p1, "fedcc"), 0.0, 0.50),
        "pathological:1 fedcc >= feddf + 20pp": _ge(acc(p1, "fedcc"), acc(p1, "feddf"), 0.20),
        "pathological:1 fedcc >= fedavg + 20pp": _ge(acc(p1, "fedcc"), acc(p1, "fedavg"), 0.20),
        "dirichlet:0.05 fedcc >= feddf": _ge(acc("dirichlet:0.05", "fedcc"),
                                             acc("dirichlet:0.05", "feddf"), 0.0),
        "pathological:2 fedcc >= feddf": _ge(acc("pathological:2", "fedcc"),
                                             acc("pathological:2", "feddf"), 0.0),
        "fedcc upload <= fedavg upload / 10": (None if up(p1, "fedcc") is None or up(p1, "fedavg") is None
                                               else up(p1, "fedcc") <= up(p1, "fedavg") / 10),
    }
    table = "\n\n".join(tables)
    (RESULTS / "fedcc.md").write_text(table + "\n")
    write_result("fedcc", {"table": table, "checks": checks, "config": base, "results": results})


def _ge(a: float | None, b: float | None, margin: float) -> bool | None:
    return None if a is None or b is None else a >= b + margin


if __name__ == "__main__":
    main()
