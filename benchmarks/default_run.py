"""What `make run` does once installed: the default simulation, timed from the shell's view.

Target (issue #2): <= 5 minutes on 2 CPU cores, start-up included, and >= 85 % test accuracy.
Usage: .venv/bin/python -m benchmarks.default_run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks.common import ROOT, run_main, write_result
from flowerbed.config import Config
from flowerbed.results import read_metrics


def main() -> None:
    argparse.ArgumentParser(description=__doc__,  # no options: --help only, not a 3-minute run
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    name = f"bench-default-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "flowerbed", "run", "--num-clients", "10",
                    "-c", f"run-name='{name}'"], cwd=ROOT, check=True)
    wall = time.time() - t0
    cfg = Config.from_run_config()
    rows = read_metrics(ROOT / cfg.output_dir / name)
    write_result("default_run", {
        "command": "make run (flowerbed run --num-clients 10, default run config)",
        "config": {"partition": str(cfg.partition), "rounds": cfg.num_server_rounds,
                   "clients": 10, "local-epochs": cfg.local_epochs, "batch-size": cfg.batch_size},
        "wall-seconds": round(wall, 1),
        "final-accuracy": rows[-1]["accuracy"],
        "accuracy-per-round": [r.get("accuracy") for r in rows],
        "seconds-per-round": [r.get("seconds") for r in rows],
        "target": {"wall-seconds-max": 300, "accuracy-min": 0.85},
        "met": wall <= 300 and rows[-1]["accuracy"] >= 0.85,
    })


if __name__ == "__main__":
    run_main(main)
