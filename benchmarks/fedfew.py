"""FedFew vs IFCA, FedSoft, CFL, FedAvg (global and fine-tuned), FedProx, FedMGDA+, FedRep, Ditto, APFL,
FedAMP and Local: personalised accuracy (the global methods' model on each client's local test split).

Fashion-MNIST, 20 clients, pathological:2 and dirichlet:0.1, a 75/25 local train/test split per
client, the same settings and seeds for every method (SGD as everywhere in flowerbed; the
official FedFew code uses momentum-free SGD, lr 0.005, batch 50). Personalised accuracy =
each client's served model on its local test split, sample-weighted over clients; min-client
accuracy and Jain's index alongside. Targets (issue #7): FedFew (K = 3) >= IFCA (K = 3) and
>= FedAvg + 5 pp on both splits, checked on FedFew's default (identical initialisation of the K
models, as the official code); the opt-in ``fedfew-distinct-init`` is reported alongside (IFCA
always starts its K models from distinct initialisations), and so is the opt-in server step
``fedfew-server-lr=3`` (= K: the paper's step of 1 moves each model by Σ_i α_i w_ik, about 1/K of
a FedAvg step, which the paper's 2000 rounds absorb and our 30 do not), and the opt-in
``fedfew-step='normalised'`` (each model the α_i w_ik-weighted average of its clients' models).
FedFew under the official code's evaluation (``fedfew-eval='local'``: the K models as each client
has just trained them) is reported without a check: it includes a local fine-tuning step, so its
peer is fedavg-ft.
Both splits' stored rows are 30-round runs (pathological:2 rerun at 30 on 2026-12-05; its earlier
10-round rows, where FedFew led IFCA, are in docs/known-gaps.md).
Usage: .venv/bin/python -m benchmarks.fedfew [--rounds 30] [--train-samples 12000]
       [--splits dirichlet:0.1] [--methods ...]
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import (
    RESULTS,
    ROOT,
    checked,
    kept_note,
    kept_splits,
    merged_rows,
    note_failures,
    rows_to_run,
    run_main,
    run_rows,
    write_result,
)
from flowerbed.compare import compare, megabytes
from flowerbed.results import md_table, pct

OPT_IN = {"fedfew@fedfew-distinct-init=true": "fedfew (distinct init)",  # reported alongside
          "fedfew@fedfew-server-lr=3.0": "fedfew (server lr 3)",
          "fedfew@fedfew-step='normalised'": "fedfew (normalised step)"}
# reported, not checked: the official code's evaluation scores each client's K models after that
# round's local training, a fine-tuning step the server-model rows do not get (compare it with
# fedavg-ft, not with fedavg)
PROTOCOL = {"fedfew@fedfew-eval='local'": "fedfew (official code's evaluation)"}
METHODS = ["fedfew", *OPT_IN, *PROTOCOL, "ifca", "fedsoft", "cfl", "fedavg", "fedavg-ft", "fedprox",
           "fedmgda", "fedrep", "ditto", "apfl", "fedamp", "local"]
SPLITS = ["pathological:2", "dirichlet:0.1"]
NUM_CLIENTS = 20
KEYS = ("client-accuracy", "client-accuracy-min", "client-accuracy-std", "jain-index")
UP = "bytes-up-per-client-round"  # from the run's summary: K models for FedFew, one for the rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--train-samples", type=int, default=12000)
    ap.add_argument("--splits", default=",".join(SPLITS),
                    help="splits to run; the others keep their earlier results (with their rounds) "
                         "if their other settings are the same")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="run only these (comma-separated); the others' earlier results on the same "
                         "split are kept if measured with the same settings")
    args = ap.parse_args()
    run = rows_to_run(args.methods, METHODS)
    base = {"num-server-rounds": args.rounds, "local-test-fraction": 0.25, "num-models": 3,
            "train-samples": args.train_samples, "eval-every": 5, "seed": 0}
    splits = rows_to_run(args.splits, SPLITS, "splits")
    results, configs = kept_splits("fedfew", base, vary=("num-server-rounds",))
    note = kept_note("fedfew", bool(results))
    for split in splits:
        checked(run, {**base, "partition": split}, NUM_CLIENTS)
    for split in splits:
        out = ROOT / "runs" / f"bench-fedfew-{split.replace(':', '')}"
        compare(run, {**base, "partition": split}, num_clients=NUM_CLIENTS, out=out)
        note_failures(out)
        # earlier rows of this split are kept only if measured with these rounds too
        kept = results.get(split, {}) if configs.get(split) == base else {}
        last = {m: (run_rows(out, m) or [{}])[-1] for m in run}  # {} where a run failed
        summaries = json.loads((out / "results.json").read_text())
        new = {m: {**{k: last[m].get(k) for k in KEYS},
                   UP: summaries[m].get(UP)} for m in run}
        results[split], configs[split] = merged_rows(kept, new, METHODS), base
    table, checks = render(results, configs)
    (RESULTS / "fedfew.md").write_text(table + "\n")
    write_result("fedfew", {"table": table, "checks": checks, "config": base,
                            "num-clients": NUM_CLIENTS, "split-configs": configs,
                            "results": results, **note})


def render(results: dict[str, dict], configs: dict[str, dict]) -> tuple[str, dict[str, bool | None]]:
    """The README table and the target checks from the per-split rows."""
    rows = []
    for split in (s for s in SPLITS if s in results):
        for m in METHODS:
            r = results[split].get(m, dict.fromkeys(KEYS))
            rows.append([split, str(configs[split]["num-server-rounds"]), m,
                         pct(r["client-accuracy"]), pct(r["client-accuracy-min"]),
                         _num(r["client-accuracy-std"]), _num(r["jain-index"]), _mb(r.get(UP))])
    table = "\n".join(md_table(["split", "rounds", "method", "personalised acc %", "min client %",
                                 "std", "Jain", "up MB/client/round"], rows))

    def acc(split: str, m: str) -> float | None:
        return results.get(split, {}).get(m, {}).get("client-accuracy")

    checks = {}
    for split in SPLITS:
        few, ifca, avg = acc(split, "fedfew"), acc(split, "ifca"), acc(split, "fedavg")
        checks[f"{split} fedfew >= ifca"] = None if None in (few, ifca) else few >= ifca
        checks[f"{split} fedfew >= fedavg + 5pp"] = None if None in (few, avg) else few >= avg + 0.05
        for m, name in OPT_IN.items():
            alt = acc(split, m)
            checks[f"{split} {name} >= ifca"] = None if None in (alt, ifca) else alt >= ifca
            checks[f"{split} {name} >= fedavg + 5pp"] = (None if None in (alt, avg)
                                                         else alt >= avg + 0.05)
    return table, checks


def _mb(v: float | None) -> str:
    return "-" if v is None else megabytes(v)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    run_main(main)
