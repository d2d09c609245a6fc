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
    print(f"written: {path}")
    return path
