"""FedX vs its bases on Fashion-MNIST: linear-probe accuracy, same partitions, seeds, rounds.

Every method runs presets/fedx-cpu.toml (CNN, dirichlet:0.5, 10 clients, 20k training samples,
10 rounds x 1 local epoch, batch 64) with only `method`/`fedx-base` changed, once per seed
(seeds 0, 1, 2 by default: other partitions and initialisations; one seed's differences between
methods were within seed-to-seed noise). Round 0's probe is the random-init encoder (the floor).
Targets (issue #3), on the means over seeds: FedX on SimCLR >= FedSimCLR + 1.0 pp; FedX on
BYOL >= FedBYOL; every method >= random-init + 10 pp.
Usage: .venv/bin/python -m benchmarks.fedx [--rounds N] [--seeds 0,1,2] [--resume]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flwr.common.config import parse_config_args

from benchmarks.common import RESULTS, write_result
from flowerbed.compare import compare_seeds

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["fedsimclr", "fedx", "fedbyol", "fedx@fedx-base='byol'", "fedu"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=None, help="override the preset's rounds")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--resume", action="store_true",
                    help="keep finished runs of an earlier, stopped run of this benchmark")
    args = ap.parse_args()
    overrides = parse_config_args([str(ROOT / "presets" / "fedx-cpu.toml")])
    overrides.pop("method")
    if args.rounds:
        overrides["num-server-rounds"] = args.rounds
    seeds = [int(s) for s in args.seeds.split(",")]
    out = ROOT / "runs" / "bench-fedx"
    table = compare_seeds(VARIANTS, overrides, seeds, num_clients=10, out=out, resume=args.resume)
    res = json.loads((out / "results.json").read_text())["summary"]

    def acc(name: str, key: str = "final-accuracy") -> float | None:
        return res.get(name, {}).get(f"{key}-mean")

    floor = acc("fedsimclr", "initial-accuracy")
    checks = {
        "fedx(simclr) >= fedsimclr + 1pp (last)": _ge(acc("fedx"), acc("fedsimclr"), 0.01),
        "fedx(simclr) >= fedsimclr + 1pp (best)": _ge(acc("fedx", "best-accuracy"),
                                                      acc("fedsimclr", "best-accuracy"), 0.01),
        "fedx(byol) >= fedbyol (last)": _ge(acc("fedx@fedx-base='byol'"), acc("fedbyol"), 0.0),
        **{f"{m} >= random-init + 10pp": _ge(acc(m), floor, 0.10) for m in VARIANTS},
    }
    (RESULTS / "fedx.md").write_text(table + f"\n\nRandom-init encoder probe (mean): {floor}\n")
    write_result("fedx", {"table": table, "random-init-probe": floor, "seeds": seeds,
                          "random-init-probe-per-seed": res["fedsimclr"]["initial-accuracy"],
                          "checks": checks, "results": res, "config": overrides})


def _ge(a: float | None, b: float | None, margin: float) -> bool | None:
    return None if a is None or b is None else a >= b + margin


if __name__ == "__main__":
    main()
