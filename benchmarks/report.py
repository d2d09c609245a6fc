"""Render benchmarks/results/*.json as the README's "Measured" section (no numbers typed by hand).

Usage: .venv/bin/python -m benchmarks.report [--write-readme]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.common import RESULTS, read_result

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f} %"


def _checks(d: dict) -> str:
    return "\n".join(f"- {k}: **{'met' if v else 'not met' if v is not None else 'n/a'}**"
                     for k, v in d.get("checks", {}).items())


def render() -> str:
    out = []
    if d := read_result("default_run"):
        out.append(f"**`make run`** (`benchmarks/default_run.py`, {d['machine']['date']}): the default "
                   f"simulation ({d['config']['clients']} clients, {d['config']['partition']}, "
                   f"{d['config']['rounds']} rounds) took **{d['wall-seconds']:.0f} s** from the "
                   f"command to the summary, start-up included (target ≤ 300 s), and reached "
                   f"**{_pct(d['final-accuracy'])}** test accuracy (target ≥ 85 %); per round "
                   f"{', '.join(f'{s:.0f}' for s in d['seconds-per-round'][1:])} s. "
                   f"{d.get('note', '')}".rstrip())
    if d := read_result("overhead"):
        out.append(f"**Flower overhead** (`benchmarks/overhead.py`, {d['machine']['date']}): "
                   f"{d['setup']}. Plain sequential PyTorch loop in one process: "
                   f"**{d['plain-seconds']:.0f} s**; the same work through flowerbed's Flower "
                   f"simulation (SuperLink + `flwr run` + Ray, start-up included): "
                   f"**{d['flower-seconds']:.0f} s**; ratio **{d['ratio']:.2f}** (target ≤ 1.3). "
                   f"Final accuracy {_pct(d['plain-final-accuracy'])} vs "
                   f"{_pct(d['flower-final-accuracy'])}. Flower's side is faster because two "
                   f"clients train at once in two 1-CPU actors, where the plain loop runs one "
                   f"process on both cores. What keeps the overhead low by design: data and "
                   f"partitions cached per process (not reloaded per message), uint8 tensors "
                   f"normalised per batch instead of DataLoader transforms, and 1 CPU per client "
                   f"(Ray's default of 2 would run the clients one at a time here). "
                   f"{d.get('note', '')}")
    for name, title in (("foundation-dirichlet0.5", "FedAvg / FedProx / SCAFFOLD"),
                        ("fedx", "FedX vs its bases (linear probe)"),
                        ("fedcc", "FedCC vs FedDF, FedMD, FedAvg (ensemble accuracy)"),
                        ("fedfew", "FedFew vs IFCA, FedAvg, FedRep, Local (personalised)"),
                        ("fedxds", "FedXDS vs FedAvg, FedProx, SCAFFOLD, unmasked sharing"),
                        ("fedxds-100clients", "FedXDS with 100 clients"),
                        ("fedade", "Fed-ADE vs fixed learning rates"),
                        ("fedade_bounds", "Fed-ADE vs FixLR as both learning-rate bounds scale "
                                          "(no target; the checks above use the x1 bounds)")):
        if d := read_result(name):
            extra = ""
            if name == "fedx":
                extra = f"\n\nRandom-init encoder probe (the floor): {_pct(d['random-init-probe'])}"
                if per := d.get("random-init-probe-per-seed"):
                    extra += f" (mean; per seed {', '.join(_pct(v) for v in per.values())})"
                extra += "."
                if dates := d.get("row-dates"):
                    by_date: dict[str, list[str]] = {}
                    for m, day in dates.items():
                        by_date.setdefault(day, []).append(m)
                    extra += ("\n\nRows by the date their results were written: " + "; ".join(
                        f"{day}: {', '.join(ms)}" for day, ms in sorted(by_date.items())) + ".")
                if c := read_result("fedx_central"):
                    probes = ", ".join(f"{100 * r['probe']:.1f}" for r in c["curve"])
                    extra += (f"\n\nCentralised SimCLR with the same encoder, augmentations and "
                              f"probe (`benchmarks/fedx_central.py`, {c['machine']['date']}): "
                              f"{c['samples']} samples, batch {c['batch-size']}, lr {c['lr']}; "
                              f"probe after each of {c['epochs']} epochs ({c['curve'][-1]['steps']} "
                              f"steps in all): {probes} %, against the random-init "
                              f"{_pct(c['random-init-probe'])}.")
            if name == "fedade" and "steps" in d:
                extra = (f"\n\nThis run: {d['steps']} time steps x {d['rounds-per-step']} rounds, "
                         f"settings {', '.join(d['settings'])} (the script's defaults: 20 x 2, "
                         "label/lin, label/ber and covariate/lin); 10 clients, the same streams "
                         "and seeds for every variant.")
                plots = [f"![Fed-ADE, {s.replace('/', ' shift, ')}: online accuracy per time step]"
                         f"(benchmarks/results/fedade-{s.replace('/', '-')}.png)"
                         for s in d["settings"]
                         if (RESULTS / f"fedade-{s.replace('/', '-')}.png").exists()]
                if plots:
                    extra += ("\n\nOnline accuracy per time step (Fed-ADE also predict-then-"
                              "update; the ablations are in the table only):\n\n"
                              + "\n".join(plots))
            if name == "fedcc" and "splits-run" in d:
                c = d["config"]
                extra = (f"\n\nThis run: splits {', '.join(d['splits-run'])} (the script runs "
                         "pathological:1, dirichlet:0.05 and pathological:2 unless told "
                         f"otherwise); {c['train-samples']} training samples "
                         f"({100 * c['public-fraction']:.0f} % public), "
                         f"{c['num-server-rounds']} rounds, {c['local-epochs']} epochs of private "
                         f"training for every method, {c['fedcc-ssl-epochs']} of FedCC's third "
                         "stage (the fedcc@fedcc-ssl-epochs=20 row: the paper's 20, and a black "
                         f"probe image), {c['distill-epochs']} of distillation (FedDF also with 5), "
                         f"batch {c['batch-size']}.")
            if name.startswith("fedxds"):
                extra = ("\n\nRound at which each first reaches FedAvg's final accuracy: "
                         f"{d['rounds-to-fedavg-final']}")
                if "wall-seconds" in d:
                    extra += (f"\n\nThe whole benchmark ({d['num-clients']} clients) took "
                              f"{d['wall-seconds'] / 60:.0f} min.")
            note = f"\n\n{d['note']}" if d.get("note") else ""
            checks = f"\n\n{c}" if (c := _checks(d)) else ""
            out.append(f"**{title}** (`benchmarks/{name.split('-')[0]}.py`, {d['machine']['date']})"
                       f"\n\n{d['table']}{extra}{checks}{note}")
    if d := read_result("fedxds_privacy"):
        m, u = d["masked"], d["unmasked"]
        out.append(f"**FedXDS privacy** (`benchmarks/fedxds_privacy.py`, {d['machine']['date']}): "
                   f"σ = {d['sigma']} (ε ≈ {d['epsilon-per-unit-l2 (delta=1e-5)']:.1f} per unit L2 "
                   f"distance at δ = 1e-5), sparsity {d['sparsity']}, {d['n']} samples per set.\n\n"
                   "| shared data | inversion SSIM (lower = safer) | membership AUC (0.5 = no leak) | "
                   "test acc of a model trained with it |\n|---|---|---|---|\n"
                   f"| masked (LRP, binary) | {m['inversion-ssim']:.3f} | {m['mia-auc']:.3f} | "
                   f"{_pct(m['test-accuracy'])} |\n| unmasked | {u['inversion-ssim']:.3f} | "
                   f"{u['mia-auc']:.3f} | {_pct(u['test-accuracy'])} |\n\n{_checks(d)}")
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    text = render()
    if args.write_readme:
        readme = README.read_text()
        block = f"{START}\n{text}\n{END}"
        readme = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, readme, flags=re.S)
        README.write_text(readme)
    print(text)


if __name__ == "__main__":
    main()
