"""Fed-ADE vs fixed learning rates, no adaptation, local-only adaptation, FTH, Fed-POE and the ablations.

Fashion-MNIST, a CNN pre-trained on 80 % of the training set, 10 clients on the remaining 20 %
(label mixes from Dirichlet 0.1), T time steps x R rounds, 50 samples per client and step, the
same streams and seeds for every variant. Reports the average online accuracy (after each
step's rounds, pooled over clients), the predict-then-update accuracy and wall time, and plots
the online accuracy per time step of each setting (``benchmarks/results/fedade-<shift>-<schedule>.png``).
FTH (Follow The History, one of the paper's localised online label-shift baselines) does not train:
each client reweights the pre-trained model's softmax by the mean of its BBSE estimates of the past
steps' label mixes. Its online accuracy is strictly causal (step t scored with estimates of the steps
before t: the same as its predict-then-update accuracy); the other variants' online accuracy scores a
model already adapted to step t's unlabelled batch.
Fed-POE (the paper's closest baseline: a local and the federated model mixed by Hedge; our port to
unlabelled streams, flowerbed/clients/fedpoe.py) adapts both models at FixLR(mid)'s fixed rate
(its federated model is averaged whole, where Fed-ADE's variants average the convolutional layers
and keep the dense ones on the client).
ATLAS (the paper's other localised online label-shift baseline; flowerbed/clients/atlas.py) keeps on
each client, with no federation, a base learner for each step size of the geometric pool from
fedade-lr-min to fedade-lr-max (and one above), combined by Hedge weights that follow their risks.
Targets (issue #6): label shift lin and ber: Fed-ADE >= FixLR(mid) + 1 pp and >= no adaptation;
covariate shift lin: >= FixLR(mid); Fed-ADE's wall time <= 1.2 x FixLR's.
Usage: .venv/bin/python -m benchmarks.fedade [--steps 20] [--rounds-per-step 2] [--variants ATLAS,...]
       .venv/bin/python -m benchmarks.fedade --plot-only [--runs DIR]   (redraw from the runs)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import (
    RESULTS,
    ROOT,
    checked,
    kept_note,
    merged_rows,
    note_failures,
    read_result,
    rows_to_run,
    run_main,
    run_rows,
    setting_list,
    write_result,
)
from flowerbed.compare import compare
from flowerbed.config import Config, ConfigError, defaults
from flowerbed.pretrain import pretrained
from flowerbed.results import md_table, pct, plot_curves, time_step_curves

LO, HI = defaults()["fedade-lr-min"], defaults()["fedade-lr-max"]


def fixed(lr: float) -> str:
    """The FixLR baseline at learning rate ``lr``, as a launcher method spec."""
    return f"fedade@fedade-lr-mode='fixed'@fedade-fixed-lr={lr}"


def base_config(shift: str, sched: str, steps: int, rounds_per_step: int) -> dict:
    """The run-config every variant of one setting shares (streams, seed, sampling)."""
    return {"num-server-rounds": steps * rounds_per_step, "seed": 0,
            "fedade-rounds-per-step": rounds_per_step, "fedade-shift": shift,
            "fedade-schedule": sched, "partition": "dirichlet:0.1", "min-partition-size": 6,
            "fraction-train": 0.5}


VARIANTS = [
    "fedade",
    fixed(LO),
    fixed((LO + HI) / 2),
    fixed(HI),
    "fedade@fedade-lr-mode='none'",
    "fedade@fedade-sync=false",
    "fedade@fedade-estimators='rep'",
    "fedade@fedade-estimators='unc'",
    "fedade@fedade-lr-mode='none'@fedade-correction='fth'",
    f"fedpoe@fedade-fixed-lr={(LO + HI) / 2}",
    "atlas",
]
NAMES = ["Fed-ADE", "FixLR(low)", "FixLR(mid)", "FixLR(high)", "no adaptation", "local-only",
         "w/o S_unc", "w/o S_rep", "FTH", "Fed-POE", "ATLAS"]
SETTINGS = [("label", "lin"), ("label", "ber"), ("covariate", "lin")]
PLOTTED = ["Fed-ADE", "FixLR(low)", "FixLR(mid)", "FixLR(high)", "no adaptation", "FTH", "Fed-POE"]


def plot_setting(runs: Path, shift: str, sched: str) -> Path:
    """Online accuracy per time step of the main variants (Fed-ADE's predict-then-update too),
    each row placed at the time step its run recorded (``time-step``, 0-based; drawn from 1)."""
    folder = runs / f"bench-fedade-{shift}-{sched}"
    if not folder.is_dir():
        raise ConfigError("--runs", str(runs), f"it holds no {folder.name}/ (run the benchmark "
                          "first, or name the folder that holds its runs)")
    curves, missing = {}, []
    for name, variant in zip(NAMES, VARIANTS, strict=True):
        if name not in PLOTTED:
            continue
        if not (rows := run_rows(folder, variant)):
            missing.append(name)  # a run that failed before its first row
            continue
        curves[name], pre = time_step_curves(rows)
        if name == "Fed-ADE":
            curves["Fed-ADE, predict-then-update"] = pre
    out = RESULTS / f"fedade-{shift}-{sched}.png"
    return plot_curves(curves, out, title=f"Fed-ADE, {shift} shift, {sched} (Fashion-MNIST, CPU)",
                       xlabel="time step", ylabel="online accuracy (all clients)",
                       note=f"no rows: {', '.join(missing)}" if missing else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds-per-step", type=int, default=2)
    ap.add_argument("--settings", type=setting_list, default=",".join(f"{a}/{b}" for a, b in SETTINGS),
                    help="which shift/schedule settings to run (default: all three)")
    ap.add_argument("--variants", default=",".join(NAMES),
                    help="run only these rows (named as in the table, comma-separated); the others' "
                         "earlier results are kept if measured with the same steps and rounds per step")
    ap.add_argument("--plot-only", action="store_true",
                    help="only redraw the plots from the runs of an earlier benchmark")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs",
                    help="where the benchmark's runs are (bench-fedade-<shift>-<schedule>/)")
    args = ap.parse_args()
    settings = args.settings
    if args.plot_only:
        for shift, sched in settings:
            print("written:", plot_setting(args.runs, shift, sched))
        return
    run = rows_to_run(args.variants, NAMES, "variants")
    specs = [VARIANTS[NAMES.index(n)] for n in run]
    old = read_result("fedade")
    same = (old.get("steps"), old.get("rounds-per-step")) == (args.steps, args.rounds_per_step)
    results = old.get("results", {}) if same else {}
    # pre-train (or load) the starting model, one for every setting, first, so that a cold
    # cache's central training does not count in the wall time of the variant that runs first
    pretrained(Config.from_run_config({**base_config(*settings[0], args.steps, args.rounds_per_step),
                                       "method": "fedade"}))
    for shift, sched in settings:
        checked(specs, base_config(shift, sched, args.steps, args.rounds_per_step), 10)
    for shift, sched in settings:
        base = base_config(shift, sched, args.steps, args.rounds_per_step)
        out = args.runs / f"bench-fedade-{shift}-{sched}"
        compare(specs, base, num_clients=10, out=out)
        note_failures(out)
        if run == NAMES:  # (a subset's folder lacks the other rows' runs: the plots stay)
            plot_setting(args.runs, shift, sched)
        res = json.loads((out / "results.json").read_text())
        key = f"{shift}/{sched}"
        results[key] = merged_rows(results.get(key, {}), {n: res[v] for n, v in zip(run, specs, strict=True)},
                                   NAMES)
    rows = []
    for key in [f"{a}/{b}" for a, b in SETTINGS if f"{a}/{b}" in results]:
        for n, r in results[key].items():
            wall = r.get("wall-seconds")  # none where the run failed
            rows.append([*key.split("/"), n + (" (failed)" if "error" in r else ""),
                         pct(r.get("mean-accuracy")), pct(r.get("mean-pre-accuracy")),
                         "-" if wall is None else f"{wall:.0f}"])
    table = "\n".join(md_table(["shift", "schedule", "variant", "online acc %",
                                 "predict-then-update %", "wall s"], rows))

    def at_least(key: str, a: str, b: str, margin: float = 0.0, of: str = "mean-accuracy",
                 times: float = 1.0) -> bool:
        """Variant ``a``'s figure ≥ ``times`` × ``b``'s + ``margin`` (not met where one failed)."""
        x, y = (results[key].get(v, {}).get(of) for v in (a, b))
        return x is not None and y is not None and x >= times * y + margin

    checks = {}
    for key in ("label/lin", "label/ber"):
        if key in results:
            checks[f"{key} Fed-ADE >= FixLR(mid) + 1pp"] = at_least(key, "Fed-ADE", "FixLR(mid)", 0.01)
            checks[f"{key} Fed-ADE >= no adaptation"] = at_least(key, "Fed-ADE", "no adaptation")
    if "covariate/lin" in results:
        checks["covariate/lin Fed-ADE >= FixLR(mid)"] = at_least("covariate/lin", "Fed-ADE", "FixLR(mid)")
    if "label/lin" in results:  # Fed-ADE's wall time ≤ 1.2 × FixLR's: FixLR's ≥ Fed-ADE's / 1.2
        checks["wall time Fed-ADE <= 1.2 x FixLR(mid)"] = at_least(
            "label/lin", "FixLR(mid)", "Fed-ADE", of="wall-seconds", times=1 / 1.2)
    (RESULTS / "fedade.md").write_text(table + "\n")
    write_result("fedade", {"table": table, "checks": checks, "results": results,
                            "steps": args.steps, "rounds-per-step": args.rounds_per_step,
                            "settings": [k for k in (f"{a}/{b}" for a, b in SETTINGS) if k in results],
                            **kept_note("fedade", run != NAMES)})


if __name__ == "__main__":
    run_main(main)
