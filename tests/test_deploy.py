"""Flower's deployment engine with real processes: a SuperLink and SuperNodes started by
``flowerbed.deploy`` (TLS, SuperNode authentication), every method's kind of message flow (2
rounds where round 2 must read a client's state back, else 1), a SuperNode killed mid-run, a
SuperNode's own data folder, and certificates/keys Flower accepts.

Deployed ClientApps start one process per message and SuperNodes poll every 3 s, so a 2-round run
takes about a minute; the method runs share one deployment and run concurrently.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from dropout import assert_dropped, assert_rejoined, run_killing_node
from methods import EXTRA
from netns import netns_usable

from flowerbed import certs, deploy, engine
from flowerbed.config import Config, ConfigError
from flowerbed.datasets.federated import client_data, export_partitions, read_partition_dir
from flowerbed.datasets.loading import DataError
from flowerbed.engine import _alive, descendants, free_port, start_time
from flowerbed.registry import METHODS
from flowerbed.results import read_metrics

SMALL = {"num-server-rounds": 2, "train-samples": 1000, "test-samples": 200, "min-clients": 2,
         "eval-every": 2, "batch-size": 64}



def test_certificates_and_node_keys_are_what_flower_reads(tmp_path):
    files = certs.make_certs(tmp_path, ["localhost", "127.0.0.1", "10.231.0.10", "superlink"])
    assert set(certs.san_hosts(files["cert"])) == {"localhost", "127.0.0.1", "10.231.0.10", "superlink"}
    ca = x509.load_pem_x509_certificate(files["ca"].read_bytes())
    cert = x509.load_pem_x509_certificate(files["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)
    assert oct(files["key"].stat().st_mode)[-3:] == "600"
    pub = certs.make_node_key(tmp_path / "keys" / "supernode-0")
    pub_text = pub.read_bytes()
    key = load_ssh_private_key((tmp_path / "keys" / "supernode-0").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)  # flower-supernode refuses other kinds
    assert isinstance(load_ssh_public_key(pub.read_bytes()), ec.EllipticCurvePublicKey)
    # a second node-key over the pair (a registered SuperNode's) is refused, unless --force
    with pytest.raises(ConfigError, match="holds a key pair already.*--force"):
        certs.make_node_key(tmp_path / "keys" / "supernode-0")
    assert certs.make_node_key(tmp_path / "keys" / "supernode-0", force=True).read_bytes() != pub_text


def test_certificates_pass_strict_x509_verification(tmp_path):
    """Python >= 3.13's default TLS context (what flwr's HTTP clients use) sets
    VERIFY_X509_STRICT, which refused our certificates: no key identifiers."""
    import socket
    import ssl
    import threading

    files = certs.make_certs(tmp_path, list(certs.DEFAULT_HOSTS))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files["cert"], files["key"])
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def serve():
            conn, _ = listener.accept()
            with contextlib.suppress(ssl.SSLError, OSError):
                server.wrap_socket(conn, server_side=True).close()

        threading.Thread(target=serve, daemon=True).start()
        client = ssl.create_default_context(cafile=str(files["ca"]))
        client.verify_flags |= ssl.VERIFY_X509_STRICT
        with client.wrap_socket(socket.create_connection(listener.getsockname()),
                                server_hostname="127.0.0.1") as tls:
            assert tls.version()
    assert certs.expires(files["ca"]) > datetime.datetime.now(datetime.UTC)


def test_node_config_and_commands():
    assert deploy.node_config(1, 3, **{"data-dir": "/d/client-1", "data-root": ""}) == \
        'partition-id=1 num-partitions=3 data-dir="/d/client-1"'
    dep = deploy.Deployment(address="10.0.0.5:8000", auth=True)
    cmd = deploy.supernode_cmd(dep, 2, 3, 9100)
    assert cmd[cmd.index("--superlink") + 1] == "10.0.0.5:8000"
    assert "--root-certificates" in cmd and "--insecure" not in cmd  # TLS unless asked
    assert "--auth-supernode-private-key" in cmd
    sl = deploy.superlink_cmd(dep, "0.0.0.0", 8000)
    assert "--enable-supernode-auth" in sl and "--database" in sl and "--ssl-certfile" in sl
    assert "--insecure" in deploy.superlink_cmd(deploy.Deployment(insecure=True))


def test_ports_we_pick_are_outside_the_kernels_ephemeral_range(monkeypatch, tmp_path):
    """A SuperNode died with 'address already in use' on the port free_port had just probed: an
    outgoing connection had taken it as its local port. Ports below the ephemeral range are taken
    only by a bind; one that is taken is skipped, and so is one another running process picked."""
    import socket

    from flowerbed import engine

    monkeypatch.setattr(engine, "PICKED", tmp_path / "ports")
    low, _ = engine._ephemeral_range()
    picked = [free_port() for _ in range(20)]
    assert 10000 < low and all(10000 <= p < low for p in picked) and len(set(picked)) == 20
    engine._HANDED_OUT.clear()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        picks = iter([taken.getsockname()[1], 12345, 12345, 12346])
        monkeypatch.setattr(engine.random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert free_port() == 12345
        assert free_port() == 12346  # (from a review: handed out twice before either was bound)
        # picked by another launcher or test worker that still runs (its server may not listen
        # yet): skipped; a claim whose process has ended is dropped
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (tmp_path / "ports" / "12347").write_text(str(os.getppid()))
        (tmp_path / "ports" / "12348").write_text(dead)
        picks = iter([12347, 12348])
        assert free_port() == 12348
        assert engine._read_pid(tmp_path / "ports" / "12348") == (os.getpid(), start_time(os.getpid()))
        (tmp_path / "ports" / "12349").write_text(json.dumps({"pid": os.getppid(), "start": 1}))  # reused pid
        picks = iter([12349])
        assert free_port() == 12349
    # a range widened to start low (1024-65535 is common tuning) left one port to pick from:
    # every SuperNode got 10000 (from a review)
    monkeypatch.setattr(engine, "_ephemeral_range", lambda: (1024, 60999))
    assert engine._port_choices() == (61000, 65536)
    monkeypatch.setattr(engine, "_ephemeral_range", lambda: (1024, 65535))
    assert engine._port_choices() == (10000, 60000)


def test_the_logged_command_can_be_pasted_into_a_shell(tmp_path, caplog):
    """A README walk-through: the SuperNode line `--node-config partition-id=0 num-partitions=2`
    was logged unquoted, so pasting it ran flower-supernode with a stray argument."""
    (tmp_path / "logs").mkdir()
    cmd = [sys.executable, "-c", "pass", "--node-config", 'partition-id=0 data-dir="/d/c 0"']
    deploy.spawn(cmd, tmp_path / "logs" / "x.log", env={"CUDA_VISIBLE_DEVICES": "0,1"}).wait()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("$ "))
    assert shlex.split(line[2:]) == ["CUDA_VISIBLE_DEVICES=0,1", *cmd]


def test_supernodes_spread_over_several_gpus(monkeypatch, tmp_path):
    """Each ClientApp uses `cuda` (its first visible GPU): on a machine with several GPUs the
    SuperNodes `deploy up` starts get one each, round robin, over the GPUs the user listed
    in CUDA_VISIBLE_DEVICES where set (a review: "2,3" put every client on GPU 2)."""
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [deploy.gpu_env(i) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "0"}]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert deploy.gpu_env(1) == {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the user's choice: spread over those two
    assert [deploy.gpu_env(i) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "2"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,-1,1")  # CUDA reads up to the first invalid id
    assert deploy.gpu_env(2) == {"CUDA_VISIBLE_DEVICES": "2"}
    for one in ("1", "", "GPU-8d2f", "0,-1,1"):  # one GPU (or none) for every node: left as set
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", one)
        assert deploy.gpu_env(1) == {}
    (tmp_path / "logs").mkdir()
    p = deploy.spawn([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                     tmp_path / "logs" / "x.log", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert p.wait(timeout=30) == 0 and (tmp_path / "logs" / "x.log").read_text().splitlines()[-1] == "1"


def test_own_data_folder_equals_the_seeded_partition(tmp_path, caplog):
    """`flowerbed deploy export-data` + `data-dir` gives a SuperNode exactly its seeded split."""
    cfg = Config.from_run_config({"train-samples": 1200, "partition": "dirichlet:0.5"})
    folders = export_partitions(cfg, 3, tmp_path)
    for i, folder in enumerate(folders):
        own_tr, own_te = client_data(cfg, i, 3, str(folder))
        tr, te = client_data(cfg, i, 3)
        assert (own_tr.x == tr.x).all() and (own_tr.y == tr.y).all() and (own_te.y == te.y).all()
    with pytest.raises(DataError, match="partition 0, but this SuperNode is partition-id=1"):
        read_partition_dir(cfg, folders[0], 1)
    with pytest.raises(DataError, match="one of 3 exported partitions, but this SuperNode has "
                                        "num-partitions=2"):
        read_partition_dir(cfg, folders[0], 0, 2)
    with caplog.at_level("WARNING", logger="flowerbed"):  # another seed: allowed, but said
        read_partition_dir(Config.from_run_config({"train-samples": 1200, "partition": "iid",
                                                   "seed": 1}), folders[0], 0, 3)
    assert "exported with partition='dirichlet:0.5', seed=0; this run has partition='iid', seed=1" \
        in caplog.text
    # a distillation method's public set is drawn from the seed (from a review: most of another
    # seed's public set lay in the folders' private data)
    fedcc = cfg.replace(method="fedcc", public_fraction=0.1)
    with pytest.raises(DataError, match=r"public-fraction=0.0; this run has public-fraction=0.1, "
                                        "which draw another public set"):
        read_partition_dir(fedcc, folders[0], 0, 3)  # the export kept the public samples in
    public = export_partitions(fedcc, 3, tmp_path / "public")
    with pytest.raises(DataError, match=r"seed=0; this run has seed=1, which draw another public set"):
        read_partition_dir(fedcc.replace(seed=1), public[0], 0, 3)
    for same in (fedcc, cfg.replace(seed=1)):  # (fedavg: no public set)
        read_partition_dir(same, public[0], 0, 3)
    caplog.clear()  # min-partition-size shapes a Dirichlet split too (from a review: not compared)
    with caplog.at_level("WARNING", logger="flowerbed"):
        read_partition_dir(cfg.replace(min_partition_size=1), folders[0], 0, 3)
    assert "exported with min-partition-size=10; this run has min-partition-size=1" in caplog.text

    with pytest.raises(DataError, match="holds fashion-mnist, the run uses cifar10"):
        read_partition_dir(Config.from_run_config({"dataset": "cifar10"}), folders[0], 0)
    # exported without local test splits, read by a run that asks for them: split, and said
    plain = export_partitions(cfg.replace(local_test_fraction=0.0), 3, tmp_path / "plain")
    assert not (plain[0] / "test-images.idx.gz").exists()
    with caplog.at_level("WARNING", logger="flowerbed"):
        tr, te = read_partition_dir(cfg.replace(local_test_fraction=0.2), plain[0], 0, 3)
    assert len(te) == round(0.2 * (len(tr) + len(te))) and "local-test-fraction=0.0" in caplog.text
    (folders[2] / "test-labels.idx.gz").unlink()
    with pytest.raises(DataError, match="come in pairs"):
        read_partition_dir(cfg, folders[2], 2)
    (folders[2] / "test-images.idx.gz").unlink()  # no test split: made by local-test-fraction
    tr, te = read_partition_dir(cfg, folders[2], 2)
    assert len(te) == round(0.1 * (len(tr) + len(te)))

def test_a_run_on_exported_folders_records_their_split(tmp_path, caplog):
    """A run on the clients' own folders recorded only its run config's split (partition, seed)
    in config.json, so `flowerbed table` took it for a run of that split. The ServerApp now
    records the folders' export settings (client-data) and warns where they differ; table
    refuses to put it beside a run of the seeded split, and a resume on other data is refused."""
    import shutil

    from inprocess import run_inprocess

    from flowerbed import faults, run_table
    from flowerbed.apps.server_app import client_data

    export = Config.from_run_config({"train-samples": 600, "partition": "iid", "seed": 3})
    folders = [{"data-dir": str(f)} for f in export_partitions(export, 3, tmp_path / "data")]
    base = {"num-server-rounds": 1, "train-samples": 600, "test-samples": 200,
            "output-dir": str(tmp_path), "client-state-dir": str(tmp_path / "state")}
    with caplog.at_level("WARNING", logger="flowerbed"):
        run_inprocess({**base, "run-name": "own"}, 3, folders)
    config = json.loads((tmp_path / "own" / "config.json").read_text())
    exported = {"partition": "iid", "seed": 3, "train-samples": 600, "public-fraction": 0.0,
                "local-test-fraction": 0.1, "min-partition-size": 10}
    assert config["client-data"] == {"own-folders": 3, "clients": 3, "exported-with": exported,
                                     "by-partition": {"0": exported, "1": exported, "2": exported}}
    assert ("3 of 3 clients train on their own data folders (3 exported with partition='iid', "
            "seed=3; this run's config has partition='dirichlet:0.5', seed=0): they train on their "
            "folders' split; config.json records both (client-data)") in caplog.text
    run_inprocess({**base, "run-name": "seeded"}, 3)
    assert json.loads((tmp_path / "seeded" / "config.json").read_text())["client-data"] is None
    # a run config whose split is impossible on the full data does not stop a run on the
    # clients' own folders, whose split is nobody's (from a review: the server checked it)
    with pytest.raises(Exception, match="300 shards x 3 clients exceeds 600 samples"):
        run_inprocess({**base, "run-name": "shards-seeded", "partition": "shards:300"}, 3)
    run_inprocess({**base, "run-name": "shards-own", "partition": "shards:300"}, 3, folders)
    assert (tmp_path / "shards-own" / "summary.json").is_file()
    with pytest.raises(ConfigError, match="not on the same data: their client-data differs"):
        run_table.table_of_runs([tmp_path / "own", tmp_path / "seeded"], tmp_path / "t")
    table, _ = run_table.table_of_runs([tmp_path / "own"], tmp_path / "t1")
    assert ("3 of the 3 clients read their own data folders, exported with local-test-fraction 0.1, "
            "min-partition-size 10, partition 'iid', public-fraction 0.0, seed 3, train-samples 600; "
            "the header's") in table
    # another seed's run on its seed's export: a table over seeds (the exports' seed left out)
    other = tmp_path / "seed1"
    shutil.copytree(tmp_path / "own", other)
    config.update({"seed": 1, "client-data": {**config["client-data"],
                                              "exported-with": {**exported, "seed": 4}}})
    (other / "config.json").write_text(json.dumps(config))
    table, _ = run_table.table_of_runs([tmp_path / "own", other], tmp_path / "t2")
    assert "seeds 0, 1 (mean ± sample std over seeds)" in table and "exported with local-test-fraction " \
        "0.1, min-partition-size 10, partition 'iid', public-fraction 0.0, train-samples 600;" in table
    config["seed"] = 0  # the same run seed on another export: other data
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="their client-data differs"):
        run_table.table_of_runs([tmp_path / "own", other], tmp_path / "t3")
    # seeds whose exports cross between methods (a review): seed 0's column on two exports
    for name, seed, export_seed in (("b0", 0, 4), ("b1", 1, 3)):
        shutil.copytree(tmp_path / "own", tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({**config, "method": "fedprox", "seed": seed,
            "client-data": {**config["client-data"], "exported-with": {**exported, "seed": export_seed}}}))
    config.update({"seed": 1, "client-data": {**config["client-data"],
                                              "exported-with": {**exported, "seed": 4}}})
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="their client-data differs"):
        run_table.table_of_runs([tmp_path / "own", other, tmp_path / "b0", tmp_path / "b1"], tmp_path / "t4")
    # a resume must read the data the run started on
    crash = {**base, "run-name": "halt", "num-server-rounds": 2, "fault-crash-after": 1}
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(crash, 3, folders)
    with pytest.raises(ConfigError, match="its clients trained on their own data folders, exported "
                                          "with .*this run's clients read the seeded split"):
        run_inprocess({**crash, "fault-crash-after": 0, "resume": str(tmp_path / "halt")}, 3)
    # a hand-written partition.json's values are read as the run config's
    caplog.clear()
    cfg = Config.from_run_config({"partition": "dirichlet:1", "train-samples": 600})
    with caplog.at_level("WARNING", logger="flowerbed"):
        got = client_data({0: ("/d", {"partition": "dirichlet:1", "train-samples": 600.0}),
                           1: ("/e", {})}, cfg, 3)
    each = {"0": {"partition": "dirichlet:1.0", "train-samples": 600}, "1": {}}
    assert not caplog.text and got["client-data"] == {"own-folders": 2, "clients": 3, "exported-with": each,
                                                      "by-partition": each}
    fedcc = Config.from_run_config({"method": "fedcc", "partition": "dirichlet:1", "public-fraction": 0.1})
    assert client_data({0: ("/d", {"partition": "dirichlet:1", "public-fraction": 0.0})}, fedcc, 1)[
        "client-data"]["exported-with"] == {"partition": "dirichlet:1.0", "public-fraction": 0.0}
    # resumes: a run made before client-data was recorded is not checked; a late node is no difference
    from flowerbed.apps.server_app import check_resumed_data

    other = {**exported, "seed": 9}
    own = {"client-data": {"by-partition": {"0": exported, "1": other}}}
    check_resumed_data({}, own, tmp_path)  # (made before client-data)
    check_resumed_data({"client-data": {"exported-with": exported}}, own, tmp_path)  # (or by-partition)
    check_resumed_data(own, {"client-data": {"by-partition": {"0": exported}}}, tmp_path)  # 1 is late
    check_resumed_data({"client-data": None}, {"client-data": None}, tmp_path)
    for before, after in ((None, own["client-data"]), (own["client-data"], None),
                          (own["client-data"], {"by-partition": {"0": exported, "1": None}}),
                          (own["client-data"], {"by-partition": {"0": other}})):
        with pytest.raises(ConfigError, match="its clients trained on .*; this run's clients read"):
            check_resumed_data({"client-data": before}, {"client-data": after}, tmp_path)


def test_a_node_that_joins_late_is_added_to_client_data(tmp_path, caplog):
    """Left out until 2026-12-06: client-data recorded only the nodes that answered before
    round 1, so a resume could not check a late node's data and a table missed its folder."""
    from types import SimpleNamespace

    from flowerbed.apps.server_app import ClientDataRecord
    from flowerbed.results import RunDir

    cfg = Config.from_run_config({"partition": "iid", "train-samples": 600})
    a, b = {"partition": "iid", "train-samples": 600}, {"partition": "iid", "train-samples": 900}
    strategy = SimpleNamespace(data_folders={0: ("/d0", a)}, node_of={0: 10})
    record = ClientDataRecord(strategy, cfg, 3)
    assert record.value["client-data"]["by-partition"] == {"0": a}
    run = RunDir(str(tmp_path), "r", {"seed": 0, **record.value})
    assert record.joined(strategy) is None  # nobody new
    strategy.node_of[1] = 11  # partition 1 joins on the seeded split
    strategy.data_folders[2], strategy.node_of[2] = ("/d2", b), 12  # 2 on its own folder
    run.update_config(record.joined(strategy))
    written = json.loads((tmp_path / "r" / "config.json").read_text())
    assert written["client-data"]["by-partition"] == {"0": a, "1": None, "2": b}
    assert written["client-data"]["own-folders"] == 2 and written["seed"] == 0 and "run-id" in written
    del strategy.node_of[1]  # gone, for now: its record stays
    assert record.joined(strategy) is None
    (tmp_path / "r" / "config.json").write_text("{trunc")  # damaged on disk: update what was written
    strategy.node_of[3] = 13
    run.update_config(record.joined(strategy))
    assert json.loads((tmp_path / "r" / "config.json").read_text())["seed"] == 0
    run.close()
    seeded = ClientDataRecord(SimpleNamespace(data_folders={}, node_of={0: 10}), cfg, 2)
    assert seeded.value == {"client-data": None}  # the seeded split: a late seeded node changes nothing
    assert seeded.joined(SimpleNamespace(data_folders={}, node_of={0: 10, 1: 11})) is None

    # a resume (from a review): the earlier attempts' record is kept for partitions that have not
    # answered yet and held to by the strategy; should one with other data still be trained, the
    # run stops after its round
    from flowerbed.apps.server_app import check_resumed_data

    earlier = {"client-data": {"by-partition": {"0": a, "1": None, "2": a}}}
    resumed = ClientDataRecord(SimpleNamespace(data_folders={0: ("/d0", a)}, node_of={0: 10}), cfg, 3)
    check_resumed_data(earlier, resumed.now, tmp_path, resumed.answered)
    resumed.keep_earlier(earlier["client-data"], tmp_path)
    assert resumed.value["client-data"]["by-partition"] == {"0": a, "1": None, "2": a}
    held = SimpleNamespace(first_data={0: a})  # what the strategy recorded in this attempt
    resumed.hold(held)  # the partitions that have not answered yet must serve their earlier data
    assert held.first_data == {0: a, 1: None, 2: a}
    late = SimpleNamespace(data_folders={0: ("/d0", a), 2: ("/d2", a)}, node_of={0: 10, 2: 12})
    assert resumed.joined(late) is None and resumed.refusal is None  # 2 back with its data
    late.data_folders[1], late.node_of[1] = ("/d1", b), 11  # 1 started on the seeded split
    resumed.joined(late)
    assert "partition 1's client read null when the run started and reads" in str(resumed.refusal)
    # a seeded start of a resumed run (its folder node not back yet) is no difference
    check_resumed_data({"client-data": {"by-partition": {"0": None, "1": a}}}, {"client-data": None},
                       tmp_path, {0})
    with pytest.raises(ConfigError, match="this run's clients read the seeded split"):
        check_resumed_data({"client-data": {"by-partition": {"0": None, "1": a}}},
                           {"client-data": None}, tmp_path, {0, 1})


def test_export_data_does_not_overwrite_an_earlier_export(tmp_path, capsys):
    """A README walk-through: a second export-data into the same --out overwrote the first
    without a word (and a 3-client export over a 5-client one left client-3, client-4 behind)."""
    from flowerbed import cli

    base = ["deploy", "export-data", "--out", str(tmp_path), "-c", "train-samples=600"]
    assert cli.main([*base, "--num-clients", "4"]) == 0
    assert cli.main([*base, "--num-clients", "2", "--seed", "1"]) == 2
    assert "holds client data folders (client-0, client-1, client-2, ...); give another --out, or " \
           "--force" in capsys.readouterr().err
    assert json.loads((tmp_path / "client-0" / "partition.json").read_text())["seed"] == 0
    (tmp_path / "client-certs").mkdir()  # not a client's folder: neither named nor removed
    assert cli.main([*base, "--num-clients", "2", "--seed", "1", "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client-0", "client-1", "client-certs"]
    assert json.loads((tmp_path / "client-0" / "partition.json").read_text())["seed"] == 1
    hand = tmp_path / "hand" / "client-0"  # a hand-made data folder (partition.json is optional)
    hand.mkdir(parents=True)
    (hand / "train-images.idx.gz").write_text("mine")
    assert cli.main([*base[:2], "--out", str(hand.parent), *base[4:], "--num-clients", "2"]) == 2
    assert (hand / "train-images.idx.gz").read_text() == "mine"
    assert "holds client data folders (client-0)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A SuperLink (TLS, SuperNode authentication) and 2 SuperNodes on loopback.

    One torch thread per ClientApp process: on 2 cores, 2 SuperNodes with 2 threads each only
    spin against each other.
    """
    home = tmp_path_factory.mktemp("deploy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        with deploy.deployment(home, 2, address=f"127.0.0.1:{free_port()}", auth=True) as dep:
            mp.undo()
            yield dep
    assert not any(_alive(p) for p in dep.pids.values())  # `down` stopped what `up` started


# methods whose checks below read client-side evaluation results
EVALUATED = {"fedcc", "fedfew", "fedrep", "local", "fedade"}
# 2 rounds, so that what a client keeps in context.state (and files) is read back in round 2:
# SCAFFOLD's control variate, FedRep's personal head, FedCC's client model, Fed-ADE's personal
# layers and estimator buffers, FedXDS's D_g after its phase change; the other stateful methods
# (FedBYOL's target, Local's client model) keep ArrayRecords the same way and get 1:
# every deployed message starts a ClientApp process (about 6 CPU-seconds with flwr and torch)
TWO_ROUNDS = {"scaffold", "fedcc", "fedxds", "fedade", "fedrep"}


# methods that differ from a deployed one only in their local loss or an evaluation step, with
# the same messages, record names and client state (they run through the simulation engine and
# in-process in every resume and fault test): a deployed run costs CI 40-70 CPU-seconds
COVERED_BY = {"fedprox": "fedavg", "fedavg-ft": "fedavg", "fedsimclr": "fedbyol", "fedx": "fedbyol",
              "fedu": "fedbyol", "fedmoco": "fedbyol", "fedprotocl": "fedbyol",
              "feddf": "fedcc", "fedmd": "fedcc", "ditto": "fedavg", "apfl": "fedavg", "feddyn": "scaffold",
              "fedamp": "fedrep", "fednova": "fedavg",
              "fedlc": "fedavg", "fedrs": "fedavg", "fedsam": "fedavg",
              "fedvls": "fedavg", "fedmr": "fedrep", "fedpoe": "fedade", "fedsoft": "fedfew",
              "ifca": "fedfew", "fedmgda": "fedavg", "cfl": "fedrep",
              "moon-unsup": "fedbyol", "atlas": "fedade", "fedftg": "fedavg", "fedct": "fedcc",
              "fedconcat": "fedfew", "fedfed": "fedxds"}
# FedFed: FedXDS's messages (its VAE travels as "arrays" in the rounds before D_g) and client state.
# FedFTG: FedAvg's messages, with a list-valued metric more (its label counts). FedConcat: a model for each
# node and FedFTG's replies in its encoder stage, then FedFew's messages down (the K models as model.0 ...)
# and one record up (its classifier), no client state. MOON-unsup: FedBYOL's messages, its previous local
# model filed as BYOL's target is. FedMGDA: FedAvg's messages, another server step. CFL: a model for each
# node (its cluster's), as FedRep's, with FedAvg's client. IFCA, FedSoft: FedFew's messages down (the K
# models as model.0 ...), FedAvg's up (one whole model as "arrays", with a metric more); FedSoft's local
# model and importance estimate are filed as APFL's model and alpha are; its evaluation message is Local's
# (no arrays). Ditto, APFL: FedAvg's messages; their personal model is an ArrayRecord in context.state
# (APFL's alpha a MetricRecord), filed and read back as Local's is. FedDyn: SCAFFOLD's (a state adopted once
# the server names the round it took). FedAMP, FedMR: a model of its own for each node, as FedRep's (FedMR's
# client is FedAvg's, stateless). FedNova: FedAvg's, with one more metric. FedLC, FedRS, FedSAM, FedVLS:
# FedAvg's, another local step. FedSimCLR, FedX (over any base): FedBYOL's messages (the SSL model down and
# up, the probe on the server), with no client state (FedX's frozen global copy is made from the received
# model) or, over BYOL/MoCo/ProtoCL, its base's. FedMoCo, FedProtoCL: FedBYOL's; the key encoder is filed as
# BYOL's target is, with one more record (the queue), which their in-process resume tests bring back
# (FedProtoCL's prototypes are rebuilt from the key encoder each epoch: no state of their own). FedMD,
# FedDF, FedCT: FedCC's (a DistillClient each: predictions on the public set up, soft targets down, the
# client model filed in context.state; no unknown class, and FedMD uploads logits, FedCT hard labels).
# Fed-POE: Fed-ADE's rounds with every layer shared (the whole model up, and the pre-trained one down to a
# client without its local model, as Fed-ADE's personal layers go to one without its own), its local model
# and Hedge weights filed in context.state. ATLAS: Fed-ADE's rounds, the pre-trained model down to a client
# without its base learners as Fed-POE's, then messages without a model and replies with metrics only
# (Local's); its bases and Hedge weights filed in context.state
DEPLOYED = [m for m in METHODS if m not in COVERED_BY]


def test_every_method_is_deployed_or_shares_a_deployed_message_flow():
    """A new method must join the deployment runs or name the deployed method it mirrors."""
    assert set(COVERED_BY.values()) <= set(DEPLOYED) and set(COVERED_BY) <= set(METHODS)
    for method, twin in COVERED_BY.items():
        assert METHODS[method].model is METHODS[twin].model, method


def rounds_of(method: str) -> int:
    return 2 if method in TWO_ROUNDS else 1


def run_every_method(deployment, out) -> dict:
    """Every deployed method (``rounds_of``) on one deployment, 8 runs at a time
    (CPU-bound on 2 cores: 17 at a time, or two deployments, took as long)."""
    def one(method):
        rounds = rounds_of(method)
        rc = {**SMALL, **EXTRA.get(method, {}), "method": method, "output-dir": str(out),
              "run-name": method, "num-server-rounds": rounds, "eval-every": rounds,
              "round-timeout": 3600.0}  # 8 runs at once on 2 cores: a phase can take minutes
        if method not in EVALUATED:  # spare CI the evaluation messages where nothing checks them
            rc["fraction-evaluate"] = 0.0
        try:
            return deploy.run(deployment, rc, quiet=True, log_file=out / f"{method}.log")
        except Exception as e:  # noqa: BLE001 - reported per method below
            return e

    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(DEPLOYED, pool.map(one, DEPLOYED), strict=True))


def check_deployed_run(out, method: str, res) -> None:
    if isinstance(res, Exception):
        log = (out / f"{method}.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"failed on the deployment engine: {res}\n{log}")
    rows = read_metrics(out / method)
    rounds = rounds_of(method)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    assert all(r["clients-ok"] == 2 and r["clients-failed"] == 0 for r in rows[1:])
    cfg = json.loads((out / method / "config.json").read_text())
    assert cfg["num-partitions"] == 2
    assert res["rounds"] == rounds
    last = rows[-1]
    if method in ("fedavg", "scaffold"):
        assert res["final-accuracy"] > rows[0]["accuracy"]  # it learns (state kept across rounds)
    if method == "fedcc":
        # only predictions travel: bytes up per client are the |D_u| x (C+1) matrix, not a model
        assert rows[0].get("accuracy") is None and 0 <= last["accuracy"] <= 1
        assert res["bytes-up-per-client-round"] < 100 * 11 * 4 + 2000  # 100 public samples
        assert last["client-global-test-accuracy"] is not None
    if method in ("fedfew", "fedrep", "local"):
        assert 0 <= last["client-accuracy"] <= 1
        assert {"client-accuracy-min", "client-accuracy-max", "jain-index"} <= set(last)


def test_every_method_runs_on_the_deployment_engine(deployment, tmp_path):
    """One test, not one per method: under pytest-xdist's default distribution (each test to
    whichever worker is free) a method's test on another worker would start a second deployment
    for it. Every method's failure is reported, each with the end of its log."""
    results = run_every_method(deployment, tmp_path)
    failures = {}
    for method in sorted(DEPLOYED):
        try:
            check_deployed_run(tmp_path, method, results[method])
        except AssertionError as e:
            failures[method] = f"{type(e).__name__}: {e}"
    assert not failures, "\n\n".join(f"{m}: {why}" for m, why in failures.items())


def terminal_signals() -> None:
    """A terminal's signal handling for a launcher the test starts: a shell's background job
    ignores SIGINT, and a job under nohup (as CI may run the suite) ignores SIGHUP; the
    launcher keeps an ignored signal ignored, as it must under nohup."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_ctrl_c_in_deploy_run_stops_the_run_on_the_superlink(deployment, tmp_path, sig, group):
    """The SuperLink outlives the launcher: Ctrl-C must stop the run there (``flwr stop``), not
    only the local ``flwr run --stream``, or the ServerApp trains on for nobody. So must
    ``kill <launcher>`` (SIGTERM to it alone) and a closed terminal (SIGHUP, the same handler:
    tests/test_compare.py checks it is installed): both left the run going."""
    rc = (f"method='fedavg' num-server-rounds=200 train-samples=1000 test-samples=200 "
          f"min-clients=2 fraction-evaluate=0.0 output-dir='{tmp_path}' run-name='interrupted'")
    cmd = [sys.executable, "-m", "flowerbed", "deploy", "run", "--home", str(deployment.home),
           "-c", rc]
    # Ctrl-C reaches the terminal's whole group; a shell's background job (`make test &`) ignores
    # SIGINT and passes that on, so the launcher gets the default handling back, as in a terminal
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=terminal_signals)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Successfully started run" in line:
            run_id = line.split()[-1]
            break
    else:
        pytest.fail("".join(lines[-30:]))
    time.sleep(3)
    os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
    try:
        rest = proc.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:  # not stopped: leave no launcher training on
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 128 + sig and "Traceback" not in rest, rest[-3000:]
    assert f"stopped run {run_id}" in rest, rest[-3000:]
    assert f"Successfully started run {run_id}" in (tmp_path / "interrupted.log").read_text()
    res = deploy.flwr_cli(deployment, "list", "--run-id", run_id, deploy.CONNECTION,
                          "--format", "json")
    status = json.loads(res.stdout)["runs"][0]["status"]
    assert "stopped" in status, status


@pytest.mark.skipif(netns_usable() is None, reason="done across network namespaces in test_netns.py")
def test_killed_supernode_mid_round(tmp_path):
    """SIGTERM one of 3 SuperNodes during round 2: the run finishes with the other two and the
    metrics name the partition that dropped."""
    rc = {**SMALL, "num-server-rounds": 3, "eval-every": 3, "method": "fedavg",
          "output-dir": str(tmp_path), "run-name": "drop"}
    with deploy.deployment(tmp_path / "home", 3, address=f"127.0.0.1:{free_port()}") as dep:
        summary, rows = run_killing_node(dep, rc, tmp_path / "drop.log")
    assert_dropped(rows, node=2, num_nodes=3)
    failed = [f for r in rows for f in r["failures"]]
    assert summary["client-failures-total"] == len(failed)
    assert summary["final-accuracy"] is not None


@pytest.mark.skipif(netns_usable() is None, reason="done across network namespaces in test_netns.py")
def test_a_restarted_supernode_continues_from_its_filed_state(tmp_path):
    """SuperNode 2 killed during round 2 and started again (the same command, as a user restarts
    a crashed machine's SuperNode): the SuperLink sees a new node, the server maps it to
    partition 2 again, and its client restores SCAFFOLD's control variate from its filed state
    instead of starting from zero."""
    rc = {**SMALL, "num-server-rounds": 3, "eval-every": 3, "method": "scaffold",
          "fraction-evaluate": 0.0, "output-dir": str(tmp_path), "run-name": "restart"}
    with deploy.deployment(tmp_path / "home", 3, address=f"127.0.0.1:{free_port()}") as dep:
        summary, rows = run_killing_node(dep, rc, tmp_path / "restart.log",
                                         restart=lambda: deploy.start_node(dep, 2, 3))
        node_log = dep.log_file("supernode-2").read_text(errors="replace")
    assert summary["final-accuracy"] is not None
    assert_rejoined(rows, node=2, num_nodes=3, node_log=node_log)


def test_up_refuses_certificates_that_do_not_name_the_address(tmp_path):
    """Regression: `up --address` on another host reused the first `up`'s certificate, and the
    SuperNodes then failed the TLS check with only a timeout to show for it."""
    certs.make_certs(tmp_path / "certs", list(certs.DEFAULT_HOSTS))
    dep = deploy.Deployment(home=tmp_path, address="10.0.0.5:9092")
    with pytest.raises(deploy.DeployError, match="does not name 10.0.0.5; make new ones with "
                                                 "`flowerbed deploy certs"):
        deploy.up(dep, 1)
    assert not (tmp_path / "pids.json").exists()  # nothing was started
    # the same names written otherwise are named: addresses compare as addresses, names case-blind
    assert certs.unnamed(tmp_path / "certs" / certs.SERVER_CERT,
                         ["0:0:0:0:0:0:0:1", "[::1]", "LOCALHOST", "10.0.0.5"]) == ["10.0.0.5"]


def test_deploy_bookkeeping_survives_reused_pids_damage_and_hangs(tmp_path, monkeypatch):
    """Found by a review: a stale pids.json made `down` SIGTERM whatever process group had
    reused a pid; a damaged pids.json and a hanging `flwr` ended in bare tracebacks; a second
    `up --auth` on one home failed because its keys were registered already."""
    import subprocess
    import time

    other = subprocess.Popen(["sleep", "30"], start_new_session=True)  # not ours
    try:
        dep = deploy.Deployment(home=tmp_path, insecure=True)
        dep.pids, dep.starts = {"superlink": other.pid}, {"superlink": 1}  # pid reused since
        dep.save()
        assert not deploy.Deployment.load(tmp_path).alive("superlink")
        assert deploy.down(deploy.Deployment.load(tmp_path)) == []
        time.sleep(0.2)
        assert other.poll() is None  # left alone
        dep.started("superlink", other.pid)  # recorded with its real start time: ours
        assert deploy.Deployment.load(tmp_path).alive("superlink")
    finally:
        other.kill()
        other.wait()
    (tmp_path / "pids.json").write_text('{"address": "127.0')
    with pytest.raises(deploy.DeployError, match="pids.json is damaged"):
        deploy.Deployment.load(tmp_path)

    hang = tmp_path / "flwr"
    hang.write_text("#!/bin/sh\nsleep 5\n")
    hang.chmod(0o755)
    monkeypatch.setattr(deploy, "_bin", lambda name: str(hang))
    with pytest.raises(deploy.DeployError, match="did not answer within 0 s"):
        deploy.flwr_cli(dep, "supernode", "list", timeout=0.2)

    answers = iter([subprocess.CompletedProcess([], 1, "", "Public key already in use."),
                    subprocess.CompletedProcess([], 1, "", "connection refused")])
    monkeypatch.setattr(deploy, "flwr_cli", lambda *a, **k: next(answers))
    deploy.register_node(dep, 0)  # registered by an earlier `up`: fine
    with pytest.raises(deploy.DeployError, match="connection refused"):
        deploy.register_node(dep, 0)


def test_up_warns_when_the_superlink_listens_beyond_the_loopback(tmp_path, monkeypatch, caplog):
    """From a review: Flower's open-source SuperLink checks no account on its Control API, so
    whoever reaches the port can run code; TLS and --auth do not stop that, and nothing said so."""
    def no_process(*a, **k):
        raise RuntimeError("no process in this test")

    monkeypatch.setattr(deploy, "spawn", no_process)
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        caplog.clear()
        dep = deploy.Deployment(home=tmp_path / host, address=f"127.0.0.1:{engine.free_port()}",
                                insecure=True)
        with pytest.raises(RuntimeError, match="no process"):
            deploy.up(dep, 1, host=host)
        assert ("anyone who reaches port" in caplog.text) is warned, caplog.text


def test_an_expired_certificate_is_refused_before_anything_starts(tmp_path):
    certs.make_certs(tmp_path / "certs", list(certs.DEFAULT_HOSTS), days=0)  # expired 5 min ago
    with pytest.raises(deploy.DeployError, match="expired on .*flowerbed deploy certs"):
        deploy.up(deploy.Deployment(home=tmp_path), 1)
    assert not (tmp_path / "pids.json").exists()


def test_a_superlink_that_never_opens_its_port_is_stopped(tmp_path, monkeypatch):
    """engine._start left such a SuperLink running (nobody knew its pid)."""
    from flowerbed import engine

    fake = tmp_path / "flower-superlink"
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(engine, "_bin", lambda name: str(fake))

    filed = []

    def never(proc, *a, **k):  # the shell creates the file before it writes the pid into it
        # its pid is filed before the wait: a launcher killed now leaves it findable (a review)
        filed.append(engine._read_pid(tmp_path / "home" / "superlink.pid"))
        while not ((tmp_path / "pid").exists() and (tmp_path / "pid").read_text().endswith("\n")):
            time.sleep(0.01)
        raise engine.SuperLinkTimeout("did not open its port")

    monkeypatch.setattr(engine, "wait_superlink", never)
    with pytest.raises(engine.SuperLinkTimeout), open(tmp_path / "log", "ab") as out:
        engine._start(tmp_path / "home", free_port(), out, (tmp_path / "home" / "superlink.pid",))
    assert not _alive(int((tmp_path / "pid").read_text()))
    assert filed[0] is not None and filed[0][0] == int((tmp_path / "pid").read_text())
    assert not (tmp_path / "home" / "superlink.pid").exists()  # not named as running once stopped


def test_run_config_strings_flwr_cannot_read_back_are_refused():
    from flowerbed.engine import toml_value

    assert toml_value("runs/🌸") == '"runs/🌸"'  # (json's \ud83c escapes broke flwr's TOML)
    with pytest.raises(ConfigError, match="may not contain"):
        toml_value('say "hi"')


def children_started(pid: int, n: int) -> list[int]:
    """Wait (up to 10 s, however loaded the machine) until ``pid`` has ``n`` live descendants."""
    deadline = time.time() + 10
    while len(descendants(pid)) < n and time.time() < deadline:
        time.sleep(0.05)
    return descendants(pid)


def test_stop_group_gives_the_leaders_children_their_grace_period():
    """Once the group's leader had exited on SIGTERM, its children got SIGKILL at once (a
    ClientApp still writing its state was cut off)."""
    import subprocess

    from flowerbed.engine import _group_alive, stop_group

    marker = f"/tmp/flowerbed-grace-{os.getpid()}"
    script = (f"(trap 'sleep 1; : > {marker}; exit 0' TERM; sleep 30 & wait) & "
              "trap 'exit 0' TERM; sleep 30 & wait")
    leader = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    assert len(children_started(leader.pid, 3)) == 3  # the subshell and both sleeps: the traps are set
    try:
        stop_group(leader.pid, timeout=5)
        assert os.path.exists(marker) and not _group_alive(leader.pid)  # the child finished
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)


def test_down_stops_a_group_whose_leader_died():
    """Found by a review: down skipped a SuperNode whose leader process had died, leaving its
    ClientApp (same process group) running, and forgot it."""
    import signal
    import subprocess

    from flowerbed.engine import _group_alive

    leader = subprocess.Popen(["bash", "-c", "sleep 30 & wait"], start_new_session=True)
    assert children_started(leader.pid, 1)
    dep = deploy.Deployment(home="/nonexistent-flowerbed", insecure=True)
    dep.pids, dep.starts = {"supernode-0": leader.pid}, {"supernode-0": start_time(leader.pid)}
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    assert _group_alive(leader.pid) and dep.ours("supernode-0")  # its child runs on
    assert deploy.down(dep) == ["supernode-0"] and not _group_alive(leader.pid)


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    """Found by a review: `up --port` on a port another deployment held reported success (the
    other listener answered), its own SuperLink died on 'address already in use', and its
    SuperNodes joined the other federation."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dep = deploy.Deployment(home=tmp_path, address=f"127.0.0.1:{port}", insecure=True)
        with pytest.raises(deploy.DeployError, match=f"port {port} is in use"):
            deploy.up(dep, 1)
        new = deploy.Deployment(home=tmp_path / "new", address=f"127.0.0.1:{port}")  # with TLS
        with pytest.raises(deploy.DeployError, match=f"port {port} is in use"):
            deploy.up(new, 1)
    assert not (tmp_path / "pids.json").exists()  # nothing was started
    assert not (tmp_path / "new").exists()  # nor a new home made (with certificates in it)


def test_the_superlink_listens_where_its_address_points():
    """`up --address 10.0.0.5` bound 127.0.0.1 and waited a minute to report a closed port."""
    assert deploy.bind_for("127.0.0.1") == "127.0.0.1" and deploy.bind_for("localhost") == "127.0.0.1"
    assert deploy.bind_for("[::1]") == "::1" and deploy.bind_for("127.0.1.1") == "127.0.1.1"
    assert deploy.bind_for("[localhost]") == "127.0.0.1"
    assert deploy.bind_for("10.0.0.5") == deploy.bind_for("lab.example") == "0.0.0.0"
    assert deploy.bind_for("[2001:db8::5]") == "::"


def test_a_specific_bind_address_is_named_in_the_certificate(tmp_path):
    """The SuperLink's ServerApp executor connects to the bound interface, so a certificate
    without it is refused up front, with the command that makes one."""
    certs.make_certs(tmp_path / "certs", [*certs.DEFAULT_HOSTS, "lab.example"])
    dep = deploy.Deployment(home=tmp_path, address=f"lab.example:{free_port()}")
    with pytest.raises(deploy.DeployError, match="does not name 10.0.0.7;.*--host 10.0.0.7"):
        deploy.up(dep, 1, host="10.0.0.7")


def test_certs_are_not_replaced_without_force(tmp_path, capsys):
    """Found by a review: a second `deploy certs` made a new CA without a word, which breaks
    every SuperNode that holds the old ca.crt."""
    from flowerbed import cli

    out = tmp_path / "certs"
    assert cli.main(["deploy", "certs", "--out", str(out)]) == 0
    ca = (out / certs.CA_CERT).read_bytes()
    assert cli.main(["deploy", "certs", "--out", str(out), "--host", "10.0.0.5"]) == 2
    assert "pass --force" in capsys.readouterr().err and (out / certs.CA_CERT).read_bytes() == ca
    assert cli.main(["deploy", "certs", "--out", str(out), "--host", "10.0.0.5", "--force"]) == 0
    assert (out / certs.CA_CERT).read_bytes() != ca
    assert certs.unnamed(out / certs.SERVER_CERT, ["10.0.0.5"]) == []


def test_a_dead_superlink_is_named_by_run_and_status(tmp_path, capsys):
    """Found by a review: after the SuperLink died, `status` printed 'SuperNodes online: None'
    and `deploy run` ended with a bare 'the ServerApp failed'."""
    from flowerbed import cli

    gone = subprocess.Popen(["true"])
    gone.wait()
    dep = deploy.Deployment(home=tmp_path, insecure=True)
    dep.pids, dep.starts = {"superlink": gone.pid}, {"superlink": 1}
    dep.save()
    with pytest.raises(deploy.DeployError, match="SuperLink of .* is not running"):
        deploy.run(deploy.Deployment.load(tmp_path), {"output-dir": str(tmp_path), "run-name": "r"})
    assert cli.main(["deploy", "status", "--home", str(tmp_path)]) == 0
    assert "the SuperLink is gone" in capsys.readouterr().out


def test_deploy_run_checks_the_split_against_its_supernodes_before_it_starts(tmp_path, capsys):
    """From a README walk-through: `deploy run` sent an impossible split to the SuperLink and
    ended in a garbled ClientSetupError; `--num-clients` was silently ignored. (Nothing here
    runs: the refusals come before any process is asked.)"""
    from flowerbed import cli

    dep = deploy.Deployment(home=tmp_path, insecure=True)
    dep.pids = {"superlink": 1, "supernode-0": 2, "supernode-1": 3, "supernode-2": 4}
    dep.save()
    assert deploy.Deployment.load(tmp_path).supernodes() == 3
    home = ["--home", str(tmp_path)]
    assert cli.main(["deploy", "run", *home, "-c", "partition='pathological:11'"]) == 2
    assert "'partition' = 'pathological:11'" in capsys.readouterr().err
    assert cli.main(["deploy", "run", *home, "--num-clients", "5"]) == 2
    assert "has 3 SuperNodes" in capsys.readouterr().err
    assert cli.main(["deploy", "run", *home, "-c", "min-clients=4"]) == 2  # not the user's option
    assert "must be >= min-clients (4): the deployment in" in capsys.readouterr().err
    assert cli.main(["deploy", "run", *home, "--method", "fedavgg"]) == 2
    assert "did you mean fedavg?" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert cli.main(["deploy", "down", "--home", str(tmp_path / "none")]) == 0  # as superlink down
    assert "nothing to stop" in capsys.readouterr().out


def test_deploy_run_resumes_a_run_in_its_own_folder(tmp_path, capsys, monkeypatch):
    """From a deployment walk-through: `deploy run` had no --resume; `-c resume=<dir>` resumed the
    run on the SuperLink, but the launcher looked for its summary in a new run folder and said
    'the ServerApp failed', keeping its console output in a new log. (The real engine's resume
    is test_resume.py's; here the deployment and `flwr run` are stand-ins.)"""
    import json

    from flowerbed import cli
    from flowerbed.config import Config

    dep = deploy.Deployment(home=tmp_path / "home", insecure=True)
    dep.home.mkdir()
    dep.pids = {"superlink": 1, "supernode-0": 2, "supernode-1": 3}
    dep.save()
    stopped = tmp_path / "runs" / "fedavg-deploy-1"
    stopped.mkdir(parents=True)
    rc = {"num-server-rounds": 2, "train-samples": 600, "output-dir": str(stopped.parent),
          "run-name": stopped.name}
    (stopped / "config.json").write_text(json.dumps(
        {**Config.from_run_config(rc).to_run_config(), "num-partitions": 2}))
    (stopped / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1}\n')
    seen = []
    monkeypatch.setattr(deploy, "run", lambda d, overrides, log_file, tee: seen.append(
        (overrides, log_file)) or {"final-accuracy": 0.5})
    home = ["--home", str(dep.home)]
    for how in (["--resume", str(stopped)], ["-c", f"resume='{stopped}'"]):
        assert cli.main(["deploy", "run", *home, *how, "--rounds", "3"]) == 0
        overrides, log_file = seen.pop()
        assert (overrides["run-name"], overrides["resume"]) == (stopped.name, str(stopped))
        assert overrides["num-server-rounds"] == 3 and log_file == stopped.parent / f"{stopped.name}.log"
    assert cli.main(["deploy", "run", *home, "--resume", str(stopped), "--method", "fedprox"]) == 2
    assert "a resumed run keeps its config; this changes method" in capsys.readouterr().err
    dep.pids["supernode-2"] = 4
    dep.save()
    assert cli.main(["deploy", "run", *home, "--resume", str(stopped)]) == 2
    assert "the run has 2 clients (partitions) and the deployment" in capsys.readouterr().err
    assert cli.main(["deploy", "run", *home, "--resume", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err and not seen


def test_stop_group_of_a_process_that_leads_no_group_spares_the_group():
    """A review found stop_group signalled the group of any pid it was given: for a process
    that leads none, its parent's whole group (a shell job, or the launcher itself)."""
    from flowerbed.engine import stop_group

    job = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        first, second = children_started(job.pid, 2)[:2]
        stop_group(first, timeout=5)
        assert not _alive(first) and _alive(second) and job.poll() is None
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def test_each_start_of_a_deployment_process_is_headed_in_its_log(tmp_path):
    """From a deployment walk-through: every `deploy up` appended to the same process logs with
    nothing between one deployment's output and the next."""
    import sys

    log = tmp_path / "logs" / "supernode-0.log"
    log.parent.mkdir()
    for _ in range(2):
        deploy.spawn([sys.executable, "-c", "print('output')"], log).wait()
    lines = log.read_text().splitlines()
    assert [ln.startswith("===== ") for ln in lines] == [True, False, True, False]
    assert lines[1] == "output" and "-c" in lines[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pathspec's, inside flwr's FAB build
def test_the_app_flwr_run_ships_is_the_package_only(tmp_path):
    """From a review: flwr builds the FAB from every .py/.toml/.json/.md in the project, so a
    deploy --home inside it (its apps/ holds each run's installed FAB) was shipped again by the
    next run, doubling until flwr refused it past 10 MB; tests, docs and results went too."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    home = engine.PROJECT / "tmp-test-home-fab"
    (home / "apps" / "x").mkdir(parents=True, exist_ok=True)
    try:
        (home / "apps" / "x" / "a.py").write_text("x = 1\n")
        names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(engine.PROJECT))).namelist()
    finally:
        import shutil

        shutil.rmtree(home)
    assert {n.split("/")[0] for n in names} == {"flowerbed", "pyproject.toml", ".info"}
    assert "flowerbed/apps/server_app.py" in names


def test_node_key_force_replaces_a_key_pair(tmp_path, capsys):
    """From a review: --out went through the folder check, which refused the existing key file,
    so --force could not replace it."""
    from flowerbed import cli

    key = str(tmp_path / "keys" / "k")
    assert cli.main(["deploy", "node-key", "--out", key]) == 0
    first = (tmp_path / "keys" / "k.pub").read_text()
    assert cli.main(["deploy", "node-key", "--out", key]) == 2
    assert "holds a key pair already" in capsys.readouterr().err
    assert cli.main(["deploy", "node-key", "--out", key, "--force"]) == 0
    assert (tmp_path / "keys" / "k.pub").read_text() != first


def test_an_ipv6_address_is_bracketed_and_named_as_an_ip_in_the_certificate(tmp_path):
    """From a review: --address ::1 gave flwr 'https://::1:8000' (no URL), and [2001:db8::5]
    went into the certificate as a DNS name, which TLS never matches against an address."""
    import ipaddress

    assert deploy.with_port("::1", 8000) == "[::1]:8000" == deploy.with_port("[::1]", 8000)
    assert deploy.with_port("10.0.0.5", 80) == "10.0.0.5:80"
    assert deploy.with_port("node.example", 80) == "node.example:80"
    cert = Path(certs.make_certs(tmp_path, ["localhost", "[2001:db8::5]"])["cert"])
    san = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("2001:db8::5") in san.get_values_for_type(x509.IPAddress)
    assert not certs.unnamed(cert, ["[2001:db8::5]", "2001:db8::5"])


def test_up_counts_only_the_supernodes_that_came_online_after_it_started(monkeypatch):
    """From a review: the SuperLink's state.db lists an earlier deployment's nodes online for
    about a minute, so a quick down-then-up could report its new SuperNodes online too soon."""
    import datetime as dt
    from types import SimpleNamespace

    def at(t):
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")

    now = time.time()
    nodes = [{"status": "online", "online-at": at(now - 60)}, {"status": "online", "online-at": at(now + 2)},
             {"status": "offline", "online-at": at(now + 2)}, {"status": "online", "online-at": "N/A"}]
    listed = SimpleNamespace(stdout=json.dumps({"nodes": nodes}))
    monkeypatch.setattr(deploy, "flwr_cli", lambda *a, **k: listed)
    dep = deploy.Deployment(home=Path("."), address="127.0.0.1:1")
    assert deploy.online_nodes(dep) == 3 and deploy.online_nodes(dep, since=now) == 2

    def slow(*a, **k):  # a loaded SuperLink (from a review): unknown this time, asked again
        raise deploy.DeployError("`flwr supernode list` did not answer within 30 s")

    monkeypatch.setattr(deploy, "flwr_cli", slow)
    assert deploy.online_nodes(dep) is None
