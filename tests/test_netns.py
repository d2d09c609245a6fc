"""Several hosts on one machine: the SuperLink and each SuperNode in a network namespace of its own
(``ip netns`` + veth through a bridge), TLS with the SuperLink's address in its certificate, each
SuperNode reading only its own data folder, and one SuperNode killed in the middle of round 2.

Needs root and iproute2 (CI runs as root); skipped, with the reason, elsewhere (where
tests/test_deploy.py kills a SuperNode on loopback instead).
"""

from __future__ import annotations

import threading
import time

import pytest
from netns import Hosts, netns_usable

from flowerbed import deploy
from flowerbed.config import Config
from flowerbed.datasets.federated import export_partitions
from flowerbed.results import read_metrics


@pytest.mark.skipif(bool(reason := netns_usable()), reason=reason or "")
def test_separate_hosts_with_tls_own_data_and_a_dropout(tmp_path):
    rc = {"method": "fedavg", "num-server-rounds": 3, "train-samples": 1200, "test-samples": 300,
          "min-clients": 2, "eval-every": 3, "output-dir": str(tmp_path), "run-name": "netns"}
    cfg = Config.from_run_config({k: v for k, v in rc.items() if k not in ("output-dir", "run-name")})
    folders = export_partitions(cfg, 3, tmp_path / "client-data")  # each host gets only its part
    hosts = Hosts(["superlink", "supernode-0", "supernode-1", "supernode-2"])
    result: dict = {}
    try:
        sl = hosts.ip["superlink"]
        dep = deploy.Deployment(home=tmp_path / "home", address=f"{sl}:8000")
        with_data = [{"data-dir": str(f)} for f in folders]
        deploy.up(dep, 3, host="0.0.0.0", node_extra=with_data, cert_hosts=[sl], wrap=hosts.wrap)
        try:
            t = threading.Thread(target=lambda: result.update(
                s=deploy.run(dep, rc, quiet=True, log_file=tmp_path / "netns.log")))
            t.start()
            t0 = time.time()  # once round 1 is logged, round 2's messages are out: kill node 2
            while time.time() - t0 < 300 and not (
                    (tmp_path / "netns" / "metrics.jsonl").exists()
                    and len(read_metrics(tmp_path / "netns")) >= 2):
                time.sleep(0.5)
            time.sleep(1.0)
            deploy.kill_node(dep, 2)
            t.join(timeout=600)
        finally:
            deploy.down(dep)
    finally:
        hosts.remove()
    assert "s" in result, (tmp_path / "netns.log").read_text()[-3000:]
    rows = read_metrics(tmp_path / "netns")
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[1]["clients-ok"] == 3
    assert result["s"]["final-accuracy"] > rows[0]["accuracy"]
    # the dropout: its in-flight message fails, then it is reported lost and no longer sampled
    failed = [f["partition"] for r in rows[2:] for f in r["failures"]]
    lost = [p for r in rows[2:] for p in r["clients-lost"]]
    assert set(failed) <= {2} and lost == [2], (failed, lost)
    assert rows[3]["clients-ok"] == 2
    for i in (0, 1):  # the SuperNodes trained on their own folders, over the network, with TLS
        node_log = (tmp_path / "home" / "logs" / f"supernode-{i}.log").read_text()
        assert "--insecure" not in " ".join(deploy.supernode_cmd(dep, i, 3, 1))
        assert f"from its own data folder {folders[i]}" in node_log
