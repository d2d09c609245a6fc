"""FedCC vs distillation and parameter-based baselines under label skew, Fashion-MNIST (ensemble accuracy).

Baselines: FedDF, FedMD, FedCT (distillation); FedAvg, FedProx, FedNova, FedLC, FedRS, FedSAM, FedVLS,
FedMR, FedConcat (parameter-based; its rows add 20 rounds of its classifier stage, see FEDCONCAT).
Same public set (a seeded 10 % of the training set, unlabelled), partitions and seeds for every
method; 10 clients; the distillation methods use two CNN widths (half the clients each), the
parameter-based methods (FedAvg, FedProx, FedNova, FedLC, FedRS, FedSAM, FedVLS, FedMR) the full-width CNN.
Targets (issue #4): with pathological:1, FedCC >= 50 %, >= FedDF + 20 pp and >= FedAvg + 20 pp;
with dirichlet:0.05 and pathological:2, FedCC >= FedDF; FedCC's upload per client per round
<= 1/10 of FedAvg's.

Epochs: the paper runs 20 epochs per stage for every method; this CPU preset runs 5 epochs of
private training for every method (``local-epochs``: FedAvg's local training, FedDF's and FedMD's
private fit, FedCT's fit on private and pseudo-labelled public data, FedCC's supervised fit) and 5
of FedCC's third stage, and 1 epoch of distillation (``distill-epochs``; the paper does not state it
separately). With 1 epoch per stage FedCC's clients never settle on their own class and the ensemble
stayed near 14 % (2026-11-29 run), and with 5 distillation epochs the distilled targets spread every
client's class bias over all classes, so no pseudo-label says "unknown" any more (in-process: 36 %
after round 1, 10 % after round 3). FedDF also runs with 5 distillation epochs
(``feddf@distill-epochs=5``) so that the longer distillation it may prefer is measured too. FedCC
also runs with the paper's 20 epochs for its third stage and a black probe image (Fashion-MNIST's
background, a solid colour as in CDMAD) (``PAPER_FEDCC``): with 5 epochs and the mean-intensity
probe, some clients' probe bias covered all classes by round 3-4 (w_u = 0) and the ensemble
collapsed. Its checks are reported separately. Usage: .venv/bin/python -m benchmarks.fedcc [--rounds
5] [--train-samples 10000] [--splits ...]        [--methods ...] [--resume] """

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
    write_result,
)
from flowerbed.compare import compare, markdown_table

PAPER_FEDCC = "fedcc@fedcc-ssl-epochs=20@fedcc-probe-input='black'"
#: FedConcat's encoder stage takes the 5 rounds every method trains for; its classifier stage
#: (3 mini-batches of a linear layer a round; the official code runs 1000 such rounds) 20 more,
#: scored every 5 rounds (each classifier round sends the 5 cluster models to every client)
FEDCONCAT = "fedconcat@fedconcat-encoder-rounds=5@num-server-rounds=25@eval-every=5"
#: ... and with a classifier rate 10x lower: at lr 0.01, the code's rate, the classifier diverged
#: on pathological:1 in a first run (its concatenated features turned out to have a mean squared
#: norm near 6e5 there, which puts SGD's stability bound near 1e-5: 0.001 diverged too)
FEDCONCAT_STABLE = FEDCONCAT + "@fedconcat-classifier-lr=0.001"
METHODS = ["fedcc", PAPER_FEDCC, "feddf", "feddf@distill-epochs=5", "fedmd", "fedct", "fedavg", "fedprox",
           "fednova", "fedlc", "fedrs", "fedsam", "fedvls", "fedmr", FEDCONCAT, FEDCONCAT_STABLE]
SPLITS = ["pathological:1", "dirichlet:0.05", "pathological:2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train-samples", type=int, default=10000)
    ap.add_argument("--splits", default=",".join(SPLITS))
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="run only these (comma-separated); the others' earlier results are kept")
    ap.add_argument("--resume", action="store_true",
                    help="keep the methods that finished in an earlier run, continue the others")
    args = ap.parse_args()
    run = rows_to_run(args.methods, METHODS)
    base = {"public-fraction": 0.1, "num-server-rounds": args.rounds, "local-epochs": 5,
            "distill-epochs": 1, "fedcc-ssl-epochs": 5, "batch-size": 64, "seed": 0,
            "train-samples": args.train_samples, "eval-every": 1}
    splits = rows_to_run(args.splits, SPLITS, "splits")
    results, configs = kept_splits("fedcc", base)
    note = kept_note("fedcc", bool(results))  # read before this run rewrites the file
    for split in splits:
        checked(run, {**base, "partition": split}, 10)
    for split in splits:  # results are written after each split
        out = ROOT / "runs" / f"bench-fedcc-{split.replace(':', '')}"
        compare(run, {**base, "partition": split}, num_clients=10, out=out,
                resume=args.resume)
        note_failures(out)
        results[split] = merged_rows(results.get(split, {}),
                                     json.loads((out / "results.json").read_text()), METHODS)
        configs[split] = base
        table = "\n\n".join(f"### {s}\n\n" + markdown_table(results[s], {**base, "partition": s}, 10)
                              for s in SPLITS if s in results)
        (RESULTS / "fedcc.md").write_text(table + "\n")
        write_result("fedcc", {"table": table, "checks": checks(results), "config": base,
                               "splits-run": list(results), "split-configs": configs,
                               "results": results, **note})


def checks(results: dict) -> dict[str, bool | None]:
    """The issue's targets for each FedCC row; None where a split or method has not been run."""
    return {k: v for f in ("fedcc", PAPER_FEDCC) for k, v in checks_for(results, f).items()}


def checks_for(results: dict, fedcc: str) -> dict[str, bool | None]:

    def acc(split: str, m: str) -> float | None:
        """Final accuracy; for "feddf", the better of its two distillation settings."""
        runs = [m, f"{m}@distill-epochs=5"] if m == "feddf" else [m]
        found = [results.get(split, {}).get(r, {}).get("final-accuracy") for r in runs]
        found = [a for a in found if a is not None]
        return max(found) if found else None

    def up(split: str, m: str) -> float | None:
        return results.get(split, {}).get(m, {}).get("bytes-up-per-client-round")

    p1 = "pathological:1"
    return {
        f"pathological:1 {fedcc} >= 0.50": _ge(acc(p1, fedcc), 0.0, 0.50),
        f"pathological:1 {fedcc} >= feddf + 20pp": _ge(acc(p1, fedcc), acc(p1, "feddf"), 0.20),
        f"pathological:1 {fedcc} >= fedavg + 20pp": _ge(acc(p1, fedcc), acc(p1, "fedavg"), 0.20),
        f"dirichlet:0.05 {fedcc} >= feddf": _ge(acc("dirichlet:0.05", fedcc),
                                             acc("dirichlet:0.05", "feddf"), 0.0),
        f"pathological:2 {fedcc} >= feddf": _ge(acc("pathological:2", fedcc),
                                             acc("pathological:2", "feddf"), 0.0),
        f"{fedcc} upload <= fedavg upload / 10": (None if up(p1, fedcc) is None or up(p1, "fedavg") is None
                                               else up(p1, fedcc) <= up(p1, "fedavg") / 10),
    }


def _ge(a: float | None, b: float | None, margin: float) -> bool | None:
    return None if a is None or b is None else a >= b + margin


if __name__ == "__main__":
    run_main(main)
