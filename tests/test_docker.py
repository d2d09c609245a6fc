"""The Docker files: valid compose (``docker compose config`` where it exists) and consistent with
the installed Flower: pinned image versions, flags the 1.42 binaries accept, one executor per
SuperNode, partitions 0..N-1, and TLS paths that ``flowerbed deploy certs`` writes."""

import os
import re
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from flowerbed import certs
from flowerbed.engine import PROJECT, _bin

DOCKER = PROJECT / "docker"
FLWR = version("flwr")


def compose_cli() -> list[str] | None:
    if os.environ.get("FLOWERBED_NO_COMPOSE"):
        return None
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def merged(*files: str) -> dict:
    """The compose model after overlays (by the real CLI when present, else a plain merge)."""
    cli = compose_cli()
    if cli:
        args = [a for f in files for a in ("-f", str(DOCKER / f))]
        res = subprocess.run([*cli, *args, "config"], capture_output=True, text=True, cwd=DOCKER)
        assert res.returncode == 0, res.stderr
        return yaml.safe_load(res.stdout)
    model: dict = {"services": {}}
    for f in files:  # ${VAR:-default} -> default, as compose does with VAR unset
        doc = yaml.safe_load(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", (DOCKER / f).read_text()))
        for name, svc in doc.get("services", {}).items():
            model["services"].setdefault(name, {}).update(svc)
    return model


def help_flags(binary: str) -> set[str]:
    out = subprocess.run([_bin(binary), "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]+", out))


def flags(cmd: list) -> list[str]:
    return [str(a) for a in cmd if str(a).startswith("--")]


def kind(name: str) -> str:
    return {"superlink": "flower-superlink", "supernode": "flower-supernode",
            "superexec": "flower-superexec"}[name.split("-")[0]]


@pytest.mark.parametrize("files", [("compose.yml",), ("compose.yml", "with-tls.yml")])
def test_compose_matches_flower(files):
    services = {n: s for n, s in merged(*files)["services"].items() if n != "volumes-init"}
    accepted = {b: help_flags(b) for b in ("flower-superlink", "flower-supernode", "flower-superexec")}
    for name, svc in services.items():
        image = str(svc.get("image", ""))
        if image.startswith("flwr/"):
            assert image.endswith(f":{FLWR}"), f"{name}: {image} is not pinned to flwr {FLWR}"
        unknown = set(flags(svc["command"])) - accepted[kind(name)]
        assert not unknown, f"{name}: {kind(name)} {FLWR} has no {unknown}"

    nodes = {n: s for n, s in services.items() if n.startswith("supernode-")}
    node_configs = [str(s["command"][s["command"].index("--node-config") + 1]) for s in nodes.values()]
    configs = [dict(kv.split("=") for kv in nc.split()) for nc in node_configs]
    assert sorted(int(c["partition-id"]) for c in configs) == list(range(len(nodes)))
    assert {int(c["num-partitions"]) for c in configs} == {len(nodes)}
    for n, s in nodes.items():
        port = s["command"][s["command"].index("--port") + 1]
        execs = [e for e, x in services.items() if e.startswith("superexec-clientapp")
                 and f"{n}:{port}" in map(str, x["command"])]
        assert len(execs) == 1, f"{n} needs exactly one executor on its runtime API, has {execs}"

    tls = "with-tls.yml" in files
    for name, svc in services.items():
        cmd = list(map(str, svc["command"]))
        # what crosses the network is TLS in the overlay; a SuperNode's link to its own
        # executor stays local (insecure), as in Flower's compose files
        if not name.startswith("superexec-clientapp"):
            assert ("--insecure" in cmd) != tls, f"{name}: TLS overlay and --insecure disagree"
        for f in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--root-certificates"):
            if f in cmd:
                assert Path(cmd[cmd.index(f) + 1]).name in (certs.CA_CERT, certs.SERVER_CERT,
                                                            certs.SERVER_KEY)
    assert "--database" in services["superlink"]["command"]  # persistent SuperLink state


def test_dockerfile_pins_flower_and_keeps_our_dependencies():
    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG FLWR_VERSION={FLWR}" in text and "FROM flwr/superexec:${FLWR_VERSION}" in text
    # the image's sed drops our flwr pin (flwr comes from the base image) and nothing else
    sed = re.search(r"sed -i 's/(.*?)//' pyproject.toml", text).group(1).replace("\\[", "[")
    pyproject = (PROJECT / "pyproject.toml").read_text()
    kept = re.sub(sed.replace("[", r"\[").replace(".*", ".*"), "", pyproject)
    deps = yaml.safe_load("x: " + re.search(r"dependencies = (\[.*?\])", kept, re.S).group(1))["x"]
    assert not any(d.startswith("flwr[") for d in deps) and "flwr-datasets==0.6.*" in deps
    assert (PROJECT / ".dockerignore").read_text().count(".venv") == 1


def test_tls_overlay_keeps_the_ca_key_out_of_the_containers():
    """The overlay mounted the whole certs folder, CA private key included, into the SuperLink
    and the ServerApp's executor (which runs app code)."""
    for name, svc in yaml.safe_load((DOCKER / "with-tls.yml").read_text())["services"].items():
        for volume in svc.get("volumes", []):
            assert "ca.key" not in volume and not volume.startswith("./certs:"), (name, volume)


@pytest.mark.parametrize("files", [("compose.yml",), ("compose.yml", "with-tls.yml")])
def test_named_volumes_are_handed_to_the_containers_user_first(files):
    """Named volumes start out owned by root and Flower's images run as uid 49999: the SuperLink
    could not create its state.db, nor the ServerApp write its results. volumes-init chowns every
    named volume a Flower container writes to, and those containers wait for it."""
    services = merged(*files)["services"]
    init = services["volumes-init"]
    entry = list(map(str, init["entrypoint"]))
    assert entry[:3] == ["chown", "-R", "49999:49999"] and str(init["user"]) == "root"

    def named(svc: dict) -> dict[str, str]:  # volume name -> mount path, short or long syntax
        out = {}
        for v in svc.get("volumes", []):
            src, dst = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
            if not src.startswith((".", "/", "$")):
                out[src] = dst
        return out

    chowned = {named(init)[n] for n in named(init)}
    assert chowned == set(entry[3:])
    for name, svc in services.items():
        if name == "volumes-init" or not named(svc):
            continue
        assert set(named(svc)) <= set(named(init)), (name, named(svc))
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict) and deps.get("volumes-init", {}).get(
            "condition") == "service_completed_successfully", (name, deps)
    ports = [str(p.get("host_ip", "") if isinstance(p, dict) else p) for p in services["superlink"]["ports"]]
    assert all(p.startswith("127.0.0.1") for p in ports), ports  # not open to the network


def test_dockerfile_installs_the_torch_that_make_install_pins():
    """The image installed whatever torch was newest, the Makefile pins one."""
    pins = dict(re.findall(r"(torch|torchvision)==([\w.]+)", (PROJECT / "Makefile").read_text()))
    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={pins['torch']}" in text
    assert f"ARG TORCHVISION_VERSION={pins['torchvision']}" in text
    assert "torch==${TORCH_VERSION} torchvision==${TORCHVISION_VERSION}" in text
