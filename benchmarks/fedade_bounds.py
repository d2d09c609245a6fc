"""How Fed-ADE vs FixLR depends on the learning-rate bounds [eta_min, eta_max] (not a target).

The Fed-ADE benchmark (``benchmarks/fedade.py``) uses the official code's label-shift bounds for
CIFAR-10, [1e-5, 1e-3], which that code applies to raw 0-255 pixels; here inputs are normalised,
so the same numbers sit elsewhere relative to the best fixed rate. This script scales both bounds
by 1, 10 and 100 and runs, for each scale, Fed-ADE and FixLR(low / mid / high) = eta_min,
(eta_min + eta_max) / 2 and eta_max on the benchmark's streams, seeds and rounds (label shift,
lin and ber). Every variant of a scale shares its bounds. The issue's check stays on the
benchmark's bounds; this table shows where the comparison turns. ``--pixels raw`` runs the same
with the official code's input, raw 0-255 pixels (``fedade-pixels='raw'``, its own pre-trained
model), the scale those bounds were set for.
Usage: .venv/bin/python -m benchmarks.fedade_bounds [--scales 1,10,100] [--steps 20]
       [--settings label/lin,label/ber] [--pixels standardised|raw]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import (
    ROOT,
    checked,
    kept_note,
    kept_splits,
    note_failures,
    run_main,
    run_rows,
    scale_list,
    setting_list,
    write_result,
)
from benchmarks.fedade import HI, LO, base_config, fixed
from flowerbed.compare import compare
from flowerbed.results import md_table, pct

NAMES = ["Fed-ADE", "FixLR(low)", "FixLR(mid)", "FixLR(high)"]
VARY = ("fedade-shift", "fedade-schedule", "fedade-lr-min", "fedade-lr-max",  # differ per row
        "fedade-pixels")


def scaled(scale: float) -> tuple[list[str], dict[str, float]]:
    """Fed-ADE and FixLR(low / mid / high) with both bounds times ``scale``, and those bounds as
    run-config overrides (every variant of a scale runs with them)."""
    lo, hi = LO * scale, HI * scale
    return (["fedade", fixed(lo), fixed((lo + hi) / 2), fixed(hi)],
            {"fedade-lr-min": lo, "fedade-lr-max": hi})


def render(results: dict[str, dict]) -> str:
    """The table, a row per "<shift>/<schedule> x<scale>" key, by setting and then scale."""
    order = ["label/lin", "label/ber", "covariate/lin"]  # the Fed-ADE benchmark's order

    def rank(kv: tuple[str, dict]) -> tuple:
        setting = kv[0].split()[0]
        return (order.index(setting) if setting in order else len(order), setting,
                kv[1].get("pixels", "standardised"), kv[1]["bounds"])

    rows = []
    for key, r in sorted(results.items(), key=rank):
        shift, sched = key.split()[0].split("/")
        (lo, hi), acc, lr = r["bounds"], r["mean-accuracy"], r["fedade-mean-lr"]
        ade, mid = acc["Fed-ADE"], acc["FixLR(mid)"]  # None where a run failed
        rows.append([shift, sched, r.get("pixels", "standardised"), f"[{lo:.0e}, {hi:.0e}]",
                     *(pct(acc[n]) for n in NAMES),
                     "-" if None in (ade, mid) else f"{100 * (ade - mid):+.2f}",
                     "-" if lr is None else f"{lr:.1e}"])
    return "\n".join(md_table(["shift", "schedule", "pixels", "bounds", *(f"{n} %" for n in NAMES),
                                "Fed-ADE - FixLR(mid) pp", "Fed-ADE mean lr"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=scale_list, default="1,10,100", help="factors applied to both bounds")
    ap.add_argument("--settings", type=setting_list, default="label/lin,label/ber")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds-per-step", type=int, default=2)
    ap.add_argument("--pixels", default="standardised", choices=("standardised", "raw"),
                    help="model input: standardised (the benchmark's) or raw 0-255 (the official code's)")
    args = ap.parse_args()
    raw = args.pixels == "raw"
    tag = " raw" if raw else ""  # standardised rows keep their earlier keys
    scales = args.scales
    # rows an earlier run measured the same way (only setting and bounds differing) are kept
    kept, configs = kept_splits("fedade_bounds", base_config("", "", args.steps,
                                                             args.rounds_per_step), vary=VARY)
    results = dict(kept)
    for shift, sched in args.settings:
        setting = f"{shift}/{sched}"
        for scale in scales:
            variants, bounds = scaled(scale)
            base = {**base_config(shift, sched, args.steps, args.rounds_per_step), **bounds,
                    **({"fedade-pixels": "raw"} if raw else {})}
            key = f"{setting} x{scale:g}{tag}"
            configs[key] = base
            out = ROOT / "runs" / f"bench-fedade-bounds-{shift}-{sched}-x{scale:g}{tag.replace(' ', '-')}"
            checked(variants, base, 10)
            compare(variants, base, num_clients=10, out=out)
            note_failures(out)
            res = json.loads((out / "results.json").read_text())
            acc = {n: res[v].get("mean-accuracy") for n, v in zip(NAMES, variants, strict=True)}
            lrs = [r["lr"] for r in run_rows(out, "fedade") if r.get("lr")]
            lr = sum(lrs) / len(lrs) if lrs else None  # mean over rounds of the clients' mean
            results[key] = {
                "bounds": [bounds["fedade-lr-min"], bounds["fedade-lr-max"]], "pixels": args.pixels,
                "mean-accuracy": acc, "fedade-mean-lr": lr}
    write_result("fedade_bounds", {"table": render(results), "results": results,
                                   "split-configs": configs, "steps": args.steps,
                                   "rounds-per-step": args.rounds_per_step,
                                   **kept_note("fedade_bounds", bool(kept))})


if __name__ == "__main__":
    run_main(main)
