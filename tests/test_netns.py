"""Several hosts on one machine: the SuperLink and each SuperNode in a network namespace of its own
(``ip netns`` + veth through a bridge), TLS with the SuperLink's address in its certificate, each
SuperNode reading only its own data folder, and one SuperNode killed in the middle of round 2
and started again.

Needs root and iproute2 (CI runs as root); skipped, with the reason, elsewhere (where
tests/test_deploy.py kills and restarts a SuperNode on loopback instead).
"""

from __future__ import annotations

import json
import uuid

import netns
import pytest
from dropout import assert_rejoined, run_killing_node
from netns import Hosts, netns_usable

from flowerbed import deploy
from flowerbed.config import Config
from flowerbed.datasets.federated import export_partitions, split_settings


@pytest.mark.skipif(bool(reason := netns_usable()), reason=reason or "")
def test_separate_hosts_with_tls_own_data_and_a_restarted_node(tmp_path):
    """SuperNode 2 is killed in round 2 and started again on its host (as a user restarts a
    crashed machine's SuperNode): it is reported lost, rejoins as partition 2 in round 3 and
    puts back SCAFFOLD's c_i from its filed state (a dropout that stays away: the loopback
    test_killed_supernode_mid_round, and the in-process fault tests)."""
    rc = {"method": "scaffold", "num-server-rounds": 3, "train-samples": 1200, "test-samples": 300,
          "min-clients": 2, "eval-every": 3, "fraction-evaluate": 0.0,  # (checks read the server's)
          "output-dir": str(tmp_path), "run-name": "netns"}
    cfg = Config.from_run_config({k: v for k, v in rc.items() if k not in ("output-dir", "run-name")})
    folders = export_partitions(cfg, 3, tmp_path / "client-data")  # each host gets only its part
    hosts = Hosts(["superlink", "supernode-0", "supernode-1", "supernode-2"])
    try:
        sl = hosts.ip["superlink"]
        dep = deploy.Deployment(home=tmp_path / "home", address=f"{sl}:8000")
        with_data = [{"data-dir": str(f)} for f in folders]
        deploy.up(dep, 3, host="0.0.0.0", node_extra=with_data, cert_hosts=[sl], wrap=hosts.wrap)
        try:
            restart = lambda: deploy.start_node(dep, 2, 3, with_data[2], hosts.wrap("supernode-2"))  # noqa: E731
            summary, rows = run_killing_node(dep, rc, tmp_path / "netns.log", restart=restart)
        finally:
            deploy.down(dep)
    finally:
        hosts.remove()
    assert_rejoined(rows, node=2, num_nodes=3,
                    node_log=(tmp_path / "home" / "logs" / "supernode-2.log").read_text(errors="replace"))
    config = json.loads((tmp_path / "netns" / "config.json").read_text())  # the folders' split
    exported = split_settings(cfg)
    assert config["client-data"] == {"own-folders": 3, "clients": 3, "exported-with": exported,
                                     "by-partition": {str(i): exported for i in range(3)}}
    assert summary["final-accuracy"] > rows[0]["accuracy"]
    for i in range(3):  # the SuperNodes trained on their own folders, over the network, with TLS
        node_log = (tmp_path / "home" / "logs" / f"supernode-{i}.log").read_text()
        assert "--insecure" not in " ".join(deploy.supernode_cmd(dep, i, 3, 1))
        assert f"from its own data folder {folders[i]}" in node_log


@pytest.mark.skipif(bool(reason := netns_usable()), reason=reason or "")
def test_what_a_killed_test_run_left_is_removed_before_new_hosts_are_made():
    """A run killed before its clean-up left its namespaces and its root interface, which holds
    the subnet's .1: the next run's hosts would not have reached this machine through its own."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    tag = f"d{uuid.uuid4().hex[:4]}"
    netns.OWNERS.mkdir(exist_ok=True)
    (netns.OWNERS / f"{tag}.pid").write_text(json.dumps({"pid": int(dead), "start": 1}))
    netns.sh("ip", "netns", "add", f"fbsw{tag}")
    netns.sh("ip", "link", "add", f"fbr{tag}", "type", "veth", "peer", "name", f"fbp{tag}")  # as _plug
    netns.reap_stale()
    assert f"fbsw{tag}" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", f"fbr{tag}"], capture_output=True).returncode != 0
    assert not (netns.OWNERS / f"{tag}.pid").exists()
