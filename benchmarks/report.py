"""Render benchmarks/results/*.json as the README's "Measured" section and the acceptance checks
at a glance that open "Known gaps" (no numbers typed by hand).

Usage: .venv/bin/python -m benchmarks.report [--write-readme]
"""

from __future__ import annotations

import argparse
import re

from benchmarks.common import RESULTS, ROOT, read_result

README = ROOT / "README.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
GLANCE_START, GLANCE_END = "<!-- glance:start -->", "<!-- glance:end -->"  # in Known gaps


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
                   f"{_pct(d['flower-final-accuracy'])}. "
                   + ("Flower's side is faster because two clients train at once in two 1-CPU "
                      "actors, where the plain loop runs one process on both cores. "
                      if d["ratio"] < 1 else "")
                   + f"What keeps the overhead low by design: data and "
                   f"partitions cached per process (not reloaded per message), uint8 tensors "
                   f"normalised per batch instead of DataLoader transforms, and 1 CPU per client "
                   f"(Ray's default of 2 would run the clients one at a time here). "
                   f"{d.get('note', '')}")
    for name, title in (("foundation-dirichlet0.5", "FedAvg / FedProx / SCAFFOLD / FedDyn / FedNova"),
                        ("fedx", "FedX vs its bases (linear probe)"),
                        ("fedcc", "FedCC vs FedDF, FedMD, FedCT, FedAvg, FedProx, FedNova, FedLC, FedRS, "
                                  "FedSAM, FedVLS, FedMR, FedConcat (ensemble accuracy)"),
                        ("fedfew", "FedFew vs IFCA, FedSoft, CFL, FedAvg, FedProx, FedMGDA+, FedRep, Ditto, "
                                   "APFL, FedAMP, Local (personalised)"),
                        ("fedxds", "FedXDS vs FedAvg, FedProx, SCAFFOLD, FedDyn, FedFTG, FedFed, "
                                   "unmasked sharing"),
                        ("fedxds-100clients", "FedXDS with 100 clients"),
                        ("fedade", "Fed-ADE vs fixed learning rates, FTH, Fed-POE, ATLAS"),
                        ("fedade_bounds", "Fed-ADE vs FixLR as both learning-rate bounds scale "
                                          "(no target; the checks above use the x1 bounds)")):
        if d := read_result(name):
            extra = ""
            if name == "fedx":
                extra = f"\n\nRandom-init encoder probe (the floor): {_pct(d['random-init-probe'])}"
                if per := d.get("random-init-probe-per-seed"):
                    extra += f" (mean; per seed {', '.join(_pct(v) for v in per.values())})"
                extra += "."
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
            if name == "fedfew" and "num-clients" in d:
                c = d["config"]
                extra = (f"\n\nSame partitions and seed for every method within a split: "
                         f"fashion-mnist, {d['num-clients']} clients, seed {c['seed']}, "
                         f"{c['train-samples']} training samples, each client's part split "
                         f"{100 * (1 - c['local-test-fraction']):.0f}/"
                         f"{100 * c['local-test-fraction']:.0f} into local train/test, K = "
                         f"{c['num-models']} models for FedFew and IFCA; rounds per split as in "
                         "the table.")
            if name.startswith("fedxds"):
                extra = ("\n\nRound at which each first reaches FedAvg's final accuracy: "
                         f"{d['rounds-to-fedavg-final']}")
                if "wall-seconds" in d:
                    dates = d.get("row-dates") or {}
                    last = max(dates.values(), default=None)
                    rerun = [m for m, t in dates.items() if t == last]
                    what = (f"The whole benchmark ({d['num-clients']} clients)"
                            if len(rerun) == len(dates) else
                            f"The last rerun ({', '.join(rerun)}; {d['num-clients']} clients)")
                    extra += f"\n\n{what} took {d['wall-seconds'] / 60:.0f} min."
            if (dates := d.get("row-dates")) and len(set(dates.values())) > 1:
                by_date: dict[str, list[str]] = {}
                for m, day in dates.items():
                    by_date.setdefault(day, []).append(m)
                extra += ("\n\nRows by the date their results were written: " + "; ".join(
                    f"{day}: {', '.join(ms)}" for day, ms in sorted(by_date.items())) + ".")
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
                   f"{u['mia-auc']:.3f} | {_pct(u['test-accuracy'])} |\n"
                   + (f"| FedFed's x_s (decoder; VAE fixed point {f['vae-inversion-ssim']:.3f}) | "
                      f"{f['inversion-ssim']:.3f} | {f['mia-auc']:.3f} | {_pct(f['test-accuracy'])} |\n"
                      if (f := d.get("fedfed")) else "")
                   + f"\n{_checks(d)}" + (f"\n\n{d['note']}" if d.get("note") else ""))
    return "\n\n".join(out)


def _status(*flags: bool | None) -> str:
    if not flags or any(f is None for f in flags):
        return "n/a"
    return "met" if all(flags) else "not met" if not any(flags) else "partly"


def _pp(a: float | None, b: float | None) -> str:
    """``a`` − ``b`` in percentage points; "-" where a run failed (no figure)."""
    return "-" if a is None or b is None else f"{100 * (a - b):+.2f} pp".replace("-", "−")


def _fedx_rows(d: dict) -> list[tuple[str, ...]]:
    c, r = d["checks"], {m: v["final-accuracy-mean"] for m, v in d["results"].items()}
    bn, byol = "@ssl-head-bn=true", "fedx@fedx-base='byol'"
    flags = (c["fedx(byol) >= fedbyol (last)"], c["fedx(byol) >= fedbyol, both with head BN (last)"])
    best = max((m for m in r if r[m] is not None), key=r.get, default=None)  # None: all failed
    return [("#3 FedX", "FedX on SimCLR ≥ FedSimCLR + 1 pp",
             _status(c["fedx(simclr) >= fedsimclr + 1pp (last)"]),
             f"{_pp(r['fedx'], r['fedsimclr'])} ({_pct(r['fedx'])} vs {_pct(r['fedsimclr'])}); "
             f"with BN heads {_pp(r['fedx' + bn], r['fedsimclr' + bn])}"),
            ("#3 FedX", "FedX on BYOL ≥ FedBYOL",
             "not met (met with BN heads)" if flags == (False, True) else _status(*flags),
             f"{_pp(r[byol], r['fedbyol'])}; with BN heads {_pp(r[byol + bn], r['fedbyol' + bn])}"),
            ("#3 FedX", "every method ≥ random-init probe + 10 pp",
             _status(*(v for k, v in c.items() if k.endswith("random-init + 10pp"))),
             f"floor {_pct(d['random-init-probe'])}; best method {best}: {_pct(r.get(best))}")]


def _fedxds_rows(d: dict) -> list[tuple[str, ...]]:
    c, r, rounds = d["checks"], d["results"], d["config"]["num-server-rounds"]
    issue = f"#5 FedXDS ({d['num-clients']} clients)"
    fx, fa = r["fedxds"].get("final-accuracy"), r["fedavg"].get("final-accuracy")
    reach = d["rounds-to-fedavg-final"]["fedxds"]
    return [(issue, "final ≥ FedAvg + 3 pp", _status(c["fedxds >= fedavg + 3pp"]),
             f"{_pp(fx, fa)} ({_pct(fx)} vs {_pct(fa)})"),
            (issue, "FedAvg's final accuracy within half the rounds",
             _status(c["fedxds reaches fedavg's final accuracy within half the rounds"]),
             f"first in round {reach} (≤ {rounds // 2} needed)" if reach
             else f"not reached in {rounds} rounds")]


def _privacy_rows(d: dict) -> list[tuple[str, ...]]:
    return [("#5 FedXDS", "inversion SSIM masked < unmasked",
             _status(d["checks"]["inversion SSIM masked < unmasked"]),
             f"{d['masked']['inversion-ssim']:.3f} vs {d['unmasked']['inversion-ssim']:.3f}")]


def _fedade_rows(d: dict) -> list[tuple[str, ...]]:
    c, r, rows = d["checks"], d["results"], []

    def acc(key: str, n: str) -> float | None:
        return r[key][n].get("mean-accuracy")

    for key in (k for k in ("label/lin", "label/ber") if k in r):
        for peer, check, label in (("FixLR(mid)", "FixLR(mid) + 1pp", "FixLR(mid) + 1 pp"),
                                   ("no adaptation", "no adaptation", "no adaptation")):
            rows.append(("#6 Fed-ADE", f"{key}: ≥ {label}", _status(c[f"{key} Fed-ADE >= {check}"]),
                         _pp(acc(key, "Fed-ADE"), acc(key, peer))))
    if "covariate/lin" in r:
        rows.append(("#6 Fed-ADE", "covariate/lin: ≥ FixLR(mid)",
                     _status(c["covariate/lin Fed-ADE >= FixLR(mid)"]),
                     _pp(acc("covariate/lin", "Fed-ADE"), acc("covariate/lin", "FixLR(mid)"))))
    if "label/lin" in r:
        w = {n: r["label/lin"][n].get("wall-seconds") for n in ("Fed-ADE", "FixLR(mid)")}
        rows.append(("#6 Fed-ADE", "wall time ≤ 1.2 × FixLR(mid)'s (label/lin)",
                     _status(c["wall time Fed-ADE <= 1.2 x FixLR(mid)"]),
                     " vs ".join("-" if v is None else f"{v:.0f}" for v in w.values()) + " s"))
    return rows


def _fedfew_rows(d: dict) -> list[tuple[str, ...]]:
    c, rows = d["checks"], []
    for split, res in d["results"].items():
        a = {m: res[m].get("client-accuracy") for m in ("fedfew", "ifca", "fedavg")}
        rows.append(("#7 FedFew", f"{split}: ≥ IFCA and ≥ FedAvg + 5 pp",
                     _status(c[f"{split} fedfew >= ifca"], c[f"{split} fedfew >= fedavg + 5pp"]),
                     f"{_pct(a['fedfew'])} vs {_pct(a['ifca'])} and {_pct(a['fedavg'])} "
                     f"({d['split-configs'][split]['num-server-rounds']} rounds)"))
    return rows


GLANCE = (("fedx", _fedx_rows), ("fedxds", _fedxds_rows), ("fedxds-100clients", _fedxds_rows),
          ("fedxds_privacy", _privacy_rows), ("fedade", _fedade_rows), ("fedfew", _fedfew_rows))


def glance() -> str:
    """Every open issue's acceptance checks in one table, with the figures each check compares
    (a benchmark whose results lack a row's figures gets one row saying which)."""
    rows = []
    for name, rows_of in GLANCE:
        if d := read_result(name):
            try:
                rows += rows_of(d)
            except KeyError as e:
                rows.append((name, "-", "n/a", f"benchmarks/results/{name}.json lacks {e}"))
    return ("| issue | check | status | measured |\n|---|---|---|---|\n"
            + "\n".join(f"| {' | '.join(row)} |" for row in rows))


def write_readme(readme: str) -> str:
    """The README with both generated blocks rendered anew from benchmarks/results."""
    for (start, end), text in (((START, END), render()), ((GLANCE_START, GLANCE_END), glance())):
        block = f"{start}\n{text}\n{end}"
        readme = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _, b=block: b, readme,
                        flags=re.S)
    return readme


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args()
    if args.write_readme:
        README.write_text(write_readme(README.read_text()))
    print(render() + "\n\n" + glance())


if __name__ == "__main__":
    main()
