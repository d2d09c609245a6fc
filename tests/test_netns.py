"""Several hosts on one machine: the SuperLink and each SuperNode in a network namespace of its own
(``ip netns`` + veth through a bridge), TLS with the SuperLink's address in its certificate, each
SuperNode reading only its own data folder, one method end to end.

Needs root and iproute2 (CI runs as root); skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from flowerbed import deploy
from flowerbed.config import Config
from flowerbed.datasets.federated import export_partitions
from flowerbed.results import read_metrics

SUBNET = "10.231.0"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip"):
        return "needs iproute2's `ip`"
    probe = f"fbprobe{uuid.uuid4().hex[:6]}"
    try:
        sh("ip", "netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` refused here: {e.stderr.strip()}"
    sh("ip", "netns", "del", probe)
    return None


class Hosts:
    """A switch namespace with a bridge; one namespace per host, one veth each; this (the root)
    namespace joins the switch as the user's machine at .1."""

    def __init__(self, names: list[str]) -> None:
        tag = uuid.uuid4().hex[:5]
        self.switch = f"fbsw{tag}"
        self.ns = {name: f"fb{i}{tag}" for i, name in enumerate(names)}
        self.ip = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(names)}
        self.root_if = f"fbr{tag}"
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        self._plug(None, self.root_if, f"{SUBNET}.1", "root")
        for name, ns in self.ns.items():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._plug(ns, f"fbh{tag}{list(self.ns).index(name)}", self.ip[name], name)

    def _plug(self, ns: str | None, ifname: str, ip: str, label: str) -> None:
        port = f"p{abs(hash(label)) % 10**6}"
        sh("ip", "link", "add", ifname, "type", "veth", "peer", "name", port)
        sh("ip", "link", "set", port, "netns", self.switch)
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", port, "up")
        if ns:
            sh("ip", "link", "set", ifname, "netns", ns)
        pre = ["ip", "-n", ns] if ns else ["ip"]
        sh(*pre, "addr", "add", f"{ip}/24", "dev", ifname)
        sh(*pre, "link", "set", ifname, "up")

    def wrap(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name]]

    def remove(self) -> None:
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.root_if], capture_output=True)


@pytest.mark.skipif(bool(reason := _netns_usable()), reason=reason or "")
def test_superlink_and_supernodes_on_separate_hosts_with_tls(tmp_path):
    rc = {"method": "fedavg", "num-server-rounds": 2, "train-samples": 1200, "test-samples": 300,
          "min-clients": 2, "eval-every": 2, "output-dir": str(tmp_path), "run-name": "netns"}
    cfg = Config.from_run_config({k: v for k, v in rc.items() if k not in ("output-dir", "run-name")})
    folders = export_partitions(cfg, 2, tmp_path / "client-data")  # each host gets only its part
    hosts = Hosts(["superlink", "supernode-0", "supernode-1"])
    try:
        sl = hosts.ip["superlink"]
        dep = deploy.Deployment(home=tmp_path / "home", address=f"{sl}:8000")
        with_data = [{"data-dir": str(f)} for f in folders]
        deploy.up(dep, 2, host="0.0.0.0", node_extra=with_data, cert_hosts=[sl], wrap=hosts.wrap)
        try:
            summary = deploy.run(dep, rc, quiet=True, log_file=tmp_path / "netns.log")
        finally:
            deploy.down(dep)
    finally:
        hosts.remove()
    rows = read_metrics(tmp_path / "netns")
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[-1]["clients-ok"] == 2
    assert summary["final-accuracy"] > rows[0]["accuracy"]
    for i in (0, 1):  # the SuperNodes trained on their own folders, over the network, with TLS
        node_log = (tmp_path / "home" / "logs" / f"supernode-{i}.log").read_text()
        assert "--insecure" not in " ".join(deploy.supernode_cmd(dep, i, 2, 1))
        assert "Sent successfully" in node_log
    log0 = (tmp_path / "home" / "logs" / "supernode-0.log").read_text()
    assert f"from its own data folder {folders[0]}" in log0
