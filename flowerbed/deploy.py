"""Flower's deployment engine on this machine: a SuperLink and N SuperNodes as real processes.

``flowerbed deploy up`` starts them (TLS on unless ``--insecure``; optional SuperNode
authentication), ``flowerbed deploy run`` sends the app with ``flwr run``, ``flowerbed deploy
down`` stops exactly the processes ``up`` started (by the pids it wrote). Every SuperNode gets its
own ``partition-id``/``num-partitions`` through ``--node-config``, plus, optionally, its own
``data-root`` (a copy of the data set) or ``data-dir`` (only its own partition, see
``flowerbed deploy export-data``).

State of one deployment lives in a folder (default ``.flwr-deploy/``): ``config.toml`` (the
``FLWR_HOME`` the ``flwr`` CLI reads, connection ``flowerbed-deploy``), ``certs/``, ``keys/``,
``logs/``, ``state.db`` (the SuperLink's persistent state) and ``pids.json``.

On other machines, start the same ``flower-superlink``/``flower-supernode`` commands by hand (the
README's "Deploy on several machines" shows them); :func:`superlink_cmd` and
:func:`supernode_cmd` are exactly what ``up`` runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowerbed import certs, engine
from flowerbed.engine import (
    PROJECT,
    _alive,
    _bin,
    flwr_env,
    flwr_run,
    free_port,
    log_header,
    ours,
    port_open,
    start_time,
    stop_group,
    toml_value,
    wait_superlink,
)

log = logging.getLogger("flowerbed")

CONNECTION = "flowerbed-deploy"
DEFAULT_HOME = PROJECT / ".flwr-deploy"


class DeployError(RuntimeError):
    """A deployment could not be started, reached or stopped."""


@dataclass
class Deployment:
    """Where one deployment keeps its files, and how it is reached."""

    home: Path = DEFAULT_HOME
    address: str = "127.0.0.1:8000"  # how SuperNodes and flwr reach the SuperLink
    insecure: bool = False
    auth: bool = False
    pids: dict[str, int] = field(default_factory=dict)
    starts: dict[str, int | None] = field(default_factory=dict)  # each process's start time
    own_data: bool = False  # SuperNodes read their own data folders (up --data-dirs)

    def __post_init__(self) -> None:
        self.home = Path(self.home).resolve()

    # ------------------------------------------------------------------ files
    @property
    def certs(self) -> Path:
        return self.home / "certs"

    @property
    def ca(self) -> Path | None:
        return None if self.insecure else self.certs / certs.CA_CERT

    def log_file(self, name: str) -> Path:
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        return self.home / "logs" / f"{name}.log"

    def node_key(self, i: int) -> Path:
        return self.home / "keys" / f"supernode-{i}"

    def write_connection(self) -> None:
        """``$FLWR_HOME/config.toml`` with the connection ``flwr run . flowerbed-deploy`` uses."""
        self.home.mkdir(parents=True, exist_ok=True)
        tls = "insecure = true" if self.insecure else f"root-certificates = {toml_value(str(self.ca))}"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\n{tls}\n')

    def started(self, name: str, pid: int) -> None:
        """Record a process ``up`` started (pid and start time: a reused pid is not ours)."""
        self.pids[name], self.starts[name] = pid, start_time(pid)
        self.save()

    def alive(self, name: str) -> bool:
        return _alive(self.pids[name], self.starts.get(name))

    def supernodes(self) -> int:
        """How many SuperNodes ``up`` started."""
        return sum(1 for name in self.pids if name.startswith("supernode-"))

    def superlink_gone(self) -> bool:
        """``up`` started a SuperLink here and it no longer runs."""
        return "superlink" in self.pids and not self.alive("superlink")

    def ours(self, name: str) -> bool:
        """The process, or what is left of its group, still runs (see :func:`engine.ours`)."""
        return ours(self.pids[name], self.starts.get(name))

    def save(self) -> None:
        from flowerbed.results import write_json_atomic

        write_json_atomic(self.home / "pids.json", {
            "address": self.address, "insecure": self.insecure, "auth": self.auth,
            "own-data": self.own_data, "pids": self.pids, "starts": self.starts})

    @classmethod
    def load(cls, home: Path = DEFAULT_HOME) -> Deployment:
        f = Path(home).resolve() / "pids.json"
        if not f.exists():
            raise DeployError(f"no deployment started from {Path(home).resolve()} (no pids.json); "
                              f"start one with `flowerbed deploy up{home_option(Path(home))}`")
        try:
            d = json.loads(f.read_text())
            return cls(home=home, address=d["address"], insecure=d["insecure"], auth=d["auth"],
                       own_data=bool(d.get("own-data", False)),
                       pids={k: int(v) for k, v in d["pids"].items()},
                       starts={k: v for k, v in d.get("starts", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DeployError(f"{f} is damaged ({type(e).__name__}: {e}); stop what it started "
                              "by hand (logs/ names the processes), then delete it") from None


# ---------------------------------------------------------------------- commands


def superlink_cmd(dep: Deployment, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """``flower-superlink`` for deployment: this venv's packages, persistent state, TLS or not."""
    cmd = [_bin("flower-superlink"), "--host", host, "--port", str(port),
           "--database", str(dep.home / "state.db"), "--disable-runtime-dependency-installation"]
    if dep.insecure:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(dep.certs / certs.CA_CERT),
                "--ssl-certfile", str(dep.certs / certs.SERVER_CERT),
                "--ssl-keyfile", str(dep.certs / certs.SERVER_KEY)]
    if dep.auth:
        cmd.append("--enable-supernode-auth")
    return cmd


def node_config(partition_id: int, num_partitions: int, **extra: Any) -> str:
    """The ``--node-config`` string: partition plus optional ``data-root``/``data-dir``."""
    items = {"partition-id": partition_id, "num-partitions": num_partitions,
             **{k: v for k, v in extra.items() if v not in (None, "")}}
    return " ".join(f"{k}={toml_value(v)}" for k, v in items.items())


def supernode_cmd(dep: Deployment, partition_id: int, num_partitions: int, port: int,
                  **node_extra: Any) -> list[str]:
    """``flower-supernode`` for one partition; ``port`` is its local ClientApp runtime API."""
    cmd = [_bin("flower-supernode"), "--superlink", dep.address, "--port", str(port),
           "--node-config", node_config(partition_id, num_partitions, **node_extra)]
    cmd += ["--insecure"] if dep.insecure else ["--root-certificates", str(dep.ca)]
    if dep.auth:
        cmd += ["--auth-supernode-private-key", str(dep.node_key(partition_id))]
    return cmd


def home_option(home: Path) -> str:
    """`` --home <home>`` for a ``deploy`` command the user is told to run, or nothing for
    the deployment's default home."""
    return engine.home_option(home, DEFAULT_HOME)


def spawn(cmd: list[str], log_path: Path, wrap: list[str] | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a process in its own session (so it and its children stop together), with ``env``
    added to its environment."""
    full = [*(wrap or []), *cmd]
    log.info("$ %s", " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()),
                               shlex.join(full)]))  # quoted: it can be pasted into a shell
    with open(log_path, "ab") as out:  # each start's output under a header (logs outlive `down`)
        out.write(log_header(shlex.join(full)).encode())
        out.flush()
        return subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT,
                                env={**flwr_env(log_path.parent.parent), **(env or {})},
                                start_new_session=True)


def gpu_env(node: int) -> dict[str, str]:
    """SuperNode ``node``'s GPU on a machine with several: ``CUDA_VISIBLE_DEVICES`` = the
    (node mod count)-th GPU, so their ClientApps (each uses ``cuda``, i.e. the first GPU it sees)
    spread over the GPUs instead of all using the first. Where the user set
    ``CUDA_VISIBLE_DEVICES``, over the GPUs it lists (one listed: that one for every node);
    nothing where the machine has fewer than two."""
    if (chosen := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        ids = [d.strip() for d in chosen.split(",") if d.strip()]
        ids = ids[:next((i for i, d in enumerate(ids) if d.startswith("-")), len(ids))]  # (CUDA stops there)
        return {"CUDA_VISIBLE_DEVICES": ids[node % len(ids)]} if len(ids) > 1 else {}
    import torch

    n = torch.cuda.device_count()
    return {"CUDA_VISIBLE_DEVICES": str(node % n)} if n > 1 else {}


def flwr_cli(dep: Deployment, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``flwr <args>`` against this deployment's connection."""
    try:
        return subprocess.run([_bin("flwr"), *args], env=flwr_env(dep.home), cwd=PROJECT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DeployError(f"`flwr {' '.join(args)}` did not answer within {timeout:.0f} s (is the "
                          f"SuperLink at {dep.address} overloaded or unreachable?)") from None


def online_nodes(dep: Deployment, since: float | None = None) -> int | None:
    """How many SuperNodes the SuperLink sees online (``flwr supernode list``), None if unknown;
    with ``since`` (a time.time()), only those that came online from then on (the SuperLink's
    state.db outlives a deployment, and lists an earlier one's nodes online for about a minute)."""
    try:
        res = flwr_cli(dep, "supernode", "list", CONNECTION, "--format", "json", timeout=30.0)
    except DeployError:  # a loaded SuperLink: ask again
        return None
    with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
        nodes = json.loads(res.stdout)["nodes"]
        return sum(1 for n in nodes if str(n.get("status", "")).lower() == "online"
                   and (since is None or _came_online(n.get("online-at"), since)))
    return None


def _came_online(online_at: Any, since: float) -> bool:
    """Whether flwr's ``online-at`` ("2026-12-07 13:33:01Z", whole seconds, UTC) is not before
    ``since``; a value it cannot read counts."""
    try:
        at = dt.datetime.fromisoformat(str(online_at).replace("Z", "+00:00"))
    except ValueError:
        return True
    return at.replace(tzinfo=at.tzinfo or dt.UTC).timestamp() >= math.floor(since) - 1


def register_node(dep: Deployment, i: int) -> None:
    """Register SuperNode ``i``'s public key with the SuperLink (needs ``--enable-supernode-auth``)."""
    res = flwr_cli(dep, "supernode", "register", str(dep.node_key(i)) + ".pub", CONNECTION)
    if res.returncode != 0 and "already in use" in res.stdout + res.stderr:
        return  # registered by an earlier `up` of this deployment (state.db persists)
    if res.returncode != 0:
        raise DeployError(f"`flwr supernode register` failed for supernode-{i}:\n"
                          f"{res.stdout}{res.stderr}")


# ---------------------------------------------------------------------- up / down


#: the wildcard binds, and the loopback address that reaches a SuperLink bound to each
WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def check_address(address: str, resolve: bool = True, option: str = "--address") -> None:
    """``--address`` (or ``option``): a host name or IP address without a port (that this
    machine resolves)."""
    import socket

    from flowerbed.config import ConfigError

    if certs.ip_of(address) is not None:
        return
    host = address.strip("[]")
    if ":" in host and "/" not in host:
        raise ConfigError(option, address, "a host name or IP address, without the port "
                          "(give the port with --port)")
    # a certificate may also name a wildcard (*.example.org) or a rooted name (host.example.org.)
    name = host.removeprefix("*.").rstrip(".") if option == "--host" else host
    if not re.fullmatch(r"[A-Za-z0-9]([\w.-]*[A-Za-z0-9])?", name, re.ASCII) or ".." in name:
        raise ConfigError(option, address, "a host name (letters, digits, '-', '_' and '.') or an IP "
                          "address, with no scheme or path")
    try:
        if resolve:
            socket.getaddrinfo(host, None)
    except OSError as e:
        raise ConfigError(option, address, f"this machine cannot resolve it ({e})") from None


def with_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (``::1`` -> ``[::1]:8000``; bare, flwr's
    https://::1:8000 is no URL)."""
    ip = certs.ip_of(host)
    return f"[{ip}]:{port}" if ip is not None and ip.version == 6 else f"{host}:{port}"


def bind_for(address: str) -> str:
    """The interface a SuperLink reached at ``address`` listens on: the loopback where the
    address is the loopback (nothing else can reach it), else all interfaces (a SuperLink bound
    to 127.0.0.1 never answers at 10.0.0.5, and ``up`` waited a minute to say so)."""
    if (ip := certs.ip_of(address)) is None:  # a name: all IPv4 interfaces (localhost: the loopback)
        return "127.0.0.1" if address.strip("[]") == "localhost" else "0.0.0.0"
    if ip.is_loopback:
        return str(ip)  # 127.0.1.1 listens there, not on 127.0.0.1
    return "::" if ip.version == 6 else "0.0.0.0"


def up(dep: Deployment, num_nodes: int, host: str = "127.0.0.1",
       node_extra: list[dict[str, Any]] | None = None, cert_hosts: list[str] | None = None,
       wait_nodes: bool = True, wrap: Callable[[str], list[str]] | None = None) -> Deployment:
    """Start a SuperLink and ``num_nodes`` SuperNodes on this machine; returns the deployment.

    ``host``: the interface the SuperLink listens on (0.0.0.0 for other machines);
    ``node_extra``: per-node ``data-root``/``data-dir``; ``cert_hosts``: extra names for the
    TLS certificate; ``wrap(name)``: a command prefix per process, e.g. ``ip netns exec <ns>``
    to put each one in its own network namespace (a host of its own).
    """
    wrap = wrap or (lambda name: [])
    if num_nodes < 1:
        raise DeployError(f"num-nodes must be >= 1, got {num_nodes}")
    old = dep.home / "pids.json"
    if old.exists() and any(map((earlier := Deployment.load(dep.home)).ours, earlier.pids)):
        raise DeployError(f"a deployment from {dep.home} is still running; stop it first with "
                          f"`flowerbed deploy down{home_option(dep.home)}`")
    sl_host, port_text = dep.address.rsplit(":", 1)
    sl_host, port = sl_host.strip("[]"), int(port_text)
    # the SuperLink's own ServerApp executor connects to the bound interface: name it too
    bound = [] if host in WILDCARD or host == sl_host else [host]
    wanted = list(dict.fromkeys([sl_host, *bound, *(cert_hosts or [])]))
    server_cert = dep.certs / certs.SERVER_CERT
    if not dep.insecure and server_cert.exists():  # an earlier `up`'s
        if missing := certs.unnamed(server_cert, wanted):
            raise DeployError(f"the SuperLink certificate {server_cert} (made by an earlier `up`) "
                              f"does not name {', '.join(missing)}; make new ones with `flowerbed "
                              f"deploy certs --force --home {dep.home} "
                              + " ".join(f"--host {h}" for h in wanted) + "` (then give the "
                              "SuperNodes the new ca.crt)")
        if (end := certs.expires(server_cert)) < dt.datetime.now(dt.UTC):
            raise DeployError(f"the SuperLink certificate {server_cert} expired on {end:%Y-%m-%d}; "
                              f"make new ones with `flowerbed deploy certs --force --home {dep.home}` "
                              "(then give the SuperNodes the new ca.crt)")
    probe = WILDCARD.get(host, host)
    if answered := next((h for h in dict.fromkeys([probe, sl_host]) if port_open(h, port)), None):
        # the other process's listener would answer for ours, and our SuperNodes join its federation
        raise DeployError(f"port {port} is in use on {answered} (another SuperLink or deployment?); "
                          "stop it or pick another with --port")
    if not ((ip := certs.ip_of(host)) is not None and ip.is_loopback or host == "localhost"):
        log.warning("the SuperLink listens on %s: anyone who reaches port %d there can submit runs "
                    "(code on the SuperLink and every SuperNode) and register SuperNode keys; TLS "
                    "and --auth do not stop that. Open the port only to the federation's machines "
                    "(README: Deploy on several machines)", host or "every interface", port)
    dep.home.mkdir(parents=True, exist_ok=True)  # (a refused `up` leaves no new home behind)
    if not dep.insecure and not server_cert.exists():
        certs.make_certs(dep.certs, [*certs.DEFAULT_HOSTS, *wanted])
    dep.write_connection()
    dep.pids = {}
    try:
        sl_log = dep.log_file("superlink")
        proc = spawn(superlink_cmd(dep, host, port), sl_log, wrap("superlink"))
        dep.started("superlink", proc.pid)
        try:
            wait_superlink(proc, sl_host, port, sl_log)
        except (RuntimeError, TimeoutError) as e:
            raise DeployError(str(e)) from e
        since = time.time()  # (nodes an earlier deployment left listed online are not ours)
        for i in range(num_nodes):
            if dep.auth:
                if not dep.node_key(i).exists():
                    certs.make_node_key(dep.node_key(i), force=True)  # (a lone .pub: unusable)
                register_node(dep, i)
            start_node(dep, i, num_nodes, (node_extra or [{}] * num_nodes)[i], wrap(f"supernode-{i}"))
        if wait_nodes:
            wait_online(dep, num_nodes, since=since)
    except BaseException:
        with engine.shielded("the deployment's processes"):
            down(dep)
        raise
    return dep


def wait_online(dep: Deployment, n: int, timeout: float = 180.0, since: float | None = None) -> None:
    """Until ``n`` SuperNodes are online (that came online from ``since`` on, where given)."""
    t0 = time.time()
    seen = None
    while time.time() - t0 < timeout:
        for name, pid in dep.pids.items():
            if not dep.alive(name):
                tail = dep.log_file(name).read_text(errors="replace")[-1500:]
                raise DeployError(f"{name} (pid {pid}) exited; its log ends with:\n{tail}")
        seen = online_nodes(dep, since)
        if seen is not None and seen >= n:
            return
        time.sleep(1.0)
    raise DeployError(f"only {'?' if seen is None else seen} of {n} SuperNodes online after {timeout:.0f} s "
                      f"(logs in {dep.home / 'logs'})")


def start_node(dep: Deployment, i: int, num_nodes: int, extra: dict[str, Any] | None = None,
               wrap: list[str] | None = None) -> None:
    """Start SuperNode ``i`` (of ``num_nodes``; again, after :func:`kill_node`: a restart, which
    the SuperLink sees as a new node that serves partition ``i``); its log appends."""
    p = spawn(supernode_cmd(dep, i, num_nodes, free_port(), **(extra or {})),
              dep.log_file(f"supernode-{i}"), wrap, gpu_env(i))
    dep.started(f"supernode-{i}", p.pid)


def kill_node(dep: Deployment, i: int, sig: int = signal.SIGTERM) -> None:
    """Stop SuperNode ``i`` (a dropout); the rest of the deployment keeps running."""
    pid = dep.pids[f"supernode-{i}"]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def down(dep: Deployment) -> list[str]:
    """Stop every process this deployment started (SuperNodes first); returns their names."""
    stopped = []
    for name in sorted(dep.pids, key=lambda n: n == "superlink"):
        if dep.ours(name):  # a pid reused since (reboot, kill -9) belongs to someone else
            stop_group(dep.pids[name])
            stopped.append(name)
    with contextlib.suppress(FileNotFoundError):
        (dep.home / "pids.json").unlink()
    return stopped


def check_superlink(dep: Deployment) -> None:
    """A DeployError when ``up`` started a SuperLink here and it no longer runs."""
    if dep.superlink_gone():
        raise DeployError(f"the SuperLink of {dep.home} is not running (pid {dep.pids['superlink']} "
                          f"is gone; its log: {dep.log_file('superlink')}); restart the deployment "
                          f"with `flowerbed deploy down{home_option(dep.home)}`, then `up`")


def run(dep: Deployment, run_config: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """``flwr run <project> flowerbed-deploy`` on this deployment; returns summary.json."""
    check_superlink(dep)
    return flwr_run(dep.home, CONNECTION, run_config, None, **kwargs)


@contextlib.contextmanager
def deployment(home: Path, num_nodes: int, **kwargs: Any) -> Iterator[Deployment]:
    """``up`` ... ``down`` around a block (tests, scripts)."""
    opts = {k: kwargs.pop(k) for k in ("address", "insecure", "auth") if k in kwargs}
    dep = up(Deployment(home=home, **opts), num_nodes, **kwargs)
    try:
        yield dep
    finally:
        down(dep)
