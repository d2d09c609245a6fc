"""FedX vs its bases on Fashion-MNIST: linear-probe accuracy, same partitions, seeds, rounds.

Every method runs presets/fedx-cpu.toml (CNN, dirichlet:0.5, 10 clients, 20k training samples,
10 rounds x 1 local epoch, batch 64) with only `method`/`fedx-base` changed, once per seed
(seeds 0, 1, 2 by default: other partitions and initialisations; one seed's differences between
methods were within seed-to-seed noise). Round 0's probe is the random-init encoder (the floor).
Targets (issue #3), on the means over seeds: FedX on SimCLR >= FedSimCLR + 1.0 pp; FedX on
BYOL >= FedBYOL; every method >= random-init + 10 pp. The two BYOL rows are also run with a
BatchNorm1d in both heads (``ssl-head-bn=true``, BYOL's own heads; the same for both rows, so
the FedX-over-BYOL check is repeated between them), and so are the two SimCLR rows (the
FedX-over-SimCLR check repeated between them). FedMoCo and FedX over MoCo are a third base (the
paper's claim that FedX lifts every base; checked as FedX on MoCo >= FedMoCo, not an issue target),
FedX over FedU a fourth (FedX on FedU >= FedU, likewise), and FedProtoCL and FedX over it the
fifth (FedX on ProtoCL >= FedProtoCL): the paper's five bases. MOON-unsup (the appendix's
baseline: FedSimCLR + MOON's model-contrastive term) is reported alongside, unchecked.
Usage: .venv/bin/python -m benchmarks.fedx [--rounds N] [--seeds 0,1,2] [--resume]
       [--methods m1,m2]   (run only these; the other rows of benchmarks/results/fedx.json are
                            kept when they were measured with the same settings and seeds)
"""

from __future__ import annotations

import argparse
import json

from flwr.common.config import parse_config_args

from benchmarks.common import (
    RESULTS,
    ROOT,
    checked,
    kept_note,
    machine,
    merged_rows,
    note_failures,
    read_result,
    rows_to_run,
    run_main,
    same_settings,
    seed_list,
    write_result,
)
from flowerbed.cli import int_in
from flowerbed.compare import compare_seeds, seeds_table

BYOL, FEDX_BYOL = "fedbyol", "fedx@fedx-base='byol'"
MOCO, FEDX_MOCO = "fedmoco", "fedx@fedx-base='moco'"
FEDX_FEDU = "fedx@fedx-base='fedu'"
PROTO, FEDX_PROTO = "fedprotocl", "fedx@fedx-base='protocl'"
BN = "@ssl-head-bn=true"
VARIANTS = ["fedsimclr", "fedx", BYOL, FEDX_BYOL, "fedu", BYOL + BN, FEDX_BYOL + BN,
            "fedsimclr" + BN, "fedx" + BN, MOCO, FEDX_MOCO, FEDX_FEDU, PROTO, FEDX_PROTO, "moon-unsup"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int_in(1), default=None, help="override the preset's rounds")
    ap.add_argument("--seeds", type=seed_list, default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--resume", action="store_true",
                    help="keep finished runs of an earlier, stopped run of this benchmark")
    ap.add_argument("--methods", default=",".join(VARIANTS),
                    help="run only these (comma-separated); the others' earlier results are kept")
    args = ap.parse_args()
    methods = rows_to_run(args.methods, VARIANTS)
    overrides = parse_config_args([str(ROOT / "presets" / "fedx-cpu.toml")])
    overrides.pop("method")
    if args.rounds:
        overrides["num-server-rounds"] = args.rounds
    seeds = args.seeds
    out = ROOT / "runs" / "bench-fedx"
    checked(methods, overrides, 10, seeds)
    compare_seeds(methods, overrides, seeds, num_clients=10, out=out, resume=args.resume)
    note_failures(out)
    new = json.loads((out / "results.json").read_text())["summary"]
    kept, old = kept_rows(overrides, seeds)
    res = merged_rows(kept, new, VARIANTS)
    table = seeds_table(res, overrides, 10, seeds)

    def acc(name: str, key: str = "final-accuracy") -> float | None:
        """A row's mean over the seeds; None if a seed failed or has no figure (it diverged):
        means over other seeds than its peer's are not compared."""
        row = res.get(name, {})
        whole = not row.get("seeds-failed") and row.get(f"{key}-n") in (None, len(row.get("seeds-ok", [])))
        return row.get(f"{key}-mean") if whole else None

    floor = acc("fedsimclr", "initial-accuracy")
    checks = {
        "fedx(simclr) >= fedsimclr + 1pp (last)": _ge(acc("fedx"), acc("fedsimclr"), 0.01),
        "fedx(simclr) >= fedsimclr + 1pp (best)": _ge(acc("fedx", "best-accuracy"),
                                                      acc("fedsimclr", "best-accuracy"), 0.01),
        "fedx(byol) >= fedbyol (last)": _ge(acc(FEDX_BYOL), acc(BYOL), 0.0),
        "fedx(byol) >= fedbyol, both with head BN (last)": _ge(acc(FEDX_BYOL + BN), acc(BYOL + BN),
                                                               0.0),
        "fedx(simclr) >= fedsimclr + 1pp, both with head BN (last)": _ge(
            acc("fedx" + BN), acc("fedsimclr" + BN), 0.01),
        "fedx(moco) >= fedmoco (last)": _ge(acc(FEDX_MOCO), acc(MOCO), 0.0),
        "fedx(fedu) >= fedu (last)": _ge(acc(FEDX_FEDU), acc("fedu"), 0.0),
        "fedx(protocl) >= fedprotocl (last)": _ge(acc(FEDX_PROTO), acc(PROTO), 0.0),
        **{f"{m} >= random-init + 10pp": _ge(acc(m), floor, 0.10) for m in res},
    }
    dates = row_dates(list(new), {m: r for m, r in kept.items() if m not in new}, old,
                      machine()["date"])
    write_result("fedx", {"table": table, "random-init-probe": floor, "seeds": seeds,
                          # the floor is FedSimCLR's round 0 (None without that row)
                          "random-init-probe-per-seed": res.get("fedsimclr", {}).get("initial-accuracy"),
                          "checks": checks, "results": res, "config": overrides,
                          "row-dates": {m: dates[m] for m in res},
                          # a note on kept rows stays with them
                          **kept_note("fedx", bool(kept))})
    # the .md after the .json: a failure between them left the two disagreeing
    (RESULTS / "fedx.md").write_text(table + f"\n\nRandom-init encoder probe (mean): {floor}\n")


def kept_rows(config: dict, seeds: list[int]) -> tuple[dict[str, dict], dict]:
    """The rows of the last written benchmarks/results/fedx.json and that file, when it was
    measured with the same settings and seeds (else nothing)."""
    old = read_result("fedx")
    if not old:
        return {}, {}
    if not same_settings(old.get("config", {}), config) or old.get("seeds") != seeds:
        print(f"benchmarks.fedx: the earlier rows (settings {old.get('config')}, seeds {old.get('seeds')}) "
              f"differ from this run's ({config}, seeds {seeds}) and are not kept")
        return {}, {}
    return old.get("results", {}), old


def row_dates(new: list[str], kept: dict[str, dict], old: dict, today: str) -> dict[str, str]:
    """When each row's results were written: this run's rows today, kept rows as the earlier
    file recorded them (its own date where it kept none per row)."""
    earlier = {m: old.get("row-dates", {}).get(m, old["machine"]["date"]) for m in kept}
    return {**earlier, **dict.fromkeys(new, today)}


def _ge(a: float | None, b: float | None, margin: float) -> bool | None:
    return None if a is None or b is None else a >= b + margin


if __name__ == "__main__":
    run_main(main)
