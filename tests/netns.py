"""Network namespaces as hosts: a switch namespace with a bridge, one namespace per host."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

from flowerbed.engine import _alive, _read_pid, _write_pid

SUBNET = "10.231.0"
OWNERS = Path("/run/flowerbed-netns")  # <tag>.pid: whose namespaces (a tmpfs: gone at reboot, as they are)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def netns_usable() -> str | None:
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
        reap_stale()
        tag = self.tag = uuid.uuid4().hex[:5]
        OWNERS.mkdir(exist_ok=True)
        _write_pid(OWNERS / f"{tag}.pid", os.getpid())
        self.ports: list[str] = []
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
        port = f"fbp{self.tag}{len(self.ports)}"
        self.ports.append(port)
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
        remove(self.tag)


def remove(tag: str) -> None:
    """The namespaces and the root namespace's interface of the Hosts tagged ``tag``."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in [n for n in listed if n.startswith("fb") and n.endswith(tag)]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", f"fbr{tag}"], capture_output=True)
    (OWNERS / f"{tag}.pid").unlink(missing_ok=True)


def reap_stale() -> None:
    """What a test run killed before its clean-up left (its root interface holds the subnet's .1,
    so the next run's would not be reached): the Hosts of processes no longer running."""
    for owner in OWNERS.glob("*.pid"):
        if (pid := _read_pid(owner)) is not None and not _alive(*pid):
            remove(owner.stem)
