"""Checkpoint and resume, fault injection and hostile input, for every method.

The every-method matrices run the real ServerApp ``run`` and the real ClientApp in-process
(tests/inprocess.py) so that they fit in CI; real engines: a run killed and resumed through
``flwr run`` below, every method on the deployment engine in test_deploy.py.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import numpy as np
import pytest
import torch
from inprocess import run_inprocess
from methods import EXTRA

from flowerbed import checkpoint, engine, faults
from flowerbed import config as config_module
from flowerbed.apps import server_app
from flowerbed.config import PERSONAL_METHODS, Config, ConfigError, defaults
from flowerbed.registry import METHODS
from flowerbed.results import read_metrics, refuse_existing

TINY = {"num-server-rounds": 2, "train-samples": 600, "test-samples": 200, "min-clients": 2,
        "batch-size": 64}


def rows_of(path):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(path)]


def differences(a, b, where="") -> list[str]:
    """Where two metric trees differ: structure and non-floats exactly, floats to 1e-6 relative
    (separate processes may round a reduction differently; a lost client or a wrong round
    differs by far more)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())} in one only"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if a == pytest.approx(b, rel=1e-6, abs=1e-9, nan_ok=True) else [f"{where}: {a!r} != {b!r}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def config(tmp_path, method, name, **more):
    return {**TINY, **EXTRA.get(method, {}), "method": method, "output-dir": str(tmp_path),
            "run-name": name, "client-state-dir": str(tmp_path / "client-state"), **more}


def test_plain_flwr_gets_the_output_checks_before_the_data_loads(tmp_path, monkeypatch, caplog):
    """Found by a walk-through of plain `flwr run`: output-dir='/proc/x' (or a file) ended in a
    bare errno, and a taken run-name was refused, only after the data had loaded and the nodes
    had been asked (17-22 s). The ServerApp now checks first. Each run's config.json says which
    torch/flwr/Python it ran on, and a run in an environment Flower built for it says so."""
    def nothing_loads(cfg):
        raise AssertionError("the data loaded before the output checks")

    with monkeypatch.context() as m:
        m.setattr(server_app, "train_set", nothing_loads)
        with pytest.raises(ConfigError, match="output-dir.*no folder can be made there"):
            run_inprocess(config(tmp_path, "fedavg", "x", **{"output-dir": "/proc/flowerbed-x"}), 2)
        (tmp_path / "file").write_text("")
        with pytest.raises(ConfigError, match="output-dir.*is a file, not a folder"):
            run_inprocess(config(tmp_path, "fedavg", "x", **{"output-dir": str(tmp_path / "file")}), 2)
        (tmp_path / "taken").mkdir()
        (tmp_path / "taken" / "metrics.jsonl").write_text("{}\n")
        with pytest.raises(ConfigError, match="already holds a run"):
            run_inprocess(config(tmp_path, "fedavg", "taken"), 2)
        # a run-name that reaches a data set's folder (here through a link) writes nothing there
        data = tmp_path.parent / f"{tmp_path.name}-data"  # a stand-in, outside output-dir
        data.mkdir()
        (data / "train-images-idx3-ubyte.gz").write_bytes(b"idx")
        (tmp_path / "linked").symlink_to(data)
        with pytest.raises(ConfigError, match=r"run-name.*holds files that are not a run's "
                                              r"\(train-images-idx3-ubyte.gz\)"):
            run_inprocess(config(tmp_path, "fedavg", "linked"), 2)
        assert [p.name for p in data.iterdir()] == ["train-images-idx3-ubyte.gz"]
        # what a run stopped before its config.json, or the system, leaves there is no stranger
        stopped = tmp_path / "stopped"
        stopped.mkdir()
        for name in ("metrics.jsonl", ".writer.lock", ".config.json.host.1.x.tmp", ".DS_Store"):
            (stopped / name).write_text("")
        refuse_existing(stopped)
        (stopped / ".git").mkdir()  # a hidden folder: someone's
        with pytest.raises(ConfigError, match=r"holds files that are not a run's \(\.git\)"):
            refuse_existing(stopped)
    run_inprocess(config(tmp_path, "fedavg", "ok", **{"num-server-rounds": 1}), 2)
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["server-device-used"] == "cpu"
    saved = json.loads((tmp_path / "ok" / "config.json").read_text())["software"]
    assert saved["torch"] == torch.__version__ and saved["flwr"] and saved["environment"]
    assert "an environment Flower built for it" not in caplog.text  # .venv's torch
    # Flower's per-run environment is put first on sys.path (sys.prefix stays .venv's), so torch
    # comes from there: what the record and the warning go by
    site = "/root/.flwr/runtime-envs/abc123/lib/python3.11/site-packages"
    monkeypatch.setattr(torch, "__file__", f"{site}/torch/__init__.py")
    assert server_app.software()["environment"] == site
    server_app.warn_runtime_env(server_app.software()["environment"])
    assert "an environment Flower built for it" in caplog.text


def keys_read(m: pytest.MonkeyPatch) -> set[str]:
    """The run-config keys read from a Config from now on, outside config.py's own checks and
    the dataclass's generated __eq__ and __hash__ (compiled from '<string>'), which read all."""
    seen: set[str] = set()
    keys = set(defaults())
    get = Config.__getattribute__

    def recording(cfg, name):
        key = name.replace("_", "-")
        if key in keys and sys._getframe(1).f_code.co_filename not in (config_module.__file__, "<string>"):
            seen.add(key)
        return get(cfg, name)

    m.setattr(Config, "__getattribute__", recording)
    return seen


@pytest.mark.parametrize("method", sorted(METHODS))
def test_killed_and_resumed_equals_uninterrupted(tmp_path, method, monkeypatch, caplog):
    """Crash right after round 1's checkpoint, resume: the same metrics as a run that never
    stopped (server state from the checkpoint, client state from the clients' filed state)."""
    from flowerbed.results import measure

    with monkeypatch.context() as m:
        read = keys_read(m)
        full = run_inprocess(config(tmp_path, method, "full"), 3)
    assert f"clients, server device cpu | acc: {measure(method)}\n" in caplog.text  # what "acc" is
    # a table compares a key only among the methods config.KEY_READERS says read it
    assert not [k for k in read if not config_module.reads(method, k)], "add them to config.KEY_READERS"
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(config(tmp_path, method, "halt", **{"fault-crash-after": 1}), 3)
    assert [r["round"] for r in read_metrics(tmp_path / "halt")] == [0, 1]
    resumed = run_inprocess(config(tmp_path, method, "halt", resume=str(tmp_path / "halt")), 3,
                            )
    assert rows_of(tmp_path / "halt") == rows_of(tmp_path / "full")
    assert resumed["final-accuracy"] == full["final-accuracy"]
    assert json.loads((tmp_path / "halt" / "config.json").read_text())["resumed-after-rounds"] == [1]
    from flowerbed.client_state import run_key

    run_id = json.loads((tmp_path / "halt" / "config.json").read_text())["run-id"]
    key = run_key(tmp_path / "halt", run_id)  # the name and the run's id, kept on resume
    assert key.startswith("halt-") and run_id != json.loads(
        (tmp_path / "full" / "config.json").read_text())["run-id"]
    for d in (tmp_path / "client-state" / key).glob("partition-*"):  # the newest state only
        assert sorted(f.name for f in d.iterdir() if f.name != "fedxds-release.pt") == [
            "round-2.attempt-1.pt"]  # filed by the resumed attempt
    if method in ("scaffold", "feddyn", "local", "ditto", "apfl", "fedsoft", "moon-unsup", "fedbyol",
                  "fedu", "fedmoco", "fedprotocl"):  # filed
        assert list((tmp_path / "client-state" / key).glob("partition-*"))
    if method == "cfl":  # split in round 1 (tests/methods.py): round 2 ran on restored clusters
        assert [r.get("cfl-clusters") for r in rows_of(tmp_path / "halt")][1:] == [2, 2]
    if method in PERSONAL_METHODS:  # their headline score is the personalised one (regression:
        last = read_metrics(tmp_path / "full")[-1]  # FedAvg-FT's was the global model's)
        assert full["final-accuracy"] == last["accuracy"] == last["client-accuracy"]


@pytest.mark.parametrize("method", ["scaffold", "local", "ditto", "apfl"])
def test_a_finished_run_extended_continues_its_clients_state(tmp_path, method):
    """Regression: a finished run's filed client state was deleted, so extending it with more
    rounds (run --resume -c num-server-rounds=N, compare --resume --rounds N) restarted every
    client's c_i / local model while the server kept its side."""
    run_inprocess(config(tmp_path, method, "full", **{"num-server-rounds": 3}), 3)  # names of
    # equal length: the run key travels in every message, and bytes are compared too
    run_inprocess(config(tmp_path, method, "more"), 3)
    run_inprocess(config(tmp_path, method, "more", resume=str(tmp_path / "more"),
                         **{"num-server-rounds": 3}), 3)
    full, more = (rows_of(tmp_path / n)[3] for n in ("full", "more"))
    assert differences({k: v for k, v in more.items() if k != "rounds"},
                       {k: v for k, v in full.items() if k != "rounds"}) == []


def mixed_faults_cover_every_kind(cfg: Config, clients: int) -> set[str]:
    return {faults.kind_of(cfg, p, r) for r in range(1, cfg.num_server_rounds + 1)
            for p in range(clients) if faults.chosen(cfg, p, r)}


# methods whose faults take another's path: its strategy's aggregation and reply checks (the same
# aggregate_train; test_fault_twins_share_the_server_path checks), and a client that differs only in
# its local loss or in state it keeps the same way (FedAvg + another local step; the SSL methods on
# SSLStrategy): each method costs the matrix 1-3 s
FAULT_TWINS = {"fedprox": "fedavg", "fedlc": "fedavg", "fedrs": "fedavg", "fedsam": "fedavg",
               "fedvls": "fedavg", "fedsimclr": "fedbyol", "fedu": "fedbyol", "fedmoco": "fedbyol",
               "fedprotocl": "fedbyol", "moon-unsup": "fedbyol", "fedct": "feddf"}


def test_a_hanging_client_answers_only_after_the_round_timeout(monkeypatch):
    """(The fault matrix's in-process grid leaves a hanging client out instead of waiting.)"""
    from flwr.app import ConfigRecord, Message, RecordDict

    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    cfg = Config.from_run_config({"fault-fraction": 1.0, "fault-kind": "hang", "round-timeout": 5.0})
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=1,
                  message_type="train")
    assert faults.inject(cfg, 0, msg, lambda: "the reply") == "the reply"
    assert slept == [6.0]


def test_fault_twins_share_the_server_path():
    for method, twin in FAULT_TWINS.items():
        assert METHODS[method].strategy.aggregate_train is METHODS[twin].strategy.aggregate_train, method
        assert METHODS[method].strategy.check_arrays is METHODS[twin].strategy.check_arrays, method
        assert twin not in FAULT_TWINS


@pytest.mark.parametrize("method", sorted(set(METHODS) - set(FAULT_TWINS)))
def test_every_fault_kind_for_every_method(tmp_path, method):
    """Clients that raise, send NaN, send wrong shapes, or never answer: the run goes on while
    enough clients answer, and metrics.jsonl counts and names the failures per round."""
    # seed 4, 4 clients, 2 rounds: two faults per round that cover all four kinds. LocalGrid leaves
    # out the reply of a client chosen to hang instead of waiting for it, so the timeout can be
    # far beyond a sound client's time on a loaded machine (the CI of e22ef52 saw ATLAS's sound
    # clients held past a 2 s timeout in both rounds: nothing aggregated)
    rc = config(tmp_path, method, "faults", **{"fault-fraction": 0.5, "seed": 4, "min-clients": 1,
                                               "fault-kind": "mixed", "round-timeout": 300.0})
    cfg = Config.from_run_config(rc)
    assert mixed_faults_cover_every_kind(cfg, 4) == set(faults.KINDS)  # the test's premise
    from inprocess import LocalGrid

    grid = LocalGrid(cfg.to_run_config(), 4)
    summary = server_app.run(grid, cfg)
    # the rounds wait round-timeout for replies (what lets a real hanging client not hold them)
    assert {t for kind, t in grid.timeouts if kind in ("train", "evaluate")} == {300.0}
    rows = read_metrics(tmp_path / "faults")[1:]
    reasons = " | ".join(f["reason"] for r in rows for f in r["failures"])
    chosen = {(r, p) for r in (1, 2) for p in range(4) if faults.chosen(cfg, p, r)}
    every = {(row["round"], f["partition"], f["phase"]): f["reason"] for row in rows for f in row["failures"]}
    assert set(every) == {(r, p, "train") for r, p in chosen}, reasons  # each fault counted, nothing else
    assert summary["client-failures-total"] == len(chosen), reasons
    assert all(r["clients-ok"] + len(r["failures"]) == r["clients-sampled"] for r in rows)
    needle = {"raise": "injected fault", "nan": "NaN", "shape": "shape", "hang": "no reply before timeout"}
    for r, p in chosen:  # each fault by its own reason
        kind = faults.kind_of(cfg, p, r)
        assert needle[kind] in every[r, p, "train"], (r, p, kind, reasons)


# ---------------------------------------------------------------------- hostile input


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from flwr.app import Array, ArrayRecord

    arrays = ArrayRecord({"w": Array(torch.ones(3).numpy())})
    checkpoint.save(tmp_path, 1, arrays, {"c": {"w": torch.zeros(3).numpy()}}, {"seed": 0})

    def dies_mid_write(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, arrays, {}, {"seed": 0})
    monkeypatch.undo()
    ck = checkpoint.load(tmp_path)  # the previous checkpoint is intact
    assert ck["round"] == 1 and (ck["strategy"]["c"]["w"] == 0).all()


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """Found by a review: a SIGKILL mid-write left `.checkpoint.pt.<pid>.tmp` (13 MB for the CNN;
    a FedXDS pool's up to 300 MB) beside the file for good. The next write of that file removes
    the temporary files of this host's writers that are no longer running, never a live one's
    or another host's (a shared folder), nor one changed in the last hour (from a review:
    containers with the host's name do not see each other's processes)."""
    import socket
    import subprocess
    import sys

    here = f".checkpoint.pt.{socket.gethostname()}."
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    left = [tmp_path / f"{here}{dead}.tmp", tmp_path / f"{here}{dead}.0a1b2c3d.tmp",  # (each write's own)
            tmp_path / f"{here}{os.getppid()}.tmp", tmp_path / f"{here}{os.getppid()}.a1b2c3d4.tmp",
            tmp_path / ".checkpoint.pt.other-host.1.tmp", tmp_path / f"{here}{dead}.fedcba98.tmp"]
    hour_ago = time.time() - 3700
    for f in left:
        f.write_bytes(b"half a checkpoint")
        if f != left[-1]:  # (the last: a dead writer's, but fresh)
            os.utime(f, (hour_ago, hour_ago))
    checkpoint.write_synced(tmp_path / "checkpoint.pt", {"round": 1})
    assert [f.exists() for f in left] == [False, False, True, True, True, True]
    umask = os.umask(0)
    os.umask(umask)  # a run's files are readable as the umask says (mkstemp's were 0600 only)
    assert (tmp_path / "checkpoint.pt").stat().st_mode & 0o777 == 0o666 & ~umask
    assert torch.load(tmp_path / "checkpoint.pt")["round"] == 1


def test_an_exclusive_write_never_replaces_a_file(tmp_path, monkeypatch):
    """FedXDS files a client's release only where none is: of two handlers of one partition that
    drew at once, exactly one release may leave (from a review: a check, then a rename, let the
    second replace the first after both were sent)."""
    target = tmp_path / "release.pt"
    checkpoint.write_synced(target, {"draw": 1}, exclusive=True)
    with pytest.raises(FileExistsError):
        checkpoint.write_synced(target, {"draw": 2}, exclusive=True)
    assert torch.load(target)["draw"] == 1 and [p.name for p in tmp_path.iterdir()] == ["release.pt"]
    checkpoint.write_synced(target, {"draw": 3})  # (the default replaces it)
    assert torch.load(target)["draw"] == 3

    def no_links(src, dst):  # a file system without hard links (some network and FUSE mounts)
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(FileExistsError):
        checkpoint.write_synced(target, {"draw": 4}, exclusive=True)
    checkpoint.write_synced(tmp_path / "other.pt", {"draw": 5}, exclusive=True)
    assert torch.load(tmp_path / "other.pt")["draw"] == 5 and torch.load(target)["draw"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "other.pt", "release.pt"]  # (the check and rename under a lock: its file stays)


def test_large_constant_state_is_written_once(tmp_path):
    """FedXDS's D_g (47 MB on Fashion-MNIST, about 300 MB on CIFAR) was written and fsynced
    with every round's checkpoint. Large records of the strategy's state now live in blob files,
    written when new and removed once no checkpoint names them."""
    from flwr.app import Array, ArrayRecord

    arrays = ArrayRecord({"w": Array(torch.ones(3).numpy())})
    pool = ArrayRecord({"x": Array(np.arange(2 ** 19, dtype=np.float32))})  # 2 MB
    blobs = tmp_path / checkpoint.BLOBS
    checkpoint.save(tmp_path, 1, arrays, {"pool": pool, "c": None}, {})
    (first,) = blobs.glob("*.pt")
    stamp = first.stat().st_mtime_ns
    (blobs / f".{first.name}.999.tmp").write_bytes(b"left by a crash")  # removed by the next save
    c = ArrayRecord({"c": Array(np.full(2 ** 19, 2.0, np.float32))})  # another large record
    checkpoint.save(tmp_path, 2, arrays, {"pool": pool, "c": c}, {})
    assert first.stat().st_mtime_ns == stamp and len(list(blobs.iterdir())) == 2  # not rewritten
    c = ArrayRecord({"c": Array(np.full(2 ** 19, 3.0, np.float32))})  # c changes: its old blob goes
    checkpoint.save(tmp_path, 3, arrays, {"pool": pool, "c": c}, {})
    assert len(list(blobs.glob("*.pt"))) == 2
    ck = checkpoint.load(tmp_path)
    assert (ck["strategy"]["pool"]["x"].numpy() == np.arange(2 ** 19)).all()
    assert (ck["strategy"]["c"]["c"].numpy() == 3.0).all()
    (blobs / first.name).unlink()  # a lost blob: the checkpoint names it
    with pytest.raises(checkpoint.CheckpointError, match=f"its blob .*{first.name} is missing"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize("damage, message", [
    ("truncate", "corrupt or truncated"), ("garbage", "corrupt or truncated"),
    ("not-ours", "not a flowerbed checkpoint"), ("missing", "does not exist")])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, damage, message):
    from flwr.app import Array, ArrayRecord

    path = checkpoint.save(tmp_path, 1, ArrayRecord({"w": Array(torch.ones(300).numpy())}), {}, {})
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 1000)
    elif damage == "not-ours":
        torch.save({"state_dict": {}}, path)
    else:
        path.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(tmp_path)


def test_checkpoint_cannot_run_code(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pwned')",))

    (tmp_path / checkpoint.FILE).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.load(tmp_path)


def test_resume_refuses_another_experiment_and_finished_runs(tmp_path):
    run_inprocess(config(tmp_path, "fedavg", "done"), 2)
    before = (tmp_path / "done" / "metrics.jsonl").read_text()
    with pytest.raises(checkpoint.CheckpointError, match="lr: 0.01 -> 0.1"):
        run_inprocess(config(tmp_path, "fedavg", "done", resume=str(tmp_path / "done"), lr=0.1),
                      2)
    with pytest.raises(checkpoint.CheckpointError, match="already finished 2 rounds; raise"):
        run_inprocess(config(tmp_path, "fedavg", "done", resume=str(tmp_path / "done")), 2)
    with pytest.raises(ConfigError, match="already holds a run"):  # no silent overwrite
        run_inprocess(config(tmp_path, "fedavg", "done"), 2)
    assert (tmp_path / "done" / "metrics.jsonl").read_text() == before  # nothing lost
    # extending a finished run is a resume with more rounds
    run_inprocess(config(tmp_path, "fedavg", "done", resume=str(tmp_path / "done"),
                         **{"num-server-rounds": 3}), 2)
    assert [r["round"] for r in read_metrics(tmp_path / "done")] == [0, 1, 2, 3]


def test_a_run_that_died_after_its_last_checkpoint_resumes_to_write_its_summary(tmp_path):
    """Regression: the last round's checkpoint is written before model.pt and summary.json; a
    run that died between them was refused ("already finished round 2 of 2") for good."""
    full = run_inprocess(config(tmp_path, "fedavg", "full"), 2)
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(config(tmp_path, "fedavg", "last", **{"fault-crash-after": 2}), 2)
    assert not (tmp_path / "last" / "summary.json").exists()
    done = run_inprocess(config(tmp_path, "fedavg", "last", resume=str(tmp_path / "last")), 2)
    assert done["final-accuracy"] == full["final-accuracy"] and done["rounds-aggregated"] == 2
    assert (tmp_path / "last" / "model.pt").exists()
    assert rows_of(tmp_path / "last") == rows_of(tmp_path / "full")


def test_an_extension_that_crashed_resumes_and_old_checkpoints_still_load(tmp_path):
    """Found by a review of this session's fixes: an extension that died kept the finished
    run's summary.json, so its resume was refused ("already finished round 3 of 3") and
    `compare --resume` kept the stale result; and a checkpoint written before a run-config key
    existed (fedxds-noise) could not be resumed at all."""
    from flowerbed import cli
    from flowerbed.compare import earlier_run

    rc = config(tmp_path, "fedavg", "ext")
    run_inprocess(rc, 2)
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess({**rc, "resume": str(tmp_path / "ext"), "num-server-rounds": 3,
                       "fault-crash-after": 3}, 2)
    assert not (tmp_path / "ext" / "summary.json").exists()  # set aside when the resume began
    assert (tmp_path / "ext" / "summary.before-resume-1.json").exists()
    more = {**rc, "num-server-rounds": 3}
    assert earlier_run(tmp_path / "ext", more, 2) == "resume"
    cli.check_run_dir({**more, "resume": str(tmp_path / "ext")})  # not refused up front
    path = tmp_path / "ext" / checkpoint.FILE
    raw = torch.load(path, weights_only=True)
    del raw["config"]["fedxds-noise"], raw["config"]["num-partitions"]  # as before those keys
    torch.save(raw, path)
    done = run_inprocess({**more, "resume": str(tmp_path / "ext")}, 2)
    assert done["rounds-aggregated"] == 3 and (tmp_path / "ext" / "summary.json").exists()
    path.write_bytes(b"\x00" * 100)  # damaged: that run fails in its ServerApp, not the compare
    (tmp_path / "ext" / "summary.json").unlink()
    assert earlier_run(tmp_path / "ext", more, 2) == "resume"


def test_resume_with_another_number_of_clients_is_refused(tmp_path):
    """The checkpoint records num-partitions: partitions of another split must not restore
    state trained on this one (only `flowerbed run --resume` checked it before)."""
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(config(tmp_path, "local", "three", **{"fault-crash-after": 1}), 3)
    with pytest.raises(checkpoint.CheckpointError, match="num-partitions: 3 -> 4"):
        run_inprocess(config(tmp_path, "local", "three", resume=str(tmp_path / "three")), 4)


def test_a_fresh_run_in_a_reused_folder_gets_its_own_client_state(tmp_path):
    """Regression: client state was keyed by the run folder's path, and `compare` moves an
    earlier run aside and starts the new one at the same path: a resumed new run restored the
    old run's filed state. The key is now a run id made at the start and kept on resume."""
    from flowerbed.results import RunDir

    first = RunDir(tmp_path, "r", {})
    (tmp_path / "r").rename(tmp_path / "r.old")
    second = RunDir(tmp_path, "r", {})
    assert first.run_id and second.run_id and first.run_id != second.run_id
    second.log_round({"round": 0, "seconds": 5.0})
    first.close(), second.close()  # their ServerApps ended
    resumed = RunDir(tmp_path, "r", {}, resume_round=0)
    assert resumed.run_id == second.run_id
    assert resumed.finish({})["wall-seconds"] >= 5.0  # the kept rounds' time counts too


def test_a_run_in_which_every_client_always_failed_is_not_a_result(tmp_path):
    """Regression: every round skipped still wrote a summary whose best accuracy was the
    untrained model's, and the launcher showed it as a result."""
    rc = config(tmp_path, "fedavg", "allfail", **{"fault-fraction": 1.0, "fault-kind": "raise"})
    with pytest.raises(server_app.NothingAggregated, match="every client failed in all 2 rounds"):
        run_inprocess(rc, 2)
    assert not (tmp_path / "allfail" / "summary.json").exists()
    assert len(read_metrics(tmp_path / "allfail")) == 3  # the rounds' metrics are kept
    # some replied, but never min-clients of them: said so, not "every client failed"
    rc = config(tmp_path, "fedavg", "few", **{"fault-fraction": 0.5, "fault-kind": "raise",
                                              "min-clients": 3, "num-server-rounds": 1})
    with pytest.raises(server_app.NothingAggregated, match=r"no round had min-clients=3 valid "
                                                          r"replies \(at most [12]\)"):
        run_inprocess(rc, 3)


@pytest.mark.parametrize("key, value, match", [
    ("lr", -1.0, "lr"), ("num-server-rounds", "three", "num-server-rounds"),
    ("fault-kind", "explode", "fault-kind"), ("fault-crash-after", -2, "fault-crash-after"),
    ("round-timeout", 0, "round-timeout")])
def test_bad_run_config_values_are_refused(key, value, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_run_config({key: value})


def test_oversized_and_malformed_replies_are_refused_not_fatal(tmp_path):
    """A reply with an extra, huge array (or wrong shapes) is rejected; the round goes on."""
    rc = config(tmp_path, "fedavg", "big", **{"fault-fraction": 0.4, "fault-kind": "shape"})
    s = run_inprocess(rc, 3)
    rows = read_metrics(tmp_path / "big")[1:]
    assert s["client-failures-total"] >= 1 and all(r["clients-ok"] >= 1 for r in rows)


def test_nodes_that_never_say_their_partition_are_a_clear_error(tmp_path):
    """Regression: on a loaded machine no deployed node answered the whoami message within its
    fixed 120 s, and the run died with "num-partitions = 0 is invalid: need at least one
    client". The wait is now round-timeout, and its end says what did not answer."""
    from inprocess import LocalGrid

    from flowerbed.apps import server_app
    from flowerbed.strategies.base import WHOAMI

    class SilentGrid(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if all(m.metadata.message_type == WHOAMI for m in messages):
                self.timeouts.append((WHOAMI, timeout))  # (LocalGrid's record of the calls)
                return []
            return super().send_and_receive(messages, timeout=timeout)

    cfg = Config.from_run_config(config(tmp_path, "fedavg", "silent", **{"round-timeout": 7.0}))
    grid = SilentGrid(cfg.to_run_config(), 2)
    with pytest.raises(TimeoutError, match=r"none of the 2 connected nodes said which partition "
                                           r"it serves \(the 'query.whoami' message\) within 7 s"):
        server_app.run(grid, cfg)
    assert grid.timeouts == [(WHOAMI, 7.0)]


def test_nodes_that_all_fail_whoami_name_their_error(tmp_path, monkeypatch):
    """An impossible split under plain `flwr run` (no launcher preflight): every node's whoami
    reply is an error, and the run used to end in a TimeoutError that blamed a loaded machine."""
    from inprocess import LocalGrid

    from flowerbed.apps import server_app
    from flowerbed.strategies.base import FlowerbedFedAvg

    discover = FlowerbedFedAvg.discover
    monkeypatch.setattr(FlowerbedFedAvg, "discover",  # no 60 s wait for more nodes
                        lambda self, grid, wait_all=0.0, timeout=120.0: discover(self, grid, 0.0, timeout))
    cfg = Config.from_run_config(config(tmp_path, "fedavg", "bad", partition="pathological:11"))
    with pytest.raises(server_app.ClientSetupError, match=r"none of the 2 connected nodes could "
                       r"serve a partition; they replied: .*'partition' = 'pathological:11'"):
        server_app.run(LocalGrid(cfg.to_run_config(), 2), cfg)


def test_a_node_with_another_copy_of_the_data_is_refused_before_round_1(tmp_path):
    """From a review: each node splits its own copy of the data set by the shared seed, so a node
    whose copy differed (other files, another order, a subset) trained on a partition that
    overlapped the others' or missed samples, and nothing said so. The same files at another
    path are fine."""
    from flowerbed.datasets.loading import DEBIAN_FASHION_MNIST, write_idx

    other = tmp_path / "data" / "other"  # (apart from the runs: a run named 'same' in a folder
    rng = np.random.default_rng(0)      # that links to the data set would write there)
    for prefix, n in (("train", 1000), ("t10k", 300)):
        write_idx(other / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(other / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    same = tmp_path / "data" / "same"
    same.symlink_to(DEBIAN_FASHION_MNIST)
    rc = config(tmp_path, "fedavg", "mixed", **{"num-server-rounds": 1})
    with pytest.raises(ConfigError, match=r"'data-root' = \"node 1001's\" is invalid: its copy of the "
                                          r"training set differs from the server's"):
        run_inprocess(rc, 2, node_extra=[{}, {"data-root": str(other)}])
    run_inprocess(config(tmp_path, "fedavg", "same", **{"num-server-rounds": 1}), 2,
                  node_extra=[{}, {"data-root": str(same)}])


def test_flwr_run_killed_then_resumed_through_the_real_engine(superlink, tmp_path, capsys):
    """The real path (simulation engine): `flwr run` whose ServerApp dies after round 1, then
    `resume=<run-dir>`, gives the metrics of an uninterrupted run. Clients fail too (an injected
    exception in 40 % of the client-rounds, the same in every run): the run goes on, counting
    each failure with Flower's reason (every kind x every method: in-process,
    test_every_fault_kind_for_every_method). The console shows each failure's tracebacks (about
    70 lines of Ray's and Flower's) as one line; the log keeps them.

    The uninterrupted run is in-process: it gives an uninterrupted `flwr run`'s metrics, failures
    and reasons included, to the last digit (compared on 2026-12-06, when this test still made
    that run through the engine too, a third Ray start: 18 s of CI)."""
    home, conn = superlink
    fed = engine.federation_config(num_supernodes=3, cpus_per_client=1)
    faults = {"fault-fraction": 0.4, "fault-kind": "raise"}
    rc = config(tmp_path, "scaffold", "halt", **faults, **{"fault-crash-after": 1})
    with pytest.raises(engine.RunFailed):
        engine.flwr_run(home, conn, rc, fed, log_file=tmp_path / "1.log", tee=True)
    console = capsys.readouterr().out
    assert "Traceback" not in console and ("[flowerbed.faults.SimulatedCrash: fault-crash-after=1"
                                           in console), console[-3000:]
    assert [r["round"] for r in read_metrics(tmp_path / "halt")] == [0, 1]
    rc.update({"fault-crash-after": 0, "resume": str(tmp_path / "halt")})
    engine.flwr_run(home, conn, rc, fed, log_file=tmp_path / "2.log", tee=True)
    console += capsys.readouterr().out
    assert "restored its state from round 1" in (tmp_path / "2.log").read_text()
    rows = read_metrics(tmp_path / "halt")[1:]
    assert len(rows) == 2 and all(r["clients-failed"] == 1 for r in rows)  # (seeded: one a round)
    assert all(r["clients-ok"] + r["clients-failed"] == 3 for r in rows)
    failed = [f for r in rows for f in r["failures"]]
    assert all(f["partition"] in (0, 1, 2) and f["reason"].startswith(  # Flower's reason, readable
        "the ClientApp raised (Flower error code 2): InjectedFault: injected fault: partition ")
        for f in failed), failed
    folded = [ln for ln in console.splitlines() if "[a ClientApp raised " in ln]
    assert "Traceback" not in console and len(folded) == len(failed), console[-3000:]
    assert all("flowerbed.faults.InjectedFault: injected fault: partition" in ln
               and "(at flowerbed/faults.py:" in ln for ln in folded)
    assert [str(tmp_path / f"{i}.log") in ln for i, ln in enumerate(folded, 1)] == [True, True]
    logs = (tmp_path / "1.log").read_text() + (tmp_path / "2.log").read_text()
    assert logs.count("Traceback (most recent call last)") >= len(failed)
    run_inprocess(config(tmp_path / "ref", "scaffold", "halt", **faults), 3)
    assert differences(rows_of(tmp_path / "halt"), rows_of(tmp_path / "ref" / "halt"), "rows") == []


def test_unexpected_or_oversized_arrays_are_refused():
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from flowerbed.strategies.base import FlowerbedFedAvg

    s = FlowerbedFedAvg(Config.from_run_config({}))
    sent = ArrayRecord({"w": Array(np.zeros((3, 3), np.float32))})
    s._reference = sent
    ok = RecordDict({"arrays": sent, "m": MetricRecord({"num-examples": 5})})
    assert s.check_arrays(ok) is None
    junk = RecordDict({**dict(ok.items()), "junk": ArrayRecord({"x": Array(np.zeros(10**6, np.float32))})})
    assert "unexpected ArrayRecords ['junk']" in s.check_arrays(junk)
    bigger = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros((3, 4), np.float32))})})
    assert "ArrayRecord 'arrays'" in s.check_arrays(bigger)


def test_cli_resume_reuses_the_runs_config(tmp_path, monkeypatch):
    """`flowerbed run --resume DIR`: the original run config and client count, resume set."""
    from flowerbed import cli

    run_inprocess(config(tmp_path, "scaffold", "r", lr=0.02, **{"num-server-rounds": 1}), 3)
    rc, n = cli.resume_overrides(str(tmp_path / "r"))
    assert n == 3 and rc["lr"] == 0.02 and rc["method"] == "scaffold"
    assert rc["resume"] == str(tmp_path / "r") and rc["run-name"] == "r"
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    for chosen, used, resumed in [("cpu", "cpu", "cpu"), (None, "cuda", "auto")]:
        # the server-device chosen is resumed; a run from before the key held the device used
        # there (a GPU run resumed on a machine without one was refused for it)
        (tmp_path / "r" / "config.json").write_text(json.dumps(
            {**saved, "server-device": chosen or used} if chosen else
            {**{k: v for k, v in saved.items() if k != "server-device-used"}, "server-device": used}))
        assert cli.resume_overrides(str(tmp_path / "r"))[0]["server-device"] == resumed
    with pytest.raises(ConfigError, match="no such folder"):
        cli.resume_overrides(str(tmp_path / "nothing-here"))
    (tmp_path / "r" / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="no readable config.json"):
        cli.resume_overrides(str(tmp_path / "r"))


@pytest.mark.parametrize("method,extra", [("fedavg", {}), ("fedfew", {"fedfew-eval": "local"})])
def test_single_sample_partition_is_not_a_failure(tmp_path, method, extra):
    """Regression: 100 clients on dirichlet:0.05 give some clients one sample and so no local
    test split; such a client used to reply a NaN loss and be counted as failed every round."""
    rc = config(tmp_path, method, "one", **{"partition": "iid", "train-samples": 5,
                                            "local-test-fraction": 0.2, "min-partition-size": 1,
                                            **extra})
    run_inprocess(rc, 3)
    rows = read_metrics(tmp_path / "one")[1:]
    assert [f for r in rows for f in r["failures"]] == []
    clients = rows[-1]["per-client"]  # iid: 2, 2 and 1 samples; 1 + 1, 1 + 1 and 1 + 0
    assert sorted(clients) == ["0", "1", "2"] and all(c["train-examples"] == 1 for c in clients.values())
    assert sorted(p for p, c in clients.items() if "evaluate-accuracy" in c) == ["0", "1"]
    assert np.isfinite(rows[-1]["client-accuracy"])


@pytest.mark.parametrize("method", ["fedcc", "feddf"])
def test_ensemble_without_local_test_splits(tmp_path, method):
    """Regression: with local-test-fraction=0 every distillation client replied a NaN local loss,
    so every evaluation reply was refused and the ensemble had no predictions to score."""
    run_inprocess(config(tmp_path, method, "nolocal", **{"local-test-fraction": 0.0}), 3)
    rows = read_metrics(tmp_path / "nolocal")[1:]
    assert [f for r in rows for f in r["failures"]] == []
    assert all(0 < r["accuracy"] <= 1 for r in rows)  # the ensemble of all three clients
    assert all(r["client-accuracy"] is None for r in rows)  # no local scores to report


def test_best_accuracy_is_over_trained_rounds(tmp_path, monkeypatch):
    """Round 0 (the initial model, for self-supervised methods the random-init probe) is the
    initial accuracy, never the best: a run that ends below it still reports its best round."""
    from flowerbed.strategies.base import FlowerbedFedAvg

    accs = {0: 0.9, 1: 0.5, 2: 0.6}
    monkeypatch.setattr(FlowerbedFedAvg, "evaluate_global",
                        lambda self, rnd, *a: (1.0, accs[rnd]))
    s = run_inprocess(config(tmp_path, "fedavg", "best"), 2)
    assert (s["initial-accuracy"], s["best-accuracy"], s["best-round"]) == (0.9, 0.6, 2)


def test_strategy_state_of_another_type_is_a_checkpoint_error():
    """A SCAFFOLD checkpoint without 'c' used to set it to None (AttributeError later); one
    whose 'c' is not a dict is a CheckpointError naming it."""
    from flowerbed.checkpoint import CheckpointError
    from flowerbed.strategies.scaffold import ScaffoldStrategy

    s = ScaffoldStrategy(Config.from_run_config({"method": "scaffold"}))
    s.restore_state({"accepted": None})  # older checkpoints: keep the fresh values
    assert s.c == {} and s.accepted == {}
    s.restore_state({"c": {"w": np.zeros(2, np.float32)}, "accepted": {"0": 3}})
    assert set(s.c) == {"w"} and s.accepted == {"0": 3}
    with pytest.raises(CheckpointError, match="state 'c' is a list, expected a dict"):
        s.restore_state({"c": [1, 2]})


def test_a_message_without_what_the_method_needs_names_it():
    """Flower's simulation keeps only an exception's text: a KeyError used to read 'proximal-mu'."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from flowerbed.apps.client_app import train
    from tests.conftest import sent

    cfg = Config.from_run_config({**TINY, "method": "fedprox"})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 2},
                  state=RecordDict(), run_config=cfg.to_run_config())
    with pytest.raises(ValueError, match=r"train message for method 'fedprox': 'arrays' is missing"):
        train(sent(3, RecordDict({"config": ConfigRecord({"server-round": 1})})), ctx)


# every way the server averages models: FedAvg's (which the SSL methods, FedXDS and FedAvg-FT
# share), FedRep's body merge (Fed-ADE's too), SCAFFOLD's, IFCA's per cluster, FedFew's own update,
# FedMR's unweighted pool mean, FedSoft's per centre, CFL's per cluster. FedDyn's, FedNova's,
# FedMGDA's and FedAMP's server updates are unit-tested on BatchNorm buffers instead
# (test_aggregation.py, test_fedfew.py)
BATCHNORM_METHODS = ["fedavg", "fedrep", "scaffold", "ifca", "fedfew", "fedmr", "fedsoft", "cfl"]


@pytest.mark.parametrize("method", BATCHNORM_METHODS)
def test_a_batchnorm_model_trains_in_every_round(tmp_path, method):
    """ResNets hold an int64 buffer (num_batches_tracked); Flower's average returns it float64,
    and next round every int64 reply was refused as the wrong dtype: rounds 2.. skipped."""
    rc = config(tmp_path, method, "bn", **{"model": "resnet8", "num-server-rounds": 3,
                                          "train-samples": 300, "test-samples": 100,
                                          "eval-every": 3, "probe-every": 3})
    run_inprocess(rc, 2)
    rows = read_metrics(tmp_path / "bn")[1:]
    assert [(r["clients-ok"], r["skipped"]) for r in rows] == [(2, False)] * 3, \
        [r["failures"] for r in rows]


def test_a_resnet_checkpoint_from_before_the_cast_resumes_and_trains(tmp_path):
    """Checkpoints written before cast_like hold num_batches_tracked as float64: a resume sent
    that, and every int64 reply was refused (every resumed round skipped)."""
    rc = config(tmp_path, "fedavg", "old", **{"model": "resnet8", "num-server-rounds": 3,
                                             "train-samples": 300, "test-samples": 100,
                                             "eval-every": 3, "fault-crash-after": 1})
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(rc, 2)
    ckpt = checkpoint.load(tmp_path / "old")
    arrays = ckpt["arrays"]
    old = {k: (v.numpy().astype(np.float64) if v.numpy().dtype == np.int64 else v.numpy())
           for k, v in arrays.items()}
    from flwr.app import Array, ArrayRecord
    checkpoint.save(tmp_path / "old", ckpt["round"], ArrayRecord({k: Array(v) for k, v in old.items()}),
                    ckpt["strategy"], ckpt["config"])
    run_inprocess({**rc, "fault-crash-after": 0, "resume": str(tmp_path / "old")}, 2)
    rows = read_metrics(tmp_path / "old")[1:]
    assert [(r["clients-ok"], r["skipped"]) for r in rows] == [(2, False)] * 3


def test_a_key_added_later_takes_the_value_of_the_key_that_served_for_it(tmp_path):
    """fedx-tau-local (τ_s) was fedx-tau-target's job: a checkpoint without it resumes only with
    the value the run trained with, not the default."""
    from flwr.app import Array, ArrayRecord

    cfg = Config.from_run_config({"method": "fedx", "fedx-tau-target": 0.2})
    identity = {**cfg.to_run_config(), "num-partitions": 2}
    saved = {k: v for k, v in identity.items() if k != "fedx-tau-local"}
    (tmp_path / "run").mkdir()
    checkpoint.save(tmp_path / "run", 1, ArrayRecord({"w": Array(np.zeros(1, np.float32))}), {}, saved)
    resume = cfg.replace(resume=str(tmp_path / "run"))
    with pytest.raises(checkpoint.CheckpointError, match="fedx-tau-local: 0.2 -> 0.1"):
        server_app._resume_point(resume, identity)
    fixed = {**identity, "fedx-tau-local": 0.2}
    assert server_app._resume_point(resume, fixed)[0]["round"] == 1


def test_bytes_per_client_count_the_clients_that_replied():
    """An error reply or a missing one uploads nothing; dividing by the clients sampled put
    FedAvg's upload at 0.7x a model with 30 % of the clients failing."""
    rows = [{"bytes-up": 700, "clients-sampled": 10, "clients-replied": 7},
            {"bytes-up": 1000, "clients-sampled": 10}]  # a row from before clients-replied
    assert server_app._per_client_round(rows, "bytes-up") == pytest.approx((100 + 100) / 2)


def test_local_writes_no_model_file(tmp_path):
    """Local has no server model: its model.pt was the untrained initial model."""
    run_inprocess(config(tmp_path, "local", "loc", **{"num-server-rounds": 1}), 2)
    assert (tmp_path / "loc" / "summary.json").exists() and not (tmp_path / "loc" / "model.pt").exists()
    run_inprocess(config(tmp_path, "fedrep", "rep", **{"num-server-rounds": 1}), 2)
    assert (tmp_path / "rep" / "model.pt").exists()


def test_finished_reason_is_the_one_test_of_a_finished_run(tmp_path):
    """The launcher, compare --resume and the ServerApp ask checkpoint.finished_reason: a run is
    finished when it wrote summary.json, for the rounds its config.json names."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"num-server-rounds": 3}))
    assert checkpoint.finished_rounds(run) is None  # stopped, or its extension crashed
    assert checkpoint.finished_reason(run, 3) is None
    assert "stopped after round 4" in checkpoint.finished_reason(run, 3, reached=4)
    (run / "summary.json").write_text("{}")
    assert checkpoint.finished_rounds(run) == 3
    assert "already finished 3 rounds" in checkpoint.finished_reason(run, 2)
    assert "already finished 3 rounds" in checkpoint.finished_reason(run, 3)
    assert checkpoint.finished_reason(run, 4) is None  # an extension


# ------------------------------------------------ found by a mutation review (session 37)


def test_mean_accuracy_leaves_out_round_0(tmp_path, monkeypatch):
    """C2: mean-accuracy averages the trained rounds, not the initial model's round 0."""
    from inprocess import run_inprocess

    from flowerbed.strategies.base import FlowerbedFedAvg

    accs = {0: 0.9, 1: 0.5, 2: 0.6}
    monkeypatch.setattr(FlowerbedFedAvg, "evaluate_global", lambda self, rnd, *a: (1.0, accs[rnd]))
    rc = {"num-server-rounds": 2, "train-samples": 600, "test-samples": 200, "min-clients": 2,
          "batch-size": 64, "method": "fedavg", "output-dir": str(tmp_path), "run-name": "m",
          "client-state-dir": str(tmp_path / "cs")}
    s = run_inprocess(rc, 2)
    assert s["mean-accuracy"] == pytest.approx(0.55)


def test_a_damaged_client_state_file_falls_back_to_the_round_before(tmp_path, caplog):
    """Two rounds are kept so that a file lost to a crash mid-write leaves the one before it;
    restore used to give up at the newest file (the client then started from nothing)."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path)})

    def ctx(state=None):
        return Context(run_id=1, node_id=1, node_config={}, state=state or RecordDict(), run_config={})

    for rnd in (1, 2):
        client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": rnd})})), "run-a", 0, rnd)
    assert not list(tmp_path.rglob("*.tmp"))
    (tmp_path / "run-a" / "partition-0" / "round-2.attempt-0.pt").write_bytes(b"PK\x03\x04 half a zip")
    resumed = ctx()
    assert client_state.restore(cfg.replace(resume="x"), resumed, "run-a", 0, 3) == 1
    assert resumed.state["c"]["round"] == 1 and "cannot read its state" in caplog.text


def test_a_state_the_client_dropped_is_not_restored_by_a_resume(tmp_path):
    """From a review: a client that dropped its whole state (a diverged personal model) filed
    nothing for that round, so a resume restored the round before's, the state it had dropped."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path)})

    def ctx(state=None):
        return Context(run_id=1, node_id=1, node_config={}, state=state or RecordDict(), run_config={})

    client_state.save(cfg, ctx(), "run-n", 0, 1)  # nothing ever filed: no folder
    assert not (tmp_path / "run-n").exists()
    client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": 1})})), "run-n", 0, 1)
    client_state.save(cfg, ctx(), "run-n", 0, 2)  # round 2: dropped
    resumed = ctx()
    assert client_state.restore(cfg.replace(resume="x"), resumed, "run-n", 0, 3) == 2
    assert "c" not in resumed.state.config_records


def test_state_filed_in_the_rounds_a_resume_repeats_is_never_restored_later(tmp_path):
    """From a review: a resume took the newest state from before its round but left the
    abandoned attempt's later files in place, so a second resume (the partition not sampled in
    between) restored state from a round the server had rolled back past. They are set aside
    now; their released.* records (an older FedXDS kept its release there) still come back."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path)})

    def ctx(state=None):
        return Context(run_id=1, node_id=1, node_config={}, state=state or RecordDict(), run_config={})

    released = ArrayRecord({"x": Array(np.ones(2, np.float32))})
    for rnd in (5, 6):  # filed in rounds 5 and 6; the server died in round 6
        client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": rnd}),
                                               "released.shared": released})), "run-a", 0, rnd)
    first = ctx()
    assert client_state.restore(cfg.replace(resume="x"), first, "run-a", 0, 6, resumed_after=[5]) == 5
    second = ctx()  # not sampled in rounds 6 and 7; the server died in round 8
    assert client_state.restore(cfg.replace(resume="x"), second, "run-a", 0, 8, resumed_after=[5, 7]) == 5
    assert second.state["c"]["round"] == 5 and "released.shared" in second.state.array_records
    assert (tmp_path / "run-a" / "partition-0" / "abandoned-round-6.attempt-0.pt").is_file()
    client_state.save(cfg, second, "run-a", 0, 8, 2)  # it trains on to the end
    stray = tmp_path / "run-a" / "partition-0.copy"  # not a partition's folder: left alone
    stray.mkdir()
    (stray / "round-1.pt").write_bytes(b"")
    (stray / "round-2.pt").write_bytes(b"")
    client_state.prune(cfg, "run-a", [5, 7])  # a finished run keeps its newest state only
    assert [p.name for p in (tmp_path / "run-a" / "partition-0").iterdir()] == ["round-8.attempt-2.pt"]
    assert sorted(p.name for p in stray.iterdir()) == ["round-1.pt", "round-2.pt"]


def test_a_client_restores_only_state_of_the_rounds_the_run_stands_on(tmp_path):
    """From a review: a client first asked after the repeated round of a resumed run (it was not
    sampled in that round) restored the crashed attempt's state from it. Messages of a resumed
    run name its resume points, files name their attempt, and a round's state counts only from
    the attempt that ran it last; a SuperNode restarted within an attempt keeps its state (the
    first fix, reverted, rolled it back to the checkpoint), also in a run never resumed and when
    its first message is the round's evaluation; released.* records come back from a set-aside
    file; files from before attempts still count."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path)})
    d = tmp_path / "run-a" / "partition-0"

    def ctx(state=None):
        return Context(run_id=1, node_id=1, node_config={}, state=state or RecordDict(), run_config={})

    def file(rnd, attempt, **extra):
        client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": rnd, "attempt": attempt}),
                                               **extra})), "run-a", 0, rnd, attempt)

    def restore(rnd, points, evaluating=False):
        c = ctx()
        got = client_state.restore(cfg.replace(resume="x" if points else ""), c, "run-a", 0, rnd,
                                   resumed_after=points, evaluating=evaluating)
        assert got is None or c.state["c"]["round"] == got
        return got, c.state["c"]["attempt"] if got else None, c.state.array_records.get("released.x")

    assert [client_state.attempt_of(r, [5, 5, 7]) for r in (5, 6, 7, 8)] == [0, 2, 2, 3]
    file(4, 0), file(5, 0)
    assert restore(6, [])[:2] == (5, 0)  # a fresh run's SuperNode restarted
    assert restore(5, [], evaluating=True)[:2] == (5, 0)  # restarted between training and evaluation
    released = ArrayRecord({"x": Array(np.ones(2, np.float32))})
    file(6, 0, **{"released.x": released})  # the server died in round 6 (checkpoint 5) after this
    # resumed after 5, this partition first asked in round 7: not the crashed attempt's round 6,
    # but what it sent out in round 6 comes back
    got = restore(7, [5])
    assert got[:2] == (5, 0) and got[2] is not None
    assert (d / "abandoned-round-6.attempt-0.pt").is_file()
    file(7, 1), file(8, 1)
    assert restore(9, [5])[:2] == (8, 1)  # restarted within the attempt
    file(9, 1)  # then the server died in round 9 again: resumed after 8, asked first in round 11
    assert restore(11, [5, 8])[:2] == (8, 1)
    assert (d / "abandoned-round-9.attempt-1.pt").is_file()
    client_state.prune(cfg, "run-a", [5, 8])  # the set-aside round 9 may hold what round 8 lacks
    assert sorted(p.name for p in d.iterdir()) == ["abandoned-round-9.attempt-1.pt", "round-8.attempt-1.pt"]
    file(10, 1)
    (d / "round-10.attempt-1.pt").rename(d / "round-10.pt")  # as flowerbed filed it before attempts
    assert restore(11, [5, 10])[:2] == (10, 1)  # an older run extended: its newest state counts


def test_rolled_back_state_is_never_kept_at_the_end_nor_from_before_attempts(tmp_path):
    """From a review of the attempts: (1) a partition asked in none of a resumed run's rounds kept
    the crashed attempt's file as its newest at the end of the run, and an extension then set it
    aside and started over; (2) a file from before attempts filed in the round the server died in
    was restored when the partition was first asked later; (3) a renamed run that crashed again
    in the same round found neither its old state nor its new (its state is now copied to the
    new name, and the old folder left to a copied run's original)."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path), "resume": "x"})

    def ctx(state=None):
        return Context(run_id=1, node_id=1, node_config={}, state=state or RecordDict(), run_config={})

    def file(key, rnd, attempt):
        client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": rnd})})), key, 0, rnd, attempt)

    file("r-1111111111", 3, 0), file("r-1111111111", 4, 0)  # the server died in round 4
    client_state.prune(cfg, "r-1111111111", [3])  # resumed after 3, never asked again, finished
    c = ctx()
    assert client_state.restore(cfg, c, "r-1111111111", 0, 11, resumed_after=[3, 10]) == 3  # (1)
    d = tmp_path / "r-2222222222" / "partition-0"
    file("r-2222222222", 4, 0)
    (d / "round-4.attempt-0.pt").rename(d / "round-4.pt")  # as flowerbed filed them before attempts
    file("r-2222222222", 5, 0)
    (d / "round-5.attempt-0.pt").rename(d / "round-5.pt")  # the server died in round 5
    assert client_state.restore(cfg, ctx(), "r-2222222222", 0, 7, resumed_after=[4]) == 4  # (2)
    file("r-3333333333", 4, 0)  # then the run's folder is renamed, and it resumes after 4
    assert client_state.restore(cfg, ctx(), "moved-3333333333", 0, 5, resumed_after=[4]) == 4
    file("moved-3333333333", 5, 1)  # the server died in round 5 again
    assert client_state.restore(cfg, ctx(), "moved-3333333333", 0, 5, resumed_after=[4, 4]) == 4  # (3)
    # copied, not moved: a run folder copied with `cp -r` has the same run id, and the copy's
    # resume took the original's state away from it (a third review)
    assert client_state.restore(cfg, ctx(), "r-3333333333", 0, 5, resumed_after=[4]) == 4


@pytest.mark.parametrize("method", ["scaffold", "ditto", "fedbyol"])
def test_a_restarted_supernode_continues_from_its_filed_state(tmp_path, method):
    """A SuperNode keeps its clients' context.state in memory: one restarted mid-run came back
    with none, so in a run never resumed its client started over (SCAFFOLD's c_i at zero, Ditto's
    personal model and BYOL's target network new) while the server went on. Its first message
    now restores the state it filed: the run's metrics equal an uninterrupted run's."""
    from flwr.app import Context, RecordDict
    from inprocess import LocalGrid

    class Restarting(LocalGrid):  # node 1000 (partition 0) restarts after round 1
        restarted = False

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if not self.restarted and any(m.content["config"].get("server-round") == 2 for m in messages
                                          if "config" in m.content.config_records):
                old = self.contexts[1000]
                self.contexts[1000] = Context(run_id=1, node_id=1000, node_config=old.node_config,
                                              state=RecordDict(), run_config=old.run_config)
                self.restarted = True
            return super().send_and_receive(messages, timeout=timeout)

    rc = config(tmp_path, method, "full", **{"num-server-rounds": 3})
    run_inprocess(rc, 3)
    cfg = Config.from_run_config({**rc, "run-name": "rest"})
    grid = Restarting(cfg.to_run_config(), 3)
    server_app.run(grid, cfg)
    assert grid.restarted
    assert differences(rows_of(tmp_path / "rest"), rows_of(tmp_path / "full")) == []


def test_bookkeeping_keys_are_not_counted_as_the_methods_bytes():
    from flwr.app import ConfigRecord, RecordDict

    from flowerbed.strategies.base import record_bytes

    bare = RecordDict({"config": ConfigRecord({"server-round": 3})})
    kept = RecordDict({"config": ConfigRecord({"server-round": 3, "run-key": "a-0123456789",
                                               "resumed-after": [2, 5]})})
    assert record_bytes(bare) == record_bytes(kept) > 0


def test_a_renamed_run_still_finds_its_clients_state(tmp_path):
    """Found by a review: the key is the folder's name plus the run id, so a run folder renamed
    (or moved aside by compare and resumed there) found none of its clients' state, and SCAFFOLD's
    c_i silently started again from zero. Restore now also looks for the run id under another
    name; another run's state (another id) is never taken. The files kept beside the partitions'
    folders (FedXDS's D_g) come along: without them a FedXDS client sat out a round."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path)})

    def ctx(state=None):
        return Context(run_id=1, node_id=1, node_config={}, state=state or RecordDict(), run_config={})

    client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": 2})})), "r-0123abcdef", 0, 2)
    client_state.save(cfg, ctx(RecordDict({"c": ConfigRecord({"round": 9})})), "r-ffffffffff", 0, 2)
    (tmp_path / "r-0123abcdef" / "fedxds-pool-d1.pt").write_bytes(b"D_g")
    (tmp_path / "r-0123abcdef" / "partition-0" / ".round-3.pt.host.1.ab12cd34.tmp").write_bytes(b"half")
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    killed = tmp_path / "moved-0123abcdef" / f".partition-0.{socket.gethostname()}.{dead}.0a1b2c3d.copy"
    killed.mkdir(parents=True)  # a copy killed mid-way (as large as the folder): removed
    os.utime(killed, (time.time() - 3700, time.time() - 3700))
    resumed = ctx()
    assert client_state.restore(cfg.replace(resume="x"), resumed, "moved-0123abcdef", 0, 3) == 2
    assert resumed.state["c"]["round"] == 2
    assert not killed.exists()
    assert [p.name for p in (tmp_path / "moved-0123abcdef" / "partition-0").iterdir()] == [
        "round-2.attempt-0.pt"]  # another writer's work in progress is not copied
    assert sorted(p.name for p in (tmp_path / "moved-0123abcdef").iterdir()) == ["fedxds-pool-d1.pt",
                                                                                "partition-0"]
    assert (tmp_path / "moved-0123abcdef" / "fedxds-pool-d1.pt").read_bytes() == b"D_g"
    assert client_state.restore(cfg.replace(resume="x"), ctx(), "moved-0000000000", 0, 3) is None


def test_a_resumed_stateless_client_says_nothing_of_state(tmp_path, caplog):
    """A README walk-through: resuming FedFew (no client state) logged 'no filed state' per client."""
    from flwr.app import Context, RecordDict

    from flowerbed import client_state

    cfg = Config.from_run_config({"client-state-dir": str(tmp_path), "resume": "x"})
    for keeps in (False, True):
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        caplog.clear()
        assert client_state.restore(cfg, ctx, "r-0123abcdef", 0, 3, keeps_state=keeps) is None
        assert ("no filed state" in caplog.text) is keeps
    from flowerbed.clients import fedfew, fedx, scaffold

    assert scaffold.ScaffoldClient.keeps_state and fedx.FedXBYOLClient.keeps_state
    assert not fedx.FedXSimCLRClient.keeps_state and not fedfew.FedFewClient.keeps_state


def test_a_fed_ade_run_is_not_extended_with_more_rounds(tmp_path):
    """Fed-ADE's streams are built for its number of rounds (lin over 2 steps is w = 0, 1; over
    4 it is 0, 1/3, 2/3, 1): an extended run mixed the kept steps of one stream with another."""
    for method in ("fedpoe", "fedade"):  # (Fed-POE runs on Fed-ADE's streams)
        old = {"method": method, "num-server-rounds": 4, "resume": ""}
        with pytest.raises(checkpoint.CheckpointError,
                           match="num-server-rounds: 4 -> 8.*Fed-ADE, Fed-POE or ATLAS run's streams"):
            checkpoint.check_compatible(old, {**old, "num-server-rounds": 8}, tmp_path)
    assert checkpoint.config_changes(old, {**old, "num-server-rounds": 8}) == ["num-server-rounds: 4 -> 8"]
    checkpoint.check_compatible(old, {**old, "resume": "x"}, tmp_path)  # resuming it is fine
    other = {**old, "method": "fedavg"}
    assert checkpoint.config_changes(other, {**other, "num-server-rounds": 8}) == []
    # compare --resume --rounds 8 says why, and what to do (a README walk-through)
    from flowerbed.compare import earlier_run

    rc = {"method": "fedade", "num-server-rounds": 4}
    (tmp_path / "config.json").write_text(json.dumps(
        {**Config.from_run_config(rc).to_run_config(), "num-partitions": 3}))
    (tmp_path / "summary.json").write_text("{}")
    assert earlier_run(tmp_path, rc, 3) == "keep"
    with pytest.raises(ConfigError, match="a Fed-ADE, Fed-POE or ATLAS run cannot be extended "
                                          ".* another --out"):
        earlier_run(tmp_path, {**rc, "num-server-rounds": 8}, 3)
    # run --resume of it: not "raise num-server-rounds", which the resume then refuses
    assert "a Fed-ADE, Fed-POE or ATLAS run cannot be extended" in checkpoint.finished_reason(tmp_path, 4)


def test_a_diverged_run_reports_no_accuracy_and_keeps_its_model(tmp_path, monkeypatch, caplog):
    """From an audit: a model with NaN outputs scored the share of class 0 (argmax of NaN), and
    a NaN aggregate was taken as the next model. Now the NaN model has no accuracy (nor does
    the summary: not an earlier round's), and a NaN aggregate is refused, the model kept."""
    rows = lambda name: read_metrics(tmp_path / name)  # noqa: E731
    summary = run_inprocess(config(tmp_path, "scaffold", "big-step", **{"scaffold-server-lr": 1e29}), 3)
    assert rows("big-step")[1]["nan-outputs"] and rows("big-step")[1]["accuracy"] is None
    assert summary["final-accuracy"] is None and summary["best-accuracy"] is None
    from flowerbed.strategies import fedfew

    k, calls, weights = 2, [], fedfew.fedfew_weights

    def nan_in_round_1(losses, n, mu):
        calls.append(1)
        return (np.full((len(n), k), np.nan), np.full(len(n), 1 / len(n))) if len(calls) == 1 \
            else weights(losses, n, mu)

    monkeypatch.setattr(fedfew, "fedfew_weights", nan_in_round_1)
    summary = run_inprocess(config(tmp_path, "fedfew", "nan-once", **{"num-models": k,
                                                                      "num-server-rounds": 3}), 3)
    one = rows("nan-once")[1]
    assert one["diverged"] and one["skipped"] and not one["nan-outputs"] and one["accuracy"] is not None
    assert summary["rounds-aggregated"] == 2 and summary["final-accuracy"] == rows("nan-once")[3]["accuracy"]
    assert "1 aggregate(s) held NaN or inf ('diverged')" in caplog.text
    monkeypatch.setattr(fedfew, "fedfew_weights", lambda losses, n, mu: (
        np.full((len(n), k), np.nan), np.full(len(n), 1 / len(n))))
    with pytest.raises(server_app.NothingAggregated, match="held NaN or inf in 2 of 2 rounds"):
        run_inprocess(config(tmp_path, "fedfew", "nan-weights", **{"num-models": k}), 3)
    assert [r.get("diverged") for r in rows("nan-weights")] == [None, True, True]


def test_the_launchers_check_of_an_older_run_knows_which_key_a_new_one_took_over():
    """From a review: compare --resume kept a finished FedX run from before fedx-tau-local as if
    it had run with the current value; the ServerApp would have refused it."""
    old = {"method": "fedx", "fedx-tau-target": 0.2, "num-server-rounds": 4}
    assert checkpoint.config_changes(old, {**old, "fedx-tau-local": 0.1}) == ["fedx-tau-local: 0.2 -> 0.1"]
    assert checkpoint.config_changes(old, {**old, "fedx-tau-local": 0.2, "public-fraction": 0.0}) == []


def test_the_launcher_resumes_an_older_run_as_it_ran(tmp_path):
    """A run from before fedx-tau-local: `flowerbed run --resume` takes the value of the key that
    served for it (the ServerApp refused the default); a key added since without such a
    predecessor (ssl-augment) takes its default, as the ServerApp fills it."""
    from flowerbed import cli

    for method, extra in (("fedx", {"fedx-tau-target": 0.2}), ("fedavg", {})):
        run = tmp_path / method
        run.mkdir()
        old = {k: v for k, v in {**defaults(), "method": method, **extra}.items()
               if k not in ("fedx-tau-local", "ssl-augment")}
        (run / "config.json").write_text(json.dumps({**old, "num-partitions": 3}))
        rc, n = cli.resume_overrides(str(run))
        assert n == 3 and rc["resume"] == str(run.resolve())
        assert rc["ssl-augment"] == defaults()["ssl-augment"]
        if method == "fedx":
            assert rc["fedx-tau-local"] == 0.2
        saved = checkpoint.with_added_keys(old, Config.from_run_config(rc).to_run_config())
        assert not checkpoint.config_changes(saved, Config.from_run_config(rc).to_run_config())
