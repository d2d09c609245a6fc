"""The SuperNode-dropout scenario shared by the loopback and the network-namespace deployment
tests: start a run, kill one SuperNode once round 1 is logged (round 2's messages are then out),
start it again or not, and check what the metrics say about it."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flowerbed import deploy
from flowerbed.results import read_metrics


def run_killing_node(dep: deploy.Deployment, rc: dict, log_file: Path, node: int = 2,
                     restart: Callable[[], None] | None = None) -> tuple[dict, list[dict]]:
    """``deploy.run`` with ``rc``; SIGTERM SuperNode ``node`` during round 2 (then ``restart``
    once it has exited, where given). Returns the summary (empty if the run failed) and the
    metrics rows."""
    run_dir = Path(rc["output-dir"]) / rc["run-name"]
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        s=deploy.run(dep, rc, quiet=True, log_file=log_file)))
    t.start()
    t0 = time.time()
    while not round_1_logged(run_dir):
        assert (time.time() - t0 < 900 and t.is_alive()) or round_1_logged(run_dir), (
            "round 1 was not logged: " + log_file.read_text(errors="replace")[-3000:])
        time.sleep(0.5)
    time.sleep(1.0)  # round 2's training messages are out
    deploy.kill_node(dep, node)
    if restart:
        t1 = time.time()
        while dep.alive(f"supernode-{node}") and time.time() - t1 < 60:  # (Flower's own: 5 s)
            time.sleep(0.2)
        deploy.kill_node(dep, node, signal.SIGKILL)
        restart()
        deploy.wait_online(dep, 1, since=t1)  # (the restarted one) its log, should it not come up
    t.join(timeout=1800)
    assert "s" in result, log_file.read_text()[-3000:]
    return result["s"], read_metrics(run_dir)


def round_1_logged(run_dir: Path) -> bool:
    try:
        return len(read_metrics(run_dir)) >= 2
    except (OSError, ValueError):  # not there yet, or a line read half-written
        return False


def assert_dropped(rows: list[dict], node: int, num_nodes: int) -> None:
    """A 3-round run where ``node`` was killed in round 2: its in-flight message fails, then it
    is reported lost and no longer sampled; the others go on."""
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[1]["clients-ok"] == num_nodes
    failed = [f["partition"] for r in rows[2:] for f in r["failures"]]
    lost = [p for r in rows[2:] for p in r["clients-lost"]]
    assert set(failed) <= {node} and lost == [node], (failed, lost)
    assert rows[3]["clients-ok"] == num_nodes - 1


def assert_rejoined(rows: list[dict], node: int, num_nodes: int, node_log: str) -> None:
    """A 3-round run where ``node`` was killed in round 2 and its SuperNode started again: its
    in-flight message fails, it is reported lost, and in round 3 its new node serves its
    partition, its client having put back the state it filed in round 1 (or 2)."""
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[1]["clients-ok"] == num_nodes
    failed = [f["partition"] for r in rows[2:] for f in r["failures"]]
    lost = [p for r in rows[2:] for p in r["clients-lost"]]
    assert set(failed) <= {node} and lost == [node], (failed, lost)
    answered = {int(p) for p, m in rows[3]["per-client"].items() if "train-examples" in m}
    assert answered == set(range(num_nodes)), (answered, node_log[-3000:])
    assert re.search(rf"partition {node}: restored its state from round [12] ", node_log), node_log[-3000:]
