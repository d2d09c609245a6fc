"""Helpers shared by the benchmark scripts: where results go and how they are printed."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


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


def kept_splits(name: str, config: dict[str, Any], vary: tuple[str, ...] = ()
                ) -> tuple[dict[str, dict], dict[str, dict]]:
    """Results and settings of the splits an earlier run of benchmark ``name`` measured with
    ``config`` (keys in ``vary`` may differ): kept when a run measures only some splits."""
    old = read_result(name)

    def fixed(c: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in c.items() if k not in vary}

    keep = [s for s, c in old.get("split-configs", {}).items() if fixed(c) == fixed(config)]
    return ({s: old["results"][s] for s in keep}, {s: old["split-configs"][s] for s in keep})


def rows_to_run(text: str, rows: list[str]) -> list[str]:
    """``--methods``: a comma-separated subset of the benchmark's rows, spelt as they are (a row
    spelt otherwise would run, then be dropped from the table by :func:`merged_rows`)."""
    run = [m for m in text.split(",") if m]
    if unknown := [m for m in run if m not in rows]:
        raise SystemExit(f"not rows of this benchmark: {unknown}; its rows: {', '.join(rows)}")
    return run


def merged_rows(kept: dict[str, Any], new: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """One split's rows: the kept earlier ones overlaid by this run's, in ``order``."""
    merged = {**kept, **new}
    return {m: merged[m] for m in order if m in merged}
