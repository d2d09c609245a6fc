"""FedAvg / FedProx / SCAFFOLD (FedDyn, FedNova: --update) through the launcher, same partitions and seeds.

Target (issue #2): FedAvg, fashion-mnist, dirichlet:0.5, 10 clients, 20 rounds, 1 local epoch
reaches >= 88 % test accuracy.
Usage: .venv/bin/python -m benchmarks.foundation [--rounds 20] [--partition dirichlet:0.5]
       [--methods scaffold --update]   (rerun some methods, keep the others' measured results)
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import (
    RESULTS,
    ROOT,
    checked,
    kept_note,
    note_failures,
    read_result,
    run_main,
    write_result,
)
from flowerbed.compare import compare, markdown_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--partition", default="dirichlet:0.5")
    ap.add_argument("--methods", default="fedavg,fedprox,scaffold")
    ap.add_argument("--update", action="store_true",
                    help="merge into the existing results instead of replacing them")
    args = ap.parse_args()
    tag = args.partition.replace(":", "")
    methods = args.methods.split(",")
    out = ROOT / "runs" / (f"bench-foundation-{tag}" + ("-" + "-".join(methods) if args.update else ""))
    overrides = {"partition": args.partition, "num-server-rounds": args.rounds, "seed": 0}
    previous = read_result(f"foundation-{tag}") if args.update else None
    if previous and previous.get("config", overrides) != overrides:  # before the runs, not after
        raise SystemExit(f"--update: the stored results were measured with {previous['config']}, "
                         f"not {overrides}; rerun every method without --update")
    checked(methods, overrides, 10)
    compare(methods, overrides, num_clients=10, out=out)
    results = json.loads((out.resolve() / "results.json").read_text())
    if len(note_failures(out)) == len(methods):  # nothing measured: the stored results stay
        return
    if previous:
        results = {**previous["results"], **results}
    table = markdown_table(results, overrides, 10)
    (RESULTS / f"foundation-{tag}.md").write_text(table + "\n")
    fedavg = results.get("fedavg", {}).get("final-accuracy")
    target_setting = (args.partition, args.rounds) == ("dirichlet:0.5", 20)  # the issue's
    write_result(f"foundation-{tag}", {
        "table": table, "results": results, "config": overrides,
        "target": "fedavg final accuracy >= 0.88 (dirichlet:0.5, 20 rounds)",
        "checks": {"fedavg >= 88 % after 20 rounds on dirichlet:0.5":
                   (fedavg is not None and fedavg >= 0.88) if target_setting else None},
        **kept_note(f"foundation-{tag}", bool(previous)),
    })


if __name__ == "__main__":
    run_main(main)
