"""FedX vs its bases on Fashion-MNIST: linear-probe accuracy, same partitions, seeds, rounds.

Every method runs presets/fedx-cpu.toml (CNN, dirichlet:0.5, 10 clients, 20k training samples,
10 rounds x 1 local epoch, batch 64) with only `method`/`fedx-base` changed. Round 0's probe is
the random-init encoder (the floor). Targets (issue #3): FedX on SimCLR >= FedSimCLR + 1.0 pp;
FedX on BYOL >= FedBYOL; every method >= random-init + 10 pp.
Usage: .venv/bin/python -m benchmarks.fedx [--rounds N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flwr.common.config import parse_config_args

from benchmarks.common import RESULTS, write_result
from flowerbed.compare import compare

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["fedsimclr", "fedx", "fedbyol", "fedx@fedx-base='byol'", "fedu"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=None, help="override the preset's rounds")
    args = ap.parse_args()
    overrides = parse_config_args([str(ROOT / "presets" / "fedx-cpu.toml")])
    overrides.pop("method")
    if args.rounds:
        overrides["num-server-rounds"] = args.rounds
    out = ROOT / "runs" / "bench-fedx"
    table = compare(VARIANTS, overrides, num_clients=10, out=out)
    res = json.loads((out / "results.json").read_text())

    def acc(name: str, key: str = "final-accuracy") -> float | None:
        return res.get(name, {}).get(key)

    floor = acc("fedsimclr", "initial-accuracy")
    checks = {
        "fedx(simclr) >= fedsimclr + 1pp (last)": _ge(acc("fedx"), acc("fedsimclr"), 0.01),
        "fedx(simclr) >= fedsimclr + 1pp (best)": _ge(acc("fedx", "best-accuracy"),
                                                      acc("fedsimclr", "best-accuracy"), 0.01),
        "fedx(byol) >= fedbyol (last)": _ge(acc("fedx@fedx-base='byol'"), acc("fedbyol"), 0.0),
        **{f"{m} >= random-init + 10pp": _ge(acc(m), floor, 0.10) for m in VARIANTS},
    }
    (RESULTS / "fedx.md").write_text(table + f"\n\nRandom-init encoder probe: {floor}\n")
    write_result("fedx", {"table": table, "random-init-probe": floor, "checks": checks,
                          "results": res, "config": overrides})


def _ge(a: float | None, b: float | None, margin: float) -> bool | None:
    return None if a is None or b is None else a >= b + margin


if __name__ == "__main__":
    main()
