"""Helpers shared by the benchmark scripts: where results go and how they are printed."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowerbed.engine import PROJECT

ROOT = PROJECT  # the project: runs/, presets/, README.md
RESULTS = ROOT / "benchmarks" / "results"


def machine() -> dict[str, Any]:
    from flowerbed.results import software

    return {"cpus": os.cpu_count(), **software(), "cuda": torch.cuda.is_available(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Print the figures and write them to benchmarks/results/<name>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "machine": machine(), **data}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    print(f"written: {path}; to update the README: .venv/bin/python -m benchmarks.report --write-readme")
    return path


def read_result(name: str) -> dict[str, Any]:
    """benchmarks/results/<name>.json as written by :func:`write_result` ({} when absent)."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two run-config overrides make the same runs: a key at its default value counts
    as absent (a preset that later names a default, such as fedx-tau-local = 0.1 in
    presets/fedx-cpu.toml, measures what it measured before)."""
    from flowerbed.config import defaults

    d = defaults()

    def effective(c: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in c.items() if k not in d or d[k] != v}

    return effective(a) == effective(b)


def kept_splits(name: str, config: dict[str, Any], vary: tuple[str, ...] = ()
                ) -> tuple[dict[str, dict], dict[str, dict]]:
    """Results and settings of the splits an earlier run of benchmark ``name`` measured with
    ``config`` (keys in ``vary`` may differ): kept when a run measures only some splits."""
    old = read_result(name)

    def fixed(c: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in c.items() if k not in vary}

    keep = [s for s, c in old.get("split-configs", {}).items() if same_settings(fixed(c), fixed(config))]
    return ({s: old["results"][s] for s in keep}, {s: old["split-configs"][s] for s in keep})


#: runs of this invocation that failed (compare's failed rows): the script exits 1 after writing
FAILED: list[str] = []


def checked(methods: list[str], overrides: dict[str, Any], num_clients: int,
            seeds: list[int] | None = None) -> None:
    """Each run's config and split, as `flowerbed compare` checks them before anything runs
    (the scripts call :func:`flowerbed.compare.compare` directly: a bad split or value used to
    fail every run, or end in a traceback after minutes). A ConfigError stops the script."""
    from flowerbed.cli import preflight
    from flowerbed.compare import parse_variant

    for seed in seeds or [overrides.get("seed", 0)]:
        for m in methods:
            preflight({**overrides, **parse_variant(m)[1], "seed": seed}, num_clients, 0.0)


def note_failures(out: Path) -> list[str]:
    """The failed runs of the comparison in ``out``, remembered for the exit code."""
    from flowerbed.compare import failed_runs

    failed = failed_runs(out)
    FAILED.extend(f"{out.name}: {f}" for f in failed)
    return failed


def run_main(main: Callable[[], None]) -> None:
    """A script's entry point as the CLI's: SIGTERM/SIGHUP stop its runs (Ray, the SuperLink)
    as Ctrl-C does, a ConfigError is one line, exit 1 when a run failed."""
    from flowerbed.cli import signals_interrupt
    from flowerbed.config import ConfigError

    try:
        with signals_interrupt():
            main()
    except ConfigError as e:
        raise SystemExit(f"benchmark: {e}") from None
    if FAILED:
        raise SystemExit(f"benchmark: {len(FAILED)} run(s) failed: {', '.join(FAILED)}")


def _list_of(kind: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``kind`` values that pass ``ok``."""
    import argparse

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x]
        except ValueError:
            values = []
        if not values or not all(map(ok, values)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}")
        return values
    return parse


#: argparse types of the scripts' options
seed_list = _list_of(int, "seeds (integers >= 0)", lambda v: v >= 0)
scale_list = _list_of(float, "numbers > 0", lambda v: v > 0)
setting_list = _list_of(lambda x: tuple(x.split("/")), "shift/schedule pairs (label/lin, covariate/ber, ...)",
                        lambda v: len(v) == 2 and all(v))


def kept_note(name: str, kept: bool) -> dict[str, str]:
    """``{"note": ...}`` of benchmarks/results/<name>.json when rows of it are kept: a note
    written by hand about those rows stays with them (``{}`` otherwise)."""
    note = read_result(name).get("note") if kept else None
    return {"note": note} if note else {}


def rows_to_run(text: str, rows: list[str], what: str = "rows") -> list[str]:
    """``--methods`` (or ``--splits``): a comma-separated subset of the benchmark's rows (splits),
    spelt as they are (one spelt otherwise would run, then be left out of the table)."""
    run = [m for m in text.split(",") if m]
    if unknown := [m for m in run if m not in rows]:
        raise SystemExit(f"not {what} of this benchmark: {unknown}; its {what}: {', '.join(rows)}")
    return run


def run_rows(out: Path, label: str) -> list[dict[str, Any]]:
    """The metrics rows of the run ``label`` in the comparison ``out``; none where the run
    failed before its first row (its summary then holds the error)."""
    from flowerbed.compare import run_label
    from flowerbed.results import read_metrics

    path = out / run_label(label)
    return read_metrics(path) if (path / "metrics.jsonl").is_file() else []


def merged_rows(kept: dict[str, Any], new: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """One split's rows: the kept earlier ones overlaid by this run's, in ``order``."""
    merged = {**kept, **new}
    return {m: merged[m] for m in order if m in merged}
