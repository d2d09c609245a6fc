"""The launcher: several methods through the same Flower apps, identical partitions and seeds."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from flowerbed import engine
from flowerbed.results import plot_curves, read_metrics

log = logging.getLogger("flowerbed")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``method`` or ``method@key=value@key=value`` -> (label, run-config overrides).

    E.g. ``fedx@fedx-base='byol'`` runs FedX over BYOL; the label names its run directory.
    """
    from flwr.common.config import parse_config_args

    method, *pairs = spec.split("@")
    extra = parse_config_args([" ".join(pairs)]) if pairs else {}
    return spec, {"method": method.strip(), **extra}


def run_label(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.replace("'", ""))


def compare(methods: list[str], overrides: dict[str, Any], num_clients: int,
            cpus_per_client: float = 1.0, gpus_per_client: float = 0.0,
            out: Path | None = None, resume: bool = False) -> str:
    """Run each method with the same run config (partition, seed, rounds...) and tabulate.

    ``methods`` are names or variants (:func:`parse_variant`). With ``resume`` (an existing
    ``out``), a method whose run finished is kept, one that stopped continues from its
    checkpoint, one that never started runs. Writes ``<out>/<label>/`` run
    directories, ``results.json``, ``table.md`` and
    ``accuracy.png`` (every method's curve); returns the markdown table.
    """
    out = (out or Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    fed = engine.federation_config(num_clients, cpus_per_client, gpus_per_client)
    results: dict[str, dict[str, Any]] = {}
    with engine.local_superlink() as (home, conn):
        for m in methods:
            _, variant = parse_variant(m)
            name = run_label(m)
            rc = {**overrides, **variant, "output-dir": str(out), "run-name": name}
            run_dir = out / name
            if resume and (run_dir / "summary.json").exists():
                log.info("compare: %s finished before; kept", m)
                results[m] = json.loads((run_dir / "summary.json").read_text())
                continue
            if resume and (run_dir / "checkpoint.pt").exists():
                rc["resume"] = str(run_dir)
            elif run_dir.exists():  # a fresh comparison into an old folder: keep the old run aside
                stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
                while (aside := run_dir.with_name(f"{name}.old-{stamp}" + (f"-{n}" if n > 1 else ""))
                       ).exists():
                    n += 1
                run_dir.rename(aside)
                log.warning("compare: an earlier %s run was moved to %s", m, aside)
            log.info("compare: %s%s", m, " (resumed)" if "resume" in rc else "")
            try:
                results[m] = engine.flwr_run(home, conn, rc, fed, log_file=out / f"{name}.log")
            except engine.RunFailed as e:  # keep the other methods' results
                log.error("%s", e)
                results[m] = {"error": str(e)}
            (out / "results.json").write_text(json.dumps(results, indent=2))
    curves = {m: read_metrics(out / run_label(m)) for m in methods if "error" not in results[m]}
    plot_curves(curves, out / "accuracy.png", title=_title(overrides, num_clients))
    table = markdown_table(results, overrides, num_clients)
    (out / "table.md").write_text(table + "\n")
    log.info("compare: wrote %s", out)
    return table


def _title(overrides: dict[str, Any], n: int) -> str:
    return (f"{overrides.get('dataset', 'fashion-mnist')}, {overrides.get('partition')}, "
            f"{n} clients, seed {overrides.get('seed', 0)}")


def markdown_table(results: dict[str, dict[str, Any]], overrides: dict[str, Any], n: int) -> str:
    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.2f}"

    lines = [f"Same partitions and seed for every method: {_title(overrides, n)}, "
             f"{overrides.get('num-server-rounds')} rounds.", "",
             "| method | final acc % | best acc % (round) | up MB/client/round | failures | wall s |",
             "|---|---|---|---|---|---|"]
    for m, s in results.items():
        if "error" in s:
            lines.append(f"| {m} | failed | - | - | - | - |")
            continue
        up = s.get("bytes-up-per-client-round")
        lines.append(f"| {m} | {pct(s.get('final-accuracy'))} | {pct(s.get('best-accuracy'))} "
                     f"({s.get('best-round')}) | {'-' if up is None else f'{up / 1e6:.2f}'} | "
                     f"{s.get('client-failures-total', 0)} | {s.get('wall-seconds', 0):.0f} |")
    return "\n".join(lines)
