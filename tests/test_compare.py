"""The launcher's own logic: which run config a comparison gets, and the mean over seeds
(engine calls replaced by a fake that writes a run directory; the real engine runs in test_e2e)."""

import contextlib
import json
import shutil
from pathlib import Path

import pytest

from flowerbed import cli, engine, run_table
from flowerbed import compare as cmp
from flowerbed.config import Config, ConfigError

PRESET = "presets/fedx-cpu.toml"


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """The launcher without processes: no SuperLink, and ``fake_engine(run)`` puts ``run`` in
    place of ``engine.flwr_run``."""
    @contextlib.contextmanager
    def no_superlink(*a, **k):
        yield tmp_path, "c"

    monkeypatch.setattr(cmp.engine, "local_superlink", no_superlink)
    return lambda run: monkeypatch.setattr(cmp.engine, "flwr_run", run)


def overrides(*argv: str) -> dict:
    return cli.compare_overrides(cli.build_parser().parse_args(["compare", "--methods", "fedx", *argv]))


def test_a_comma_inside_quotes_belongs_to_the_variant_and_presets_layer(tmp_path):
    """From a CLI review: --methods was cut at every comma, and a second --preset replaced the
    first without a word."""
    assert cmp.split_methods("fedavg, fedprotocl@protocl-clusters='2,3',fedx") == [
        "fedavg", "fedprotocl@protocl-clusters='2,3'", "fedx"]
    assert cmp.parse_variant("fedprotocl@protocl-clusters='2,3'")[1]["protocl-clusters"] == "2,3"
    (tmp_path / "a.toml").write_text("lr = 0.5\nseed = 3\n")
    (tmp_path / "b.toml").write_text("lr = 0.1\n")
    rc = overrides("--preset", str(tmp_path / "a.toml"), "--preset", str(tmp_path / "b.toml"))
    assert (rc["lr"], rc["seed"]) == (0.1, 3)


def test_a_relative_data_root_means_the_launchers_folder(tmp_path, monkeypatch):
    """From a review: the launcher checked ./fm-subset, the engines' processes (in the project
    folder) read another, or fell back to the full data set. A relative client-state-dir stays
    as given: on a SuperNode elsewhere it is that node's own folder (a later review)."""
    monkeypatch.chdir(tmp_path)
    rc = overrides("-c", "data-root='fm-subset' client-state-dir='s'")
    assert rc["data-root"] == str(tmp_path / "fm-subset") and rc["client-state-dir"] == "s"
    assert "data-root" not in overrides()


def test_preset_and_run_config_are_not_overridden_by_the_flags_defaults():
    """Regression: --rounds/--partition/--seed defaults (20, dirichlet:0.5, 0) used to replace
    the preset's and -c's values, so `compare --preset presets/fedx-cpu.toml` ran 20 rounds."""
    rc = overrides("--preset", PRESET, "-c", "seed=3 partition='dirichlet:0.1'")
    assert (rc["num-server-rounds"], rc["partition"], rc["seed"]) == (10, "dirichlet:0.1", 3)
    rc = overrides("--preset", PRESET, "--rounds", "4", "--seed", "5", "--partition", "iid")
    assert (rc["num-server-rounds"], rc["partition"], rc["seed"]) == (4, "iid", 5)
    rc = overrides()  # nothing given: the launcher's defaults
    assert (rc["num-server-rounds"], rc["partition"], rc["seed"]) == (20, "dirichlet:0.5", 0)


def test_run_and_deploy_take_the_compare_shortcuts(tmp_path, monkeypatch, capsys):
    """A README walk-through: `flowerbed run --method fedfew --rounds 1` was refused as
    unrecognized arguments, though `compare` takes --rounds/--partition/--seed. They win over the
    preset and -c, and extend a resumed run."""
    seen = []

    def stop(overrides, *a, **k):
        seen.append(overrides)
        raise ConfigError("stop", 0, "here")

    monkeypatch.setattr(cli, "preflight", stop)
    assert cli.main(["run", "--preset", PRESET, "-c", "seed=3 lr=0.05 dataset='mnist'", "--method",
                     "fedsimclr", "--partition", "iid", "--rounds", "4", "--seed", "7", "--dataset",
                     "cifar10"]) == 2
    rc = seen[-1]
    assert (rc["method"], rc["partition"], rc["num-server-rounds"], rc["seed"], rc["lr"], rc["dataset"]) == (
        "fedsimclr", "iid", 4, 7, 0.05, "cifar10")
    assert cli.main(["run", "--preset", PRESET]) == 2 and seen[-1]["num-server-rounds"] == 10
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "fedavg", "num-partitions": 3,
                                                 "num-server-rounds": 2}))
    assert cli.main(["run", "--resume", str(run), "--rounds", "5"]) == 2
    assert seen[-1]["num-server-rounds"] == 5 and seen[-1]["resume"] == str(run.resolve())
    assert cli.main(["run", "--resume", str(run), "--method", "fedprox"]) == 2
    assert "keeps its config; this changes method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "--rounds", "0"])
    assert "'0' is not an integer >= 1" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["deploy", "run", "--method", "fedx", "--seed", "2"])
    assert cli._with_shortcuts({"seed": 0}, args) == {"method": "fedx", "seed": 2}
    args = cli.build_parser().parse_args(["compare", "--methods", "fedavg", "--dataset", "svhn"])
    assert cli.compare_overrides(args)["dataset"] == "svhn"  # (a data set ran only through -c)
    monkeypatch.undo()  # the real preflight names a data set it does not know
    assert cli.main(["run", "--dataset", "cifar11"]) == 2
    assert "'dataset' = 'cifar11' is invalid: known data sets" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0,x", "1,1", ","])
def test_bad_seeds_are_refused_naming_the_flag(bad, capsys):
    with pytest.raises(ConfigError, match="--seeds"):
        cli._seeds(bad)
    assert cli.main(["compare", "--methods", "fedavg", "--seed", "1", "--seeds", "0,1"]) == 2
    assert "either --seed or --seeds" in capsys.readouterr().err


def test_compare_seeds_runs_every_seed_and_averages(tmp_path, fake_engine):
    finals = {("fedavg", 0): 0.80, ("fedavg", 1): 0.84, ("fedprox", 0): 0.70}
    seen = []

    def fake_run(home, conn, rc, fed, **kw):
        seen.append((rc["run-name"], rc["seed"]))
        if (rc["run-name"], rc["seed"]) == ("fedprox", 1):
            raise cmp.engine.RunFailed("the ServerApp failed")
        acc = finals[rc["run-name"], rc["seed"]]
        run = tmp_path / f"seed-{rc['seed']}" / rc["run-name"]
        run.mkdir(parents=True, exist_ok=True)  # as the ServerApp: compare made it
        rows = [{"round": 0, "accuracy": 0.1}, {"round": 1, "accuracy": acc}]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        summary = {"final-accuracy": acc, "best-accuracy": acc, "initial-accuracy": 0.1}
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "config.json").write_text(json.dumps(Config.from_run_config(rc).to_run_config()))
        return summary

    fake_engine(fake_run)
    table = cmp.compare_seeds(["fedavg", "fedprox"], {"num-server-rounds": 1}, [0, 1], 2,
                              out=tmp_path)
    assert seen == [("fedavg", 0), ("fedprox", 0), ("fedavg", 1), ("fedprox", 1)]  # seed-major
    res = json.loads((tmp_path / "results.json").read_text())
    fedavg = res["summary"]["fedavg"]
    assert fedavg["final-accuracy-mean"] == pytest.approx(0.82)
    assert fedavg["final-accuracy-std"] == pytest.approx(0.04 / 2 ** 0.5)
    assert res["summary"]["fedprox"]["seeds-failed"] == [1]  # left out of its mean, not lost
    assert res["summary"]["fedprox"]["final-accuracy-mean"] == pytest.approx(0.70)
    # initial acc: round 0 (for a self-supervised method the random-init probe, its floor)
    assert "| method | initial acc % | final acc % | per seed |" in table and "their floor" in table
    assert "| fedavg | 10.00 ± 0.00 | 82.00 ± 2.83 | 80.00 (s0), 84.00 (s1) | 82.00 ± 2.83 | 0 | - |" in table
    assert "| fedprox | 10.00 | 70.00 | 70.00 (s0) | 70.00 | 0 | seed 1 |" in table
    assert "Failed: fedprox (seed 1): the ServerApp failed" in table  # the reason, not only "seed 1"
    assert "| fedavg | 10.00 | 84.00 |" in (tmp_path / "seed-1" / "table.md").read_text()
    assert (tmp_path / "table.md").read_text().strip() == table
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    assert (tmp_path / "seed-1" / "table.md").exists()  # every seed keeps its own comparison
    (tmp_path / "seed-0" / "results.json").unlink()  # --resume: finished runs are kept
    assert cmp.compare_seeds(["fedavg", "fedprox"], {"num-server-rounds": 1}, [0, 1], 2,
                             out=tmp_path, resume=True) == table
    assert seen[4:] == [("fedprox", 1)]  # only the failed run ran again
    with pytest.raises(ConfigError, match="differs in lr: 0.01 -> 0.5"):  # another config:
        cmp.compare_seeds(["fedavg"], {"num-server-rounds": 1, "lr": 0.5}, [0, 1], 2,
                          out=tmp_path, resume=True)  # refused before anything runs
    assert len(seen) == 5
    curve = cmp.mean_curve([[{"round": 1, "accuracy": 0.8}], [{"round": 1, "accuracy": 0.84}]])
    assert curve == [{"round": 1, "accuracy": pytest.approx(0.82),  # the std: the plot's band
                      "accuracy-std": pytest.approx(0.04 / 2 ** 0.5)}]
    curve = cmp.mean_curve([[{"round": 0, "accuracy": 0.1}, {"round": 1, "client-accuracy": 0.5}],
                            [{"round": 0, "accuracy": 0.3},
                             {"round": 1, "accuracy": 0.8, "client-accuracy": 0.7}],
                            [{"round": 0}]])
    sd = pytest.approx(0.2 / 2 ** 0.5)
    assert curve == [{"round": 0, "accuracy": pytest.approx(0.2), "accuracy-std": sd},
                     {"round": 1, "client-accuracy": pytest.approx(0.6),  # each key over the runs
                      "client-accuracy-std": sd}]  # that have it; not one seed's accuracy


def test_a_seed_that_stops_reporting_ends_the_mean_curve_where_it_stops(tmp_path, monkeypatch):
    """From a review: the mean over seeds jumped to the other seeds' level where one diverged."""
    drawn = {}
    monkeypatch.setattr(cmp, "plot_comparison", lambda curves, *a: drawn.update(curves))
    monkeypatch.setattr(cmp, "seeds_table", lambda *a: "table")
    full = [{"round": r, "accuracy": 0.5 + r / 100} for r in range(5)]
    cut = [{"round": r, "accuracy": 0.1 + r / 100} for r in range(3)] + [{"round": 3}, {"round": 4}]
    summary = {"fedavg": {"seeds-ok": [0, 1]}}
    cmp.write_seed_tables(tmp_path, summary, {}, {"fedavg": [full, cut]}, {}, 2, [0, 1])
    (label, rows), = drawn.items()
    assert label == "fedavg (to round 2: a seed has no figure after it)"
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[-1]["accuracy"] == pytest.approx(0.32)


def test_comparison_plots_name_failed_runs_and_add_client_accuracy(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(cmp, "plot_curves", lambda curves, out, **kw: drawn.append(
        (sorted(curves), out.name, kw.get("key", "accuracy"), kw.get("note"))))
    rows = [{"round": 1, "accuracy": 0.5}]
    cmp.plot_comparison({"fedavg": rows}, tmp_path, "t", ["fedprox"])
    assert drawn == [(["fedavg"], "accuracy.png", "accuracy", "failed, not drawn: fedprox")]
    cmp.plot_comparison({"fedavg": [{**rows[0], "client-accuracy": 0.6}]}, tmp_path, "t", [])
    assert drawn[-1] == (["fedavg"], "client-accuracy.png", "client-accuracy", "")


def test_seed_tables_show_a_streams_mean_accuracy_failures_and_skipped_rounds():
    """Found by a review: a Fed-ADE comparison tabled only the last step's accuracy (its result
    is the mean over time steps), and the seed table dropped failures and skipped rounds."""
    def run(final, mean, pre, aggregated=4, failures=0):
        return {"method": "fedade", "final-accuracy": final, "best-accuracy": final,
                "mean-accuracy": mean, "mean-pre-accuracy": pre, "rounds": 4,
                "rounds-aggregated": aggregated, "client-failures-total": failures}

    summary = {"fedade": cmp.seed_stats({0: run(0.56, 0.60, 0.58), 1: run(0.58, 0.62, 0.60)}),
               "fedade@lr=0.1": cmp.seed_stats({0: run(0.56, 0.50, 0.49, 3, 2), 1: run(0.56, 0.52, 0.51)})}
    table = cmp.seeds_table(summary, {"num-server-rounds": 4, "train-samples": 600}, 3, [0, 1])
    assert "| method | mean online acc % | mean pre-update acc % | final acc % |" in table
    assert "| fedade | 61.00 ± 1.41 | 59.00 ± 1.41 | 57.00 ± 1.41 |" in table
    assert "| 2 | - |" in table.splitlines()[5]  # fedade@lr=0.1: 2 failures over its seeds
    assert "Rounds skipped" in table and "fedade@lr=0.1 (seed 0) (1 of 4)" in table
    assert "train-samples 600" in table and cmp.STREAM_NOTE in table
    one = cmp.markdown_table({"fedade": run(0.56, 0.60, 0.58), "fedavg": {"final-accuracy": 0.7}},
                             {"num-server-rounds": 4}, 3)
    assert "| fedade | 60.00 | 58.00 | 56.00 |" in one and "| fedavg | - | - | 70.00 |" in one
    # a seed that ran but whose model diverged (final accuracy None) is not quietly dropped from
    # the mean (from a review: 81.00 ± 1.41 read as the mean of every seed)
    diverged = {"fedade": cmp.seed_stats({0: run(0.80, 0.6, 0.6), 1: run(0.82, 0.6, 0.6),
                                          2: run(None, 0.6, 0.6)})}
    table = cmp.seeds_table(diverged, {"num-server-rounds": 4}, 3, [0, 1, 2])
    assert "| 81.00 ± 1.41 (2 of 3 seeds) | 80.00 (s0), 82.00 (s1), - (s2) |" in table
    # a final figure from a round before the last says which (from a review)
    late = {"final-accuracy": 0.7, "final-round": 3, "final-client-accuracy": 0.72,
            "final-client-round": 1, "rounds": 4}
    assert "| 70.00 (round 3) | 72.00 (round 1) |" in cmp.markdown_table({"fedavg": late}, {}, 3)
    assert "| 70.00 | 72.00 |" in cmp.markdown_table({"fedavg": {**late, "final-round": 4,
                                                                   "final-client-round": 4}}, {}, 3)


@pytest.mark.parametrize("argv,said", [
    (["run", "-c", "partition=dirichlet:0.1"], "strings need quotes"),
    (["run", "--preset", "presets/no-such.toml"], "'--preset' = 'presets/no-such.toml' is invalid: no such"),
    (["compare", "--methods", "fedavg@lr=x"], "'--methods' = 'lr=x'"),
    (["compare", "--methods", "fedx@fedx-base=byol"], "unless the whole argument is quoted"),
    (["compare", "--methods", "fedavg", "--resume"], "needs --out"),
    # flwr's parser skips text that is not key=value; it used to run with the defaults
    (["run", "-c", "lr = 0.05"], "'lr = 0.05' is not a key=value pair"),
    (["run", "-c", "lr=0.05 momentum"], "'momentum' is not a key=value pair"),
    (["compare", "--methods", "fedprox@proximal-mu 0.1"], "'proximal-mu 0.1' is not a key=value"),
    (["run", "--preset", "presets/fedx-cpu"], "'presets/fedx-cpu' is invalid: no such file"),
    (["run", "--preset", "README.md"], "a preset is a TOML file"),
    (["compare", "--methods", "fedavg,fedprox,fedavg"], "'fedavg' is given twice"),
    (["compare", "--methods", "fedavg@lr=0.1@momentum=0.5,fedavg@lr=0.1 momentum=0.5"],
     "would share the run folder fedavg_lr_0.1_momentum_0.5"),
    (["compare", "--methods", "fedavg,fedavg@seed=7", "--seeds", "0,1"], "cannot be compared over"),
    (["compare", "--methods", "fedavg@seed=-1"], "'seed' = -1"),  # the variant's seed is checked
    # found by a bad-input sweep (each was a traceback, a late failure or a misleading message)
    (["run", "-c", "lr=0.05 lr=0.1"], "lr given twice"),
    # from a CLI review: each was ignored, wrong, or a bare OSError
    (["run", "-c", "lr=0.05", "-c", "lr=0.1"], "lr given twice"),
    (["compare", "--methods", "fedavg@method='fedprox'"], "a variant cannot set method"),
    (["compare", "--methods", "fedavg", "-c", "output-dir='/tmp/x'"], "'output-dir' = '/tmp/x' is invalid"),
    (["compare", "--methods", "fedavg@run-name='x'"], "give the comparison's folder with --out"),
    (["run", "-c", "partition=0.5"], "quote it, partition='dirichlet:0.5'"),
    (["superlink", "up", "--home", "/etc/passwd"], "/etc/passwd is a file"),
    (["deploy", "certs", "--out", "/etc/passwd"], "/etc/passwd is a file"),
    (["deploy", "export-data", "--out", "/etc/passwd"], "/etc/passwd is a file"),
    (["partitions", "--out", "/etc/passwd/x.png"], "/etc/passwd is a file"),
    (["compare", "--methods", "fedavg@lr=0.1@lr=0.2"], "lr given twice"),
    (["compare", "--methods", "fedavg@resume='/tmp'"], "'resume' = '/tmp'"),
    (["run", "--cpus-per-client", "1000"], "more than this machine's"),
    (["compare", "--methods", "fedavg", "--out", "/etc/passwd"], "/etc/passwd is a file"),
    (["run", "-c", "output-dir='/etc/passwd'"], "/etc/passwd is a file"),
    (["run", "-c", "method='fedxds' fedxds-epsilon=0.05 num-server-rounds=4 train-samples=500"],
     "opacus finds no noise level"),
    (["run", "-c", "method='fedade' fedade-shift='covariate' fedade-batch=1000 "
      "num-server-rounds=2 train-samples=500 fedade-rounds-per-step=1"], "'fedade-batch' = 1000"),
    (["run", "--num-clients", "501", "-c", "train-samples=500"], "'--num-clients' = 501"),
    (["partitions", "--out", "p.txt"], "a file matplotlib can write"),
    (["deploy", "up", "--address", "127.0.0.1:9000"], "without the port"),
    (["deploy", "up", "--address", "no-such-host.invalid"], "cannot resolve it"),
    (["run", "-c", "client-state-dir='/etc/passwd/x'"], "/etc/passwd is a file"),
    (["deploy", "up", "--num-clients", "0"], "'--num-clients' = 0"),
    # from an audit: these named num-partitions, or ended in a bare 'embedded null byte'
    (["partitions", "--num-clients", "0"], "'--num-clients' = 0"),
    (["deploy", "export-data", "--num-clients", "0"], "'--num-clients' = 0"),
    (["run", "-c", 'run-name="a\\u0000b"'], "control characters"),
    # a deploy option the action does not read was ignored: `deploy up --method fedx` ran fedavg
    (["deploy", "up", "--method", "fedx"], "only `deploy run / export-data` reads it, not `deploy up`"),
    (["deploy", "status", "-c", "lr=0.1"], "'--run-config' = ['lr=0.1']"),
    (["deploy", "down", "--force"], "only `deploy certs / node-key / export-data` reads it"),
    (["deploy", "certs", "--data-dirs", "d"], "only `deploy up` reads it, not `deploy certs`"),
    (["deploy", "status", "--seed", "0"], "'--seed' = 0"),  # (0 == False: it was taken as not given)
    (["deploy", "run", "--address", "10.0.0.5"], "only `deploy certs / up` reads it"),
    (["deploy", "down", "--port", "9000"], "only `deploy up` reads it, not `deploy down`"),
    (["deploy", "export-data", "--home", "h"], "not `deploy export-data`"),
    # from a review: a certificate named '10.0.0.5:8000' as a DNS name, and SuperNodes failed later
    (["deploy", "certs", "--host", "10.0.0.5:8000"], "'--host' = '10.0.0.5:8000'"),
    (["deploy", "certs", "--host", "https://10.0.0.5"], "with no scheme or path"),
    (["deploy", "certs", "--host", "*.example.org", "--host", "a..b"], "'--host' = 'a..b'"),
    (["deploy", "up", "--host-bind", "bad name!"], "'--host-bind' = 'bad name!'"),
])
def test_malformed_command_lines_get_one_line_not_a_traceback(argv, said, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_deploy_home_with_a_tilde_is_the_users_home(capsys):
    """From a review: `deploy down --home ~/dep` (quoted, so the shell left the ~) looked in a
    folder named '~' here, while `superlink` expanded it."""
    assert cli.main(["deploy", "down", "--home", "~/flowerbed-no-such-deployment"]) == 0
    assert str(Path.home() / "flowerbed-no-such-deployment") in capsys.readouterr().out


def test_a_port_out_of_range_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:  # (flower-superlink printed its whole usage text)
        cli.main(["superlink", "up", "--port", "99999"])
    assert e.value.code == 2 and "'99999' is not a port (1-65535)" in capsys.readouterr().err


def test_malformed_saved_configs_and_resume_by_key_are_one_line(tmp_path, capsys):
    """Found by a bad-input sweep: a config.json holding a list, or a bad num-partitions, was a
    traceback; `-c resume='<dir>'` skipped the launcher's resume checks and ran 25 s to fail."""
    bad = tmp_path / "r"
    bad.mkdir()
    for text in ("[1, 2]", '{"num-partitions": "x"}'):
        (bad / "config.json").write_text(text)
        for argv in (["run", "--resume", str(bad)], ["run", "-c", f"resume='{bad}'"]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert "no readable config.json" in err and "Traceback" not in err
    (bad / "config.json").write_text("{")
    (bad / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="its config.json is unreadable"):
        cmp.earlier_run(bad, {"method": "fedavg"}, 2)
    assert cli.main(["partitions", "--num-clients", "2", "-c", "train-samples=500", "--out",
                     str(tmp_path)]) == 0  # a folder: the default name in it
    assert list(tmp_path.glob("partitions-fashion-mnist-*.png"))


def test_resume_and_out_refuse_folders_that_are_not_theirs(tmp_path, capsys):
    """A README walk-through: `run --resume` of a missing folder printed a FileNotFoundError;
    `compare --out <a run>` set the run's plot aside and made a run inside it; `compare --resume
    --out <typo>` started afresh; resuming a --seeds comparison without --seeds replaced its
    mean ± std table with one seed's."""
    run, cmp_dir = tmp_path / "run", tmp_path / "cmp"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "fedavg", "num-partitions": 3}))
    (cmp_dir / "seed-0").mkdir(parents=True)
    cases = [(["run", "--resume", str(tmp_path / "nope")], "no such folder"),
             (["run", "--resume", str(cmp_dir)], f"holds a comparison, not a run: continue it with "
                                                  f"`flowerbed compare --out {cmp_dir} --resume`"),
             (["run", "--resume", str(tmp_path)], "is not a run folder (no config.json"),
             (["compare", "--methods", "fedavg", "--out", str(run)], "this is a run's folder"),
             (["compare", "--methods", "fedavg", "--out", str(tmp_path / "typo"), "--resume"],
              "nothing to continue in"),
             (["compare", "--methods", "fedavg", "--out", str(cmp_dir), "--resume"],
              "was made with --seeds 0: give them again")]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "results.json").write_text(json.dumps({"fedavg": {"rounds": 2}}))
    assert cli.main(["compare", "--methods", "fedavg", "--out", str(tmp_path / "one"), "--resume",
                     "--seeds", "0,1"]) == 2
    assert "made without --seeds" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists() and sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_resume_refuses_another_client_count(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"method": "fedavg", "num-partitions": 3}))
    assert cli.main(["run", "--resume", str(tmp_path), "--num-clients", "5"]) == 2
    assert "has 3 clients" in capsys.readouterr().err


def test_resume_refuses_to_move_the_run(tmp_path, capsys):
    """Regression: -c run-name=... with --resume made the launcher look for the summary in
    another folder and report a finished run as failed."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "fedavg", "num-partitions": 3}))
    assert cli.main(["run", "--resume", str(run), "-c", "run-name='other'"]) == 2
    assert "a resumed run stays where it is" in capsys.readouterr().err


def test_resume_refuses_another_config_before_starting_anything(tmp_path, capsys):
    """Found by a README walk-through: `run --resume <dir> -c lr=0.1` started the engine and
    ended 22 s later in a traceback whose hint was to use `run --resume`, which it had."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "fedavg", "num-partitions": 3,
                                                 "lr": 0.01, "num-server-rounds": 2}))
    assert cli.main(["run", "--resume", str(run), "-c", "lr=0.1 num-server-rounds=4"]) == 2
    err = capsys.readouterr().err
    assert "keeps its config; this changes lr: 0.01 -> 0.1" in err and "num-server-rounds" in err
    assert "Traceback" not in err


def test_deploy_up_starts_one_supernode_per_exported_folder(tmp_path, capsys):
    """Regression: `deploy up --data-dirs` used its default of 2 SuperNodes whatever the folder
    held, so a 3-client export trained on 2 of its parts without a word."""
    for i in range(3):
        (tmp_path / f"client-{i}").mkdir()
    argv = ["deploy", "up", "--home", str(tmp_path / "home"), "--data-dirs", str(tmp_path)]
    assert cli.main([*argv, "--num-clients", "2"]) == 2
    assert "holds client folders [0, 1, 2]" in capsys.readouterr().err
    (tmp_path / "client-1").rename(tmp_path / "client-7")  # a gap: not an export of ours
    assert cli.main(argv) == 2
    assert "holds client folders [0, 2, 7]" in capsys.readouterr().err


def test_partitions_shows_the_split_a_preset_and_run_config_give(tmp_path, capsys):
    assert cli.main(["partitions", "--preset", PRESET, "--num-clients", "2", "-c", "train-samples=100",
                     "--partition", "iid", "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fashion-mnist iid seed=0: 2 clients")
    assert [int(line.split()[-1]) for line in out[2:4]] == [50, 50]  # the -c train-samples
    assert (tmp_path / "p.png").exists()


def test_compare_resume_keeps_finished_and_resumes_stopped(tmp_path, fake_engine):
    """The launcher's --resume decides per method."""
    for name, files in (("fedavg", ["summary.json", "checkpoint.pt"]), ("fedprox", ["checkpoint.pt"]),
                        ("scaffold", [])):
        (tmp_path / name).mkdir()
        for f in files:
            if f == "checkpoint.pt":
                from flwr.app import ArrayRecord

                from flowerbed import checkpoint
                checkpoint.save(tmp_path / name, 2, ArrayRecord(), {}, {})
            else:
                (tmp_path / name / f).write_text(json.dumps({"final-accuracy": 0.5}))
        (tmp_path / name / "metrics.jsonl").write_text('{"round": 0}\n')
        (tmp_path / name / "config.json").write_text(json.dumps({"num-server-rounds": 5}))
    calls = {}

    def fake_run(home, conn, rc, fed, **kw):
        calls[rc["run-name"]] = rc.get("resume")
        (tmp_path / rc["run-name"]).mkdir(exist_ok=True)
        (tmp_path / rc["run-name"] / "metrics.jsonl").write_text('{"round": 0}\n')
        return {"final-accuracy": 0.6}

    fake_engine(fake_run)
    cmp.compare(["fedavg", "fedprox", "scaffold"], {"seed": 0}, 2, out=tmp_path, resume=True)
    assert calls == {"fedprox": str(tmp_path / "fedprox"), "scaffold": None}
    with pytest.raises(ConfigError, match="stopped after round 2; this comparison asks for 1"):
        cmp.earlier_run(tmp_path / "fedprox", {"num-server-rounds": 1}, 2)  # before launching
    tables = (tmp_path / "table.md").read_text()
    cmp.compare(["scaffold"], {"seed": 0}, 2, out=tmp_path)  # fresh: the old run is moved aside
    assert calls["scaffold"] is None
    assert list(tmp_path.glob("scaffold.old-*"))
    assert [f.read_text() for f in tmp_path.glob("table.old-*.md")] == [tables]  # and its table


def test_a_resumed_comparison_of_fewer_methods_keeps_the_earlier_tables(tmp_path, fake_engine):
    """Found by a README walk-through: `compare --resume` with fewer methods rewrote table.md,
    results.json and accuracy.png with only those, and the other rows were gone. And a run
    folder with a dot in its name was set aside as 'fedavg_lr_0.old-<time>.05'."""
    def fake_run(home, conn, rc, fed, **kw):
        (tmp_path / rc["run-name"]).mkdir(exist_ok=True)
        (tmp_path / rc["run-name"] / "metrics.jsonl").write_text('{"round": 0}\n')
        return {"final-accuracy": 0.6}

    fake_engine(fake_run)
    cmp.compare(["fedavg", "fedavg@lr=0.05"], {"seed": 0}, 2, out=tmp_path)
    tables = (tmp_path / "table.md").read_text()
    cmp.compare(["fedavg"], {"seed": 0}, 2, out=tmp_path, resume=True)
    assert [f.read_text() for f in tmp_path.glob("table.old-*.md")] == [tables]
    cmp.compare(["fedavg"], {"seed": 0}, 2, out=tmp_path, resume=True)  # same methods: in place
    assert len(list(tmp_path.glob("table.old-*.md"))) == 1
    (tmp_path / "client-accuracy.png").write_bytes(b"earlier")  # a comparison's plot too
    cmp.compare(["fedavg@lr=0.05"], {"seed": 0}, 2, out=tmp_path)  # fresh: moved aside
    assert [p.read_bytes() for p in tmp_path.glob("client-accuracy.old-*.png")] == [b"earlier"]
    label = cmp.run_label("fedavg@lr=0.05")
    assert [p.name.startswith(f"{label}.old-") and p.name[-2:].isdigit()
            for p in tmp_path.glob(f"{label}.old-*")] == [True]


def test_tables_put_every_method_on_the_clients_test_splits_too():
    """FedFew's `final-accuracy` is personalised, FedAvg's the global model's on the test set: the
    tables add the clients' measure for both (`client acc %`), and leave it out when no run has it."""
    fedfew = {"final-accuracy": 0.70, "final-client-accuracy": 0.70, "best-accuracy": 0.71,
              "best-round": 9}
    fedavg = {"final-accuracy": 0.56, "final-client-accuracy": 0.57, "best-accuracy": 0.56,
              "best-round": 10}
    table = cmp.markdown_table({"fedfew": fedfew, "fedavg": fedavg, "x": {"error": "boom"}},
                               {"num-server-rounds": 10}, 20)
    assert "| method | final acc % | client acc % | best acc % (round) |" in table
    assert "| fedavg | 56.00 | 57.00 | 56.00 (10) |" in table and "| x | failed | - | - |" in table
    assert "client acc: every method on the clients' local test splits" in table
    plain = cmp.markdown_table({"fedavg": {"final-accuracy": 0.5}}, {}, 2)
    assert "client acc" not in plain and "| fedavg | 50.00 | - (None) |" in plain
    summary = {"fedavg": cmp.seed_stats({0: fedavg, 1: {**fedavg, "final-client-accuracy": 0.59}})}
    table = cmp.seeds_table(json.loads(json.dumps(summary)), {}, 20, [0, 1])
    assert "| fedavg | 56.00 ± 0.00 | 56.00 (s0), 56.00 (s1) | 58.00 ± 1.41 | 56.00 ± 0.00 | 0 | - |" in table


def test_compare_exits_1_naming_the_failed_runs(tmp_path, fake_engine, capsys, caplog):
    """A comparison in which a method failed used to exit 0 (its row said 'failed')."""
    def fake_run(home, conn, rc, fed, **kw):
        if rc["run-name"] == "fedprox":
            raise cmp.engine.RunFailed("the ServerApp failed")
        (tmp_path / rc["run-name"]).mkdir(exist_ok=True)
        (tmp_path / rc["run-name"] / "metrics.jsonl").write_text('{"round": 1, "accuracy": 0.6}\n')
        return {"final-accuracy": 0.6}

    fake_engine(fake_run)
    argv = ["compare", "--methods", "fedavg,fedprox", "--num-clients", "2", "--rounds", "1",
            "-c", "train-samples=200", "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "1 run(s) failed: fedprox" in caplog.text
    assert "| fedavg | 60.00 |" in capsys.readouterr().out  # the other method's result is kept
    assert cmp.failed_runs(tmp_path) == ["fedprox"]


def test_resume_does_not_keep_a_finished_run_with_other_fault_settings(tmp_path):
    """round-timeout and the fault keys may change when a stopped run continues, but a
    finished run made with faults is not a clean run's result."""
    run = tmp_path / "fedavg"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    rc = {"method": "fedavg", "num-server-rounds": 2}
    saved = {**Config.from_run_config(rc).to_run_config(), "num-partitions": 2}
    (run / "config.json").write_text(json.dumps({**saved, "fault-fraction": 0.5}))
    with pytest.raises(ConfigError, match="finished with other settings .fault-fraction: 0.5 -> 0.0"):
        cmp.earlier_run(run, rc, 2)
    (run / "config.json").write_text(json.dumps(saved))
    assert cmp.earlier_run(run, rc, 2) == "keep"


def test_tables_name_rows_that_change_the_shared_settings():
    results = {"fedavg": {"final-accuracy": 0.5}, "fedavg@partition='iid'": {"final-accuracy": 0.6}}
    table = cmp.markdown_table(results, {"num-server-rounds": 2}, 2)
    assert "Except where a row's own settings change them: fedavg@partition='iid' (partition)." in table
    assert "Except" not in cmp.markdown_table({"fedavg@lr=0.1": {}}, {}, 2)
    # a public set carved out of the training data changes the clients' partitions too (a review)
    table = cmp.markdown_table({"fedavg": {}, "feddf@public-fraction=0.1": {}}, {}, 2)
    assert ("Except where a row's own settings change them: feddf@public-fraction=0.1 "
            "(public-fraction)") in table


def test_tables_name_runs_with_skipped_rounds():
    results = {"fedavg": {"rounds": 5, "rounds-aggregated": 1}, "ifca": {"rounds": 5,
               "rounds-aggregated": 5}, "old": {"rounds": 5}, "x": {"error": "boom"}}
    table = cmp.markdown_table(results, {"num-server-rounds": 5}, 2)
    assert "Rounds skipped (fewer than min-clients valid replies" in table
    assert "metrics.jsonl): fedavg (4 of 5).\n" in table
    assert table.endswith("\n\nFailed: x: boom")  # a failed row's reason (a review: named nowhere)


def test_a_refused_run_keeps_the_finished_runs_summary_and_earlier_logs(tmp_path, monkeypatch):
    """Regression: flwr_run deleted summary.json before `flwr run`, so a run the ServerApp
    refused (a reused run-name, a resume of a finished run) lost the finished run's summary;
    the log file of an earlier attempt was overwritten too."""
    fake = tmp_path / "flwr"
    fake.write_text("#!/bin/sh\necho refused\nexit 0\n")  # like `flwr run --stream` on a refusal
    fake.chmod(0o755)
    monkeypatch.setattr(cmp.engine, "_bin", lambda name: str(fake))
    run = tmp_path / "done"
    run.mkdir()
    (run / "summary.json").write_text('{"final-accuracy": 0.8}')
    (tmp_path / "done.log").write_text("the first attempt\n")
    rc = {"output-dir": str(tmp_path), "run-name": "done"}
    with pytest.raises(cmp.engine.RunFailed, match="without writing"):
        cmp.engine.flwr_run(tmp_path, "c", rc, None, log_file=tmp_path / "done.log")
    assert json.loads((run / "summary.json").read_text()) == {"final-accuracy": 0.8}
    log = (tmp_path / "done.log").read_text()
    assert log.startswith("the first attempt\n") and log.endswith("refused\n")


def test_a_failed_run_names_the_servers_reason(tmp_path, monkeypatch):
    """The launcher's line said only "the ServerApp failed"; the reason was in the log."""
    fake = tmp_path / "flwr"
    fake.write_text("#!/bin/sh\necho 'Traceback (most recent call last):'\n"
                    "echo 'flowerbed.apps.server_app.NothingAggregated: no round aggregated a client "
                    "reply (every client failed)'\necho 'ERROR :     Exit Code: 700'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cmp.engine, "_bin", lambda name: str(fake))
    rc = {"output-dir": str(tmp_path), "run-name": "r"}
    with pytest.raises(cmp.engine.RunFailed, match="NothingAggregated: no round aggregated a client "
                                                   r"reply \(every client failed\) \(its log: "):
        cmp.engine.flwr_run(tmp_path, "c", rc, None, log_file=tmp_path / "r.log")
    crash = ["x", "flowerbed.faults.SimulatedCrash: fault-crash-after=1: the ServerApp stops"]
    assert "continue it with `flowerbed run --resume /d`" in cmp.engine.failure_reason(crash, "/d")


def test_run_refuses_a_taken_folder_or_a_finished_resume_before_starting(tmp_path, monkeypatch, capsys):
    """Both used to start a SuperLink, Ray and the clients, then fail in the ServerApp."""
    monkeypatch.setattr(cmp.engine, "local_superlink", lambda *a, **k: pytest.fail("started"))
    run = tmp_path / "done"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 0}\n')
    (run / "summary.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"num-server-rounds": 2, "num-partitions": 2}))
    base = ["run", "--num-clients", "2", "-c", f"output-dir='{tmp_path}' train-samples=200"]
    assert cli.main([*base, "-c", "run-name='done'"]) == 2
    assert "already holds a run; continue it with `flowerbed run --resume" in capsys.readouterr().err
    assert cli.main(["run", "--resume", str(run), "-c", "num-server-rounds=2"]) == 2
    assert "finished 2 rounds; raise num-server-rounds to extend it (--rounds N" in capsys.readouterr().err
    # a deployed run on the clients' own folders: a simulation cannot serve them
    (run / "config.json").write_text(json.dumps({"num-server-rounds": 2, "num-partitions": 2,
                                                 "client-data": {"own-folders": 2, "exported-with": {}}}))
    assert cli.main(["run", "--resume", str(run), "-c", "num-server-rounds=3"]) == 2
    assert "continue it with `flowerbed deploy run --resume`" in capsys.readouterr().err


def test_resume_with_every_run_kept_starts_no_superlink(tmp_path, monkeypatch):
    run = tmp_path / "fedavg"
    run.mkdir()
    rc = {"method": "fedavg", "num-server-rounds": 2}
    (run / "config.json").write_text(json.dumps(
        {**Config.from_run_config(rc).to_run_config(), "num-partitions": 2}))
    (run / "summary.json").write_text('{"final-accuracy": 0.5}')
    (run / "metrics.jsonl").write_text('{"round": 1, "accuracy": 0.5}\n')
    monkeypatch.setattr(cmp.engine, "local_superlink", lambda *a, **k: pytest.fail("started"))
    assert "| fedavg | 50.00 |" in cmp.compare(["fedavg"], {"num-server-rounds": 2}, 2,
                                               out=tmp_path, resume=True)


def test_failure_reason_skips_client_errors_the_rounds_survived():
    lines = ["ray: ValueError: partition 3 has no training samples to share\n",
             "INFO flowerbed: [round 2/3] acc 0.5 ...\n", "Killed (exit code -9)\n"]
    assert cmp.engine.failure_reason(lines, "/d") == "the ServerApp failed"
    mine = [*lines[:2], "flowerbed.checkpoint.CheckpointError: resume: x is corrupt\n"]
    assert cmp.engine.failure_reason(mine, "/d") == "CheckpointError: resume: x is corrupt"


def test_failure_reason_of_a_run_flwr_refused_is_flwrs_own_error():
    """From a bad-input audit: `--cpus-per-client 0.5` reached `flwr run`, which refused it in
    its error box; the console said only 'the ServerApp failed'."""
    lines = ["Using SuperLink: flowerbed-sim (127.0.0.1:51431)\n",
             "╭─ Error ──────────────────────────────────────╮\n",
             "│ 'float' object cannot be interpreted as an   │\n", "│ integer    │\n",
             "╰──────────────────────────────────────────────╯\n"]
    assert (cmp.engine.failure_reason(lines, "/d")
            == "flwr run: 'float' object cannot be interpreted as an integer")


def test_default_run_folders_are_never_shared(tmp_path):
    """Regression: default run names were unique only to the second, so two launchers started
    in the same second wrote into one folder. The folder is now created when it is named."""
    from flowerbed.cli import place_run
    from flowerbed.results import new_folder

    first, second = new_folder(tmp_path, "fedavg"), new_folder(tmp_path, "fedavg")
    assert first.is_dir() and second.is_dir() and first != second
    names = set()
    for _ in range(3):  # the launcher's default name, three times in (almost surely) one second
        overrides = {"method": "fedavg", "output-dir": str(tmp_path / "runs")}
        with place_run(overrides, Config.from_run_config(overrides)):
            names.add(overrides["run-name"])
            (tmp_path / "runs" / overrides["run-name"] / "metrics.jsonl").write_text("")
    assert len(names) == 3
    overrides = {"method": "fedavg", "output-dir": str(tmp_path / "runs")}
    with pytest.raises(KeyboardInterrupt), place_run(overrides, Config.from_run_config(overrides)):
        raise KeyboardInterrupt  # e.g. the SuperLink did not start: its empty folder goes
    assert not (tmp_path / "runs" / overrides["run-name"]).exists()
    assert len(list((tmp_path / "runs").iterdir())) == 3  # the others, not empty, stay


def test_a_run_or_comparison_folder_has_one_launcher_at_a_time(tmp_path):
    """Regression: two launchers given the same run-name (or a --resume of a run still going)
    both passed the empty-folder check and wrote one metrics.jsonl; two compares into one --out
    likewise. The second is now refused while the first holds the folder, and not after."""
    from flowerbed.cli import place_run

    def rc():
        return {"method": "fedavg", "output-dir": str(tmp_path / "runs"), "run-name": "mine"}

    first = rc()
    with place_run(first, Config.from_run_config(first)):
        with pytest.raises(ConfigError, match="run-name.*another flowerbed process"):
            with place_run(rc(), Config.from_run_config(rc())):
                pass
        assert (tmp_path / "runs" / "mine").is_dir()  # the refusal removed nothing
        with pytest.raises(ConfigError, match="--out.*another flowerbed process"):
            cmp.compare(["fedavg"], {}, 2, out=tmp_path / "runs" / "mine")
        (tmp_path / "runs" / "mine" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run"):  # free again: the usual check
        with place_run(rc(), Config.from_run_config(rc())):
            pass
    with pytest.raises(ConfigError, match="output-dir.*no folder can be made there"):
        bad = {"method": "fedavg", "output-dir": "/proc/flowerbed-test", "run-name": "x"}
        with place_run(bad, Config.from_run_config(bad)):
            pass


def test_a_serverapp_that_outlived_its_launcher_keeps_its_run(tmp_path):
    """Found by a review: a launcher killed with SIGKILL leaves its SuperLink and ServerApp
    running (they are in a session of their own), and the kernel drops the launcher's lock, so
    `flowerbed run --resume` of that run wrote the same metrics.jsonl beside it (rounds 5, 5, 6,
    6, ...). The ServerApp itself holds its run while writing: a second one is refused, and so
    is a launcher before it starts anything; after the first ends, the resume goes ahead."""
    from flowerbed.cli import place_run
    from flowerbed.results import RunDir

    with RunDir(str(tmp_path), "r", {"method": "fedavg"}) as orphan:
        orphan.log_round({"round": 0, "accuracy": 0.1})
        with pytest.raises(ConfigError, match="a ServerApp is still writing this run"):
            RunDir(str(tmp_path), "r", {"method": "fedavg"}, resume_round=0)
        rc = {"method": "fedavg", "output-dir": str(tmp_path), "run-name": "r",
              "resume": str(tmp_path / "r")}
        with pytest.raises(ConfigError, match="a ServerApp is still writing this run"):
            with place_run(rc, Config.from_run_config(rc)):
                pass
    with RunDir(str(tmp_path), "r", {}, resume_round=0) as resumed:
        assert [r["round"] for r in resumed.rows] == [0]


def test_compare_never_moves_aside_a_run_that_is_being_written(tmp_path, fake_engine):
    """From the review of the locks: a fresh comparison moved an existing folder aside before
    taking it, and a ServerApp still writing there (another terminal's run, or one whose
    launcher was killed) wrote its next rows into the new run's metrics.jsonl. That method's
    row now fails, naming the writer, and its folder stays; the other methods run."""
    from flowerbed.results import RunDir

    def fake_run(home, conn, rc, fed, **kw):
        (tmp_path / rc["run-name"] / "metrics.jsonl").write_text('{"round": 1, "accuracy": 0.5}\n')
        return {"final-accuracy": 0.5}

    fake_engine(fake_run)
    with RunDir(str(tmp_path), "fedavg", {"method": "fedavg"}) as live:
        live.log_round({"round": 0})
        cmp.compare(["fedavg", "fedprox"], {}, 2, out=tmp_path)
    res = json.loads((tmp_path / "results.json").read_text())
    assert "a ServerApp is still writing this run" in res["fedavg"]["error"]
    assert res["fedprox"] == {"final-accuracy": 0.5}
    assert not list(tmp_path.glob("fedavg.old-*"))
    rows = (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in rows] == [{"round": 0}]


def test_two_superlink_ups_at_once_start_one(tmp_path):
    """Found by a review: two `flowerbed superlink up` at once both passed the pid-file check and
    started a SuperLink each; `down` could stop only the one the pid file named."""
    from flowerbed.results import held

    with held(tmp_path / "superlink.lock", RuntimeError("held")):  # the first one, starting
        with pytest.raises(cmp.engine.EngineError, match="another `flowerbed superlink up`"):
            cmp.engine.superlink_up(tmp_path, port=cmp.engine.free_port())
    assert not (tmp_path / "superlink.pid").exists()


def test_a_comparisons_run_cannot_be_resumed_elsewhere_while_it_runs(tmp_path, fake_engine):
    """Each run of a comparison holds its folder while it runs: `flowerbed run --resume` of it
    from another terminal is refused then; a run that fails before its first file leaves no
    empty folder (a later `compare --resume` would set it aside as an old run)."""
    from flowerbed.cli import place_run

    refused = []

    def fake_run(home, conn, rc, fed, **kw):
        again = {**rc, "resume": str(tmp_path / rc["run-name"])}
        with pytest.raises(ConfigError, match="another flowerbed process") as e:
            with place_run(again, Config.from_run_config(again)):
                pass
        refused.append(e.value)
        raise cmp.engine.RunFailed("the ServerApp failed")

    fake_engine(fake_run)
    cmp.compare(["fedavg"], {}, 2, out=tmp_path)
    assert refused and not (tmp_path / "fedavg").exists()


def test_plain_flwr_runs_without_a_name_get_distinct_folders(tmp_path):
    from flowerbed.apps.server_app import default_run_name

    cfg = Config.from_run_config({"output-dir": str(tmp_path), "partition": "dirichlet:0.5"})
    a, b = default_run_name(cfg), default_run_name(cfg)
    assert a != b and a.startswith("fedavg-fashion-mnist-dirichlet0.5-s0-")
    assert (tmp_path / a).is_dir() and (tmp_path / b).is_dir()


def test_unusable_paths_are_one_line_and_a_plot_gets_its_folder(tmp_path, capsys):
    """Found by a README walk-through: output-dir naming a file ended in NotADirectoryError's
    traceback, and `partitions --out` into a folder not there yet in FileNotFoundError's."""
    (tmp_path / "afile").write_text("")
    assert cli.main(["run", "-c", f"output-dir='{tmp_path / 'afile'}'"]) == 2  # bad input
    err = capsys.readouterr().err
    assert err.startswith("flowerbed: error:") and "afile is a file" in err and "Traceback" not in err
    out = tmp_path / "new" / "folder" / "p.png"
    assert cli.main(["partitions", "--num-clients", "3", "--out", str(out), "-c",
                     "train-samples=600"]) == 0
    assert out.is_file()


def test_a_refused_run_or_comparison_makes_no_folder(tmp_path, capsys, monkeypatch):
    """Found by a README walk-through: `run --cpus-per-client 0` was refused after its run
    folder was made, and `compare --cpus-per-client 0` after its comparison folder."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--cpus-per-client", "0", "-c", f"output-dir='{tmp_path}/runs'"]) == 2
    assert cli.main(["compare", "--methods", "fedavg", "--cpus-per-client", "0"]) == 2
    assert "--cpus-per-client" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_progress_line_shows_small_traffic_in_kb():
    """FedCC/FedDF/FedMD's probability vectors showed as 'up 0.0 MB down 0.0 MB'."""
    from flowerbed.results import progress_line

    line = progress_line({"round": 1, "bytes-up": 44_000, "bytes-down": 6_650_000})
    assert "up 44.0 kB down 6.7 MB" in line


def test_progress_line_of_a_stream_and_of_a_model_not_scored_on_the_server():
    """Found by a review: Fed-ADE's lines were '-' on every round (its rate, risk and
    predict-then-update accuracy never shown), round 0 of fedfew 'acc - loss -'."""
    from flowerbed.results import progress_line

    line = progress_line({"round": 1, "rounds": 4, "time-step": 0.0, "lr": 1e-5, "risk": 0.7,
                          "pre-accuracy": 0.625})
    assert "| step 0 lr 1.00e-05 risk 0.7000 pre-acc 0.6250 |" in line
    poe = progress_line({"round": 3, "rounds": 4, "time-step": 1.0, "lr": 5e-4, "risk": 0.3,
                         "fed-weight": 0.4712, "pool-weight": 0.5})  # Fed-POE's Hedge weights
    assert "| step 1 lr 5.00e-04 risk 0.3000 fed-w 0.471 pool-w 0.500 |" in poe
    assert progress_line({"round": 0, "rounds": 4}).endswith("initial model: not scored on the server")
    assert "acc 0.1000" in progress_line({"round": 0, "rounds": 4, "accuracy": 0.1})
    fedx = progress_line({"round": 2, "rounds": 4, "train-loss": 5.2, "fedx-loss-base": 4.0,
                          "fedx-loss-global-contrastive": 1.2})  # FedX's loss, term by term
    assert "train-loss 5.2000 (base 4.0000 global-contrastive 1.2000) client-acc -" in fedx


def test_time_step_curves_put_both_accuracies_at_their_step():
    """Found by a review: a Fed-ADE run's plot drew predict-then-update at each step's first
    round and online accuracy at its last, rounds-per-step - 1 apart."""
    from flowerbed.results import time_step_curves

    rows = [{"round": 0}, {"round": 1, "time-step": 0.0, "pre-accuracy": 0.5},
            {"round": 2, "time-step": 0.0, "accuracy": 0.6},
            {"round": 3, "time-step": 1.0, "pre-accuracy": 0.55},
            {"round": 4, "time-step": 1.0, "accuracy": 0.65}]
    rows.append({"round": 6, "client-time-step": 2.0, "accuracy": 0.7})  # training skipped
    online, pre = time_step_curves(rows)
    assert online == [{"round": 1, "accuracy": 0.6}, {"round": 2, "accuracy": 0.65},
                      {"round": 3, "accuracy": 0.7}]
    assert pre == [{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.55}]


def test_failure_reasons_are_one_readable_line():
    """Flower's reason is str(type) + the message: under the simulation engine Ray's wrapper,
    whose message ends in the original's; from a deployed ClientApp the original itself."""
    from flowerbed.strategies.base import short_reason

    reason = ("Traceback ...\n\nException ClientAppException occurred. Message: injected fault: "
              "partition 1 raises in round 1'>")
    assert short_reason(reason).endswith("raises in round 1")
    simulated = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() "
                 "(pid=1)\n  File \"x.py\", line 1, in f\nflwr.clientapp.client_app.ClientAppException: "
                 "\nException ClientAppException occurred. Message: injected fault: partition 0 raises "
                 "in round 1'>")
    assert short_reason(simulated) == "injected fault: partition 0 raises in round 1"
    # Ray's text holds the original exception: named as under deployment, whole message kept
    chained = simulated.replace("  File", "  File \"/a/flowerbed/b.py\", line 2, in g\n    raise\n"
                                "RuntimeError: size mismatch\n\tfor fc.weight\n\nThe above exception was "
                                "the direct cause of the following exception:\n\nray::x\n  File", 1)
    assert short_reason(chained) == "RuntimeError: size mismatch | for fc.weight"
    assert short_reason(chained.replace("RuntimeError: size", "ValueError: HTTP Message: 404, size")
                        ) == "ValueError: HTTP Message: 404, size mismatch | for fc.weight"
    assert short_reason("<class 'AssertionError'>:<''>") == "AssertionError (no message)"
    # from a review: Ray's traceback of a load failure (with its colours), a long multi-line text
    load = ("<class 'ray.exceptions.RayTaskError(LoadClientAppError)'>:<'\x1b[36mray::ClientAppActor.run()"
            "\x1b[39m (pid=1)\n  File \"/v/site-packages/flwr/a.py\", line 9, in run\n    raise X\n"
            "flwr.clientapp.client_app.LoadClientAppError: could not load app'>")
    assert short_reason(load) == "LoadClientAppError: could not load app"
    died = short_reason("<class 'ray.exceptions.ActorDiedError'>:<'The actor died.\n" + "\tpid: 1\n" * 60
                        + "The actor was killed by SIGKILL by OOM killer.'>")
    assert len(died) <= 300 and died.startswith("ActorDiedError: The actor died.") and died.endswith(
        "killed by SIGKILL by OOM killer.")
    deployed = "<class 'flowerbed.faults.InjectedFault'>:<'injected fault: partition 0 raises'>"
    assert short_reason(deployed) == "InjectedFault: injected fault: partition 0 raises"


def test_review_of_the_session_s_own_fixes(tmp_path, capsys, monkeypatch):
    """A review of this session's diff found: new_folder looping for ever under a broken
    symlink; a resumed run's own 'dirichlet:1' refused as a change (1.0 -> 1); nohup's ignored
    SIGHUP replaced by ours; compare --resume over fewer seeds dropping their rows."""
    import os
    import signal
    import time

    from flowerbed.results import new_folder

    (tmp_path / "gone").symlink_to(tmp_path / "unmounted")
    with pytest.raises(ConfigError, match="no folder can be made there .a link to nothing is in the way"):
        new_folder(tmp_path / "gone", "fedavg")
    run = tmp_path / "r"
    run.mkdir()
    saved = Config.from_run_config({"partition": "dirichlet:1", "num-server-rounds": 2})
    (run / "config.json").write_text(json.dumps({**saved.to_run_config(), "num-partitions": 2}))
    with pytest.raises(Exception) as e:  # past the up-front check: the engine itself, faked
        monkeypatch.setattr(cli, "preflight", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("ok")))
        cli.main(["run", "--resume", str(run), "-c", "partition='dirichlet:1'"])
    assert str(e.value) == "ok", capsys.readouterr().err

    for sig in (signal.SIGHUP, signal.SIGTERM):  # each raises Terminated, as Ctrl-C raises
        outer = signal.signal(sig, signal.SIG_DFL)  # as in a terminal (pytest may run under nohup)
        try:
            with pytest.raises(cli.Terminated), cli.signals_interrupt():
                os.kill(os.getpid(), sig)
                time.sleep(1)
            assert signal.getsignal(sig) == signal.SIG_DFL  # restored afterwards
        finally:
            signal.signal(sig, outer)
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with cli.signals_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, old)

    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "results.json").write_text(json.dumps(
        {"seeds": [0, 1], "summary": {"fedavg": {}}, "per-seed": {}}))
    cmp.keep_earlier_tables(tmp_path / "cmp", True, ["fedavg"], [0, 1])
    assert (tmp_path / "cmp" / "results.json").exists()  # the same seeds and methods: kept
    cmp.keep_earlier_tables(tmp_path / "cmp", True, ["fedavg"], [0])
    assert not (tmp_path / "cmp" / "results.json").exists()  # seed 1's rows: set aside



def test_after_the_first_signal_the_rest_of_a_command_is_its_clean_up(caplog):
    """From a review: a second Ctrl-C that landed between two of the clean-up's shielded steps
    (after `flwr stop`, before the SuperLink's stop) raised there, and the SuperLink and the
    simulation were left running. After the first SIGINT, SIGTERM or SIGHUP every further one
    is noted until the command returns; the handlers before it come back."""
    import os
    import signal

    class Raised(Exception):  # not a KeyboardInterrupt: a regression fails this test, not the session
        pass

    def raising(signum, frame):
        raise Raised

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for first in signals:
        before = {s: signal.signal(s, raising) for s in signals}
        try:
            caplog.clear()
            with pytest.raises(KeyboardInterrupt) as e, cli.signals_interrupt():
                try:
                    os.kill(os.getpid(), first)
                finally:  # the clean-up on the way out, also a shielded step of it
                    for s in signals:
                        os.kill(os.getpid(), s)
                    with engine.shielded("a step"):  # noted, not passed on after it
                        os.kill(os.getpid(), signal.SIGINT)
            assert isinstance(e.value, cli.Terminated) is (first != signal.SIGINT)
            assert caplog.text.count("still stopping") == 4, caplog.text
            assert all(signal.getsignal(s) is raising for s in signals)
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)

def test_table_of_runs_made_separately(tmp_path, capsys, caplog):
    """`flowerbed table` puts real runs made apart (here in-process, as `flowerbed run` or a
    deployment leaves them) into one comparison, and refuses runs on other data."""
    from inprocess import run_inprocess

    tiny = {"num-server-rounds": 1, "train-samples": 300, "test-samples": 100, "min-clients": 2,
            "fraction-evaluate": 1.0, "local-test-fraction": 0.2, "output-dir": str(tmp_path),
            "batch-size": 16}
    for name, extra in [("fedavg", {}), ("prox-run", {"method": "fedprox", "lr": 0.05, "fedxds-lambda": 1.0,
                                                 "fault-crash-after": 5}),
                        ("other-seed", {"seed": 1})]:
        run_inprocess({**tiny, "method": "fedavg", **extra, "run-name": name}, 2)
    out = tmp_path / "table"
    assert cli.main(["table", str(tmp_path / "fedavg"), str(tmp_path / "prox-run"),
                     "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert capsys.readouterr().out.strip() == table.strip()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| fedavg", "| prox-run (fedprox)"]
    assert "differ between the runs: lr (fedavg: 0.01; prox-run (fedprox): 0.05)" in table
    assert "fedxds-lambda" not in table  # a FedXDS key: neither run reads it
    assert "fault-crash-after" not in table  # a crashed and resumed run equals an unbroken one
    # from a review of the outputs: a shared non-default setting was named nowhere
    assert "Settings not at their defaults, the same in every run that reads them: batch-size 16." in table
    res = json.loads((out / "results.json").read_text())
    summary = json.loads((tmp_path / "fedavg" / "summary.json").read_text())
    assert res["fedavg"]["final-accuracy"] == summary["final-accuracy"]
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "client-accuracy.png").exists()
    # runs that differ in their seed alone: a table over seeds, as `compare --seeds` writes it
    seeds_out = tmp_path / "over-seeds"
    assert cli.main(["table", str(tmp_path / "fedavg"), str(tmp_path / "other-seed"),
                     "--out", str(seeds_out)]) == 0
    res = json.loads((seeds_out / "results.json").read_text())
    finals = [json.loads((tmp_path / r / "summary.json").read_text())["final-accuracy"]
              for r in ("fedavg", "other-seed")]
    assert res["seeds"] == [0, 1]
    assert res["summary"]["fedavg"]["final-accuracy-mean"] == pytest.approx(sum(finals) / 2)
    assert "| fedavg | " in (seeds_out / "table.md").read_text() and (seeds_out / "accuracy.png").exists()
    for seed, run in ((0, "fedavg"), (1, "other-seed")):  # and a `compare --seeds` folder
        shutil.copytree(tmp_path / run, tmp_path / "seed-cmp" / f"seed-{seed}" / "fedavg")
    table, _ = run_table.table_of_runs([tmp_path / "seed-cmp"], tmp_path / "seed-cmp-table")
    assert json.loads((tmp_path / "seed-cmp-table" / "results.json").read_text())["seeds"] == [0, 1]
    capsys.readouterr()
    # ... but every method on the same seeds, one run each; refused with nothing written
    shutil.copytree(tmp_path / "fedavg", tmp_path / "again")
    for runs, message in [(["fedavg", "prox-run", "other-seed"], "not every method ran on the same "
                           "seeds (fedavg: 0, 1; fedprox: 0)"),
                          (["fedavg", "again", "other-seed"], "holds two runs of one seed: give one")]:
        assert cli.main(["table", *(str(tmp_path / r) for r in runs), "--out",
                         str(tmp_path / "refused")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    shutil.rmtree(tmp_path / "again")
    # a folder of runs stands for the runs in it; a run that did not finish is a failed row
    (tmp_path / "other-seed" / "config.json").unlink()  # (not a run any more)
    (tmp_path / "link").symlink_to(tmp_path / "fedavg")  # a run linked twice is one row
    (tmp_path / "prox-run" / "summary.json").unlink()
    table, _ = run_table.table_of_runs([tmp_path], out)
    assert "| prox-run (fedprox) | failed |" in table and table.count("| fedavg | ") == 1
    assert cli.main(["table", str(tmp_path), "--out", str(out)]) == 1  # a row failed: as compare
    assert "1 run(s) did not finish or cannot be read: prox-run (fedprox)" in caplog.text
    assert len(list(out.glob("table.old-*.md"))) == 2  # the earlier tables were set aside
    assert cli.main(["table", str(tmp_path / "nothing")]) == 2
    assert "argument 'RUN_DIR' = " in (err := capsys.readouterr().err) and "not a folder" in err
    # from a review: runs whose folders share a name (two comparisons' seed-0/fedavg) keep a
    # row each; a folder name with '@' is a label, not a variant; different round counts are
    # not stated as one; --out inside a run is refused (it would replace the run's plot)
    for parent in ("a/seed-0", "b/seed-0"):
        shutil.copytree(tmp_path / "fedavg", tmp_path / "two" / parent / "fedavg")
    shutil.copytree(tmp_path / "fedavg", tmp_path / "two" / "fedavg@home")
    cfg = tmp_path / "two" / "b" / "seed-0" / "fedavg" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "num-server-rounds": 2}))
    runs = [tmp_path / "two" / p for p in ("a/seed-0/fedavg", "b/seed-0/fedavg", "fedavg@home")]
    table, _ = run_table.table_of_runs(runs, tmp_path / "two-table")
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")][1:]
    assert rows == ["| a/seed-0/fedavg", "| b/seed-0/fedavg", "| fedavg@home"]
    assert "each run's own number of rounds" in table and "num-server-rounds (" in table
    assert "different software" not in table  # one machine: said only where they differ
    other = {"torch": "9.9", "flwr": "1.42.0"}  # as from another machine
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "software": other}))
    table, _ = run_table.table_of_runs(runs, tmp_path / "two-table")
    assert "The runs ran on different code or software: " in table and "b/seed-0/fedavg: torch 9.9" in table
    # the same packages, other flowerbed code (a run resumed after a change): said too (a review)
    from flowerbed.results import code_digest, software

    assert len(code_digest()) == 12 and software()["flowerbed"] == code_digest()
    changed = {**json.loads(cfg.read_text()), "software": {**software(), "flowerbed": "0" * 12}}
    cfg.write_text(json.dumps(changed))
    table, _ = run_table.table_of_runs(runs, tmp_path / "two-table")
    assert "b/seed-0/fedavg: torch" in table and "flowerbed code 000000000000" in table
    assert cli.main(["table", *map(str, runs[:2]), "--out", str(runs[0] / "t")]) == 2
    assert "inside one" in capsys.readouterr().err
    (tmp_path / "seeds" / "seed-0").mkdir(parents=True)
    assert cli.main(["table", str(tmp_path / "seeds")]) == 2
    assert "holds no run (no config.json in it, in a folder directly under it, or in its " \
           "seed-<s>/ folders)" in capsys.readouterr().err


def test_ctrl_c_in_a_comparison_leaves_the_table_of_the_runs_that_ended(tmp_path, monkeypatch, caplog):
    """From a README walk-through: Ctrl-C during the second method left results.json but no
    table.md or plot for the first. (The engine is faked: the real Ctrl-C path through flwr is
    tested in test_e2e; this is the comparison's own bookkeeping.)"""
    from flowerbed import engine

    def fake_run(home, conn, rc, fed, log_file=None):
        if rc["run-name"] != "fedavg":
            raise KeyboardInterrupt
        run = Path(rc["output-dir"]) / "fedavg"
        run.mkdir(exist_ok=True)
        (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "accuracy": 0.1}) + "\n"
                                           + json.dumps({"round": 1, "accuracy": 0.5}) + "\n")
        return {"final-accuracy": 0.5, "rounds": 1}

    monkeypatch.setattr(engine, "local_superlink", lambda: contextlib.nullcontext((None, None)))
    monkeypatch.setattr(engine, "flwr_run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        cmp.compare(["fedavg", "fedprox"], {"num-server-rounds": 1}, 2, out=tmp_path)
    assert "| fedavg | 50.00 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "accuracy.png").exists() and "interrupted" in caplog.text

    def finished_then_interrupted(home, conn, rc, fed, log_file=None):  # the engine's summary on it
        e = KeyboardInterrupt()
        e.summary = fake_run(home, conn, rc, fed)
        raise e

    monkeypatch.setattr(engine, "flwr_run", finished_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        cmp.compare(["fedavg"], {"num-server-rounds": 1}, 2, out=tmp_path / "one")
    assert "| fedavg | 50.00 |" in (tmp_path / "one" / "table.md").read_text()


def test_flowerbed_methods_lists_every_method(capsys):
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    from flowerbed.registry import METHODS

    assert all(f"{m} " in out and METHODS[m].summary in out for m in METHODS)


def fake_run(root: Path, name: str, drop: tuple[str, ...] = (), clients: int = 3, **rc) -> Path:
    """A finished run's folder as the ServerApp leaves it (config, summary, metrics), for the
    table's own logic; `drop`: keys an older config lacks."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {**Config.from_run_config(rc).to_run_config(), "num-partitions": clients,
           "run-name": name, "output-dir": str(root)}
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in drop}))
    acc = 0.5 + 0.01 * rc.get("seed", 0)
    rows = [{"round": r, "accuracy": acc} for r in range(3)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (d / "summary.json").write_text(json.dumps({"final-accuracy": acc, "best-accuracy": acc, "rounds": 2,
                                                "initial-accuracy": 0.1, "rounds-aggregated": 2}))
    return d


def test_table_over_seeds_groups_by_what_each_method_reads(tmp_path, capsys):
    """Found by a review of the seeds table: local-epochs/local-test-fraction were taken for the
    `local` method's keys (runs on other local test splits were tabled together); a key a
    method never reads, or one an older config lacks, split a method into rows; the second
    setting of a method was labelled as the plain method; a comparison's set-aside runs
    counted as runs; a seed plus another split key was refused naming the seed; a config
    without a seed was a traceback."""
    def table(*runs: Path) -> str:
        return run_table.table_of_runs(list(runs), tmp_path / f"t{len(list(tmp_path.glob('t*')))}")[0]

    a = fake_run(tmp_path, "a", method="fedavg")
    b = fake_run(tmp_path, "b", method="fedavg", **{"local-test-fraction": 0.3, "local-epochs": 3})
    with pytest.raises(ConfigError, match="their local-test-fraction differs"):
        table(a, b)
    runs = [fake_run(tmp_path, "avg0", method="fedavg", seed=0),
            fake_run(tmp_path, "avg1", method="fedavg", seed=1, drop=("fedxds-sparsity",),
                     **{"fedxds-lambda": 1.0, "probe-every": 5, "proximal-mu": 0.5}),  # not FedAvg's
            fake_run(tmp_path, "prox0", method="fedprox", seed=0),
            fake_run(tmp_path, "prox1", method="fedprox", seed=1)]
    rows = [r.split(" | ")[0] for r in table(*runs).splitlines() if r.startswith("| ")][1:]
    assert rows == ["| fedavg", "| fedprox"]
    lr = [fake_run(tmp_path, f"lr{v}-{s}", method="fedavg", seed=s, lr=v)
          for v in (0.01, 0.05) for s in (0, 1)]
    rows = [r.split(" | ")[0] for r in table(*lr).splitlines() if r.startswith("| ")][1:]
    assert rows == ["| fedavg", "| fedavg@lr=0.05"]  # as compare's variants: 0.01 is the default
    cmp_dir = tmp_path / "cmp"
    for s in (0, 1):
        shutil.copytree(runs[s], cmp_dir / f"seed-{s}" / "fedavg")
    shutil.copytree(runs[0], cmp_dir / "seed-0" / "fedavg.old-20261205-101010")  # set aside by a rerun
    assert "| fedavg | " in table(cmp_dir)
    with pytest.raises(ConfigError, match=r"holds two runs of one seed: .*seed 0: .*/avg0; seed 0: .*/again"):
        table(runs[0], shutil.copytree(runs[0], tmp_path / "again"), runs[1])
    other = fake_run(tmp_path, "five", method="fedavg", seed=1, clients=5)
    with pytest.raises(ConfigError, match="their num-partitions differs"):
        table(runs[0], other)
    # a second review: a key older configs lack may not merge other settings into one row;
    # the seed is not "a setting that differs"; labels as compare's variants; no method: FedAvg
    old = [fake_run(tmp_path, f"old{s}", method="fedavg", seed=s, drop=("fault-fraction",)) for s in (0, 1)]
    prox = [fake_run(tmp_path, f"pf{s}", method="fedprox", seed=s, **{"fault-fraction": 0.5 * s})
            for s in (0, 1)]
    with pytest.raises(ConfigError, match="its runs differ in fault-fraction"):
        table(*old, *prox)
    text = table(runs[1], runs[3], runs[2], runs[0])
    assert "Settings that differ" not in text
    # where a run ran is no setting: a run from before server-device held the device used there
    dev = [fake_run(tmp_path, f"dev{s}", method="fedavg", seed=s, **({"server-device": "cpu"} if s else {}))
           for s in (0, 1)]
    text = table(*dev)
    assert "| fedavg | " in text and "server-device" not in text
    fx = [fake_run(tmp_path, f"fx{b}{s}", method="fedx", seed=s, **{"fedx-base": b})
          for b in ("simclr", "byol") for s in (0, 1)]
    rows = [r.split(" | ")[0] for r in table(*fx).splitlines() if r.startswith("| ")][1:]
    assert rows == ["| fedx", "| fedx@fedx-base='byol'"]
    cfg = json.loads((runs[0] / "config.json").read_text())
    (runs[0] / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "method"}))
    assert "| fedavg | " in table(*runs)
    cfg = json.loads((runs[3] / "config.json").read_text())
    for seed in (None, True):
        (runs[3] / "config.json").write_text(json.dumps({**cfg, "seed": seed}))
        with pytest.raises(ConfigError, match="its config.json has no integer seed"):
            table(*runs)


def test_a_closed_console_does_not_stop_a_logged_run(tmp_path, monkeypatch):
    """Found by a review: `flowerbed compare ... | head -3` stopped the run once head exited:
    the progress echo's BrokenPipeError went through flwr_run's Ctrl-C path."""
    import io
    import subprocess
    import sys

    summary_file = tmp_path / "p" / "summary.json"
    code = ("import json, pathlib\n"
            "for r in range(3): print('INFO flowerbed: [round %d/2] acc 0.5' % r)\n"
            f"pathlib.Path({str(summary_file)!r}).write_text(json.dumps({{'rounds': 2}}))")

    class Run(subprocess.Popen):  # a ServerApp's three progress lines, then its summary
        def __init__(self, cmd, **kw):
            super().__init__([sys.executable, "-c", code], stdout=kw["stdout"], stderr=kw["stderr"],
                             text=True)

    class Closed(io.TextIOBase):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    (tmp_path / "p").mkdir()
    monkeypatch.setattr(cmp.engine.subprocess, "Popen", Run)
    monkeypatch.setattr(sys, "stdout", Closed())
    summary = cmp.engine.flwr_run(tmp_path, "c", {"output-dir": str(tmp_path), "run-name": "p"}, None,
                                  log_file=tmp_path / "p.log")
    assert summary == {"rounds": 2} and "[round 2/2]" in (tmp_path / "p.log").read_text()


def test_a_closed_output_ends_the_command_quietly(monkeypatch, capsys):
    """Found by a review: `flowerbed compare ... | head` ended, after its runs, with
    'flowerbed: error: [Errno 32] Broken pipe' and exit 1, as if something had failed."""
    import signal

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_methods", closed)
    assert cli.main(["methods"]) == 128 + signal.SIGPIPE
    assert "error" not in capsys.readouterr().err


def test_flwr_simulation_noise_stays_out_of_the_console_but_in_the_log(tmp_path, monkeypatch, capsys):
    """flwr warns on every simulation start that the default SuperNode count changed (we always
    set num-supernodes) and advises `flwr federation` to resize; each Ray actor says it is
    'manually terminated' when a run ends normally. The console skips those; the log keeps all."""
    import subprocess
    import sys

    noise = ["WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.",
             "INFO :      To change federation size, use the following command:",
             "INFO :      \tflwr federation simulation-config @none/default <superlink> --num-supernodes <N>",
             "(ClientAppActor pid=7) WARNING :   Manually terminating ClientAppActor"]
    lines = ["\x1b[92mINFO \x1b[0m:      Federation `@none/default` (2 simulated SuperNodes)", *noise,
             "INFO flowerbed: [round 1/1] acc 0.5"]
    code = (f"import json, pathlib\nfor s in {lines!r}: print(s)\n"
            f"pathlib.Path({str(tmp_path / 'p' / 'summary.json')!r}).write_text('{{}}')")

    class Run(subprocess.Popen):
        def __init__(self, cmd, **kw):
            super().__init__([sys.executable, "-c", code], stdout=kw["stdout"], stderr=kw["stderr"],
                             text=True)

    (tmp_path / "p").mkdir()
    monkeypatch.setattr(cmp.engine.subprocess, "Popen", Run)
    rc = {"output-dir": str(tmp_path), "run-name": "p"}
    cmp.engine.flwr_run(tmp_path, "c", rc, {"num-supernodes": 2}, log_file=tmp_path / "p.log", tee=True)
    shown = capsys.readouterr().out
    assert "(2 simulated SuperNodes)" in shown and "[round 1/1]" in shown
    assert not any(n.split(":", 1)[1].strip() in shown for n in noise)
    assert all(n in (tmp_path / "p.log").read_text() for n in noise)
    assert "\x1b[92mINFO" in shown and "\x1b" not in (tmp_path / "p.log").read_text()  # no colours in a file
    cmp.engine.flwr_run(tmp_path, "c", rc, {"num-supernodes": 2})  # no log file: the console only
    assert "Manually terminating" not in capsys.readouterr().out
    cmp.engine.flwr_run(tmp_path, "c", rc, None)  # a deployment: nothing of it is flwr's simulation
    assert "Manually terminating" in capsys.readouterr().out


def test_an_interrupted_run_says_so_in_its_log(tmp_path, monkeypatch, caplog):
    """From a deployment walk-through: after Ctrl-C a run's log ended at its last line of
    output, with nothing saying the run had been stopped."""
    import io
    import subprocess
    import sys

    class Run(subprocess.Popen):  # a run that prints one line, then Ctrl-C while it goes on
        def __init__(self, cmd, **kw):
            super().__init__([sys.executable, "-c", "print('[ROUND 1/3]', flush=True); "
                              "import time; time.sleep(30)"], stdout=kw["stdout"],
                             stderr=kw["stderr"], text=True)

    class Interrupting(io.TextIOBase):  # Ctrl-C arrives while the line is echoed
        def write(self, s):
            raise KeyboardInterrupt

    monkeypatch.setattr(cmp.engine.subprocess, "Popen", Run)
    monkeypatch.setattr(sys, "stdout", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        cmp.engine.flwr_run(tmp_path, "c", {"output-dir": str(tmp_path), "run-name": "p"}, None,
                            log_file=tmp_path / "p.log", tee=True)
    log = (tmp_path / "p.log").read_text()
    assert "[ROUND 1/3]" in log
    assert log.rstrip().endswith("interrupted (KeyboardInterrupt): the run is stopped")
    # a README walk-through: a SIGTERM just after the ServerApp wrote its summary (flwr still
    # streaming) said the run was stopped, told to `flwr stop` a run on a SuperLink already gone,
    # and compare wrote no table: the run had finished
    (tmp_path / "p" / "summary.json").parent.mkdir()
    stops = []
    monkeypatch.setattr(cmp.engine, "stop_run", lambda *a: stops.append(a))

    class Finishing(io.TextIOBase):
        def write(self, s):
            (tmp_path / "p" / "summary.json").write_text(json.dumps({"final-accuracy": 0.5}))
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdout", Finishing())
    with pytest.raises(KeyboardInterrupt) as e:
        cmp.engine.flwr_run(tmp_path, "c", {"output-dir": str(tmp_path), "run-name": "p"}, None,
                            log_file=tmp_path / "p.log", tee=True)
    assert e.value.summary == {"final-accuracy": 0.5} and stops == []
    assert "interrupted after run 'p' had finished: its results are in" in caplog.text
    assert (tmp_path / "p.log").read_text().rstrip().endswith(
        "interrupted (KeyboardInterrupt): the run had finished; its results are kept")


@pytest.mark.parametrize("module, shown", [("ray._private.worker", False), ("ray.other", True)])
def test_rays_gpu_tip_is_silenced_in_flwrs_processes_and_nothing_else(tmp_path, module, shown):
    """Ray's driver warned on every simulation start that it will stop hiding GPUs from actors
    given none (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO); training.pick_device does not rely on it."""
    import subprocess
    import sys

    env = cmp.engine.flwr_env(tmp_path)
    code = (f"import warnings; warnings.warn_explicit('Tip: In future versions of Ray', FutureWarning, "
            f"'worker.py', 1, module={module!r})")
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    assert ("Tip: In future versions of Ray" in err) == shown and "Invalid -W option" not in err
    assert cmp.engine.flwr_env(tmp_path)["PYTHONWARNINGS"].endswith(cmp.engine.RAY_GPU_TIP)


def test_a_table_says_what_final_acc_measures_where_a_method_measures_its_own_way():
    """From a review of the outputs: a table of fedsimclr and fedx never said its figures were
    linear-probe accuracies (the note came only with a client acc column)."""
    ssl = cmp.markdown_table({"fedx": {"method": "fedx", "final-accuracy": 0.5}}, {}, 2)
    assert ("for fedsimclr, fedbyol, fedu, fedmoco, fedprotocl, moon-unsup, fedx linear-probe accuracy "
            "(test set)") in ssl
    assert "final acc:" not in cmp.markdown_table({"fedavg": {"method": "fedavg", "final-accuracy": 0.5}},
                                                  {}, 2)
    seeds = cmp.seeds_table({"fedcc@lr=0.1": {"final-accuracy": {0: 0.5}, "seeds-ok": [0],
                                              "seeds-failed": [], "final-accuracy-mean": 0.5}}, {}, 2, [0])
    assert "for fedcc, feddf, fedmd, fedct ensemble accuracy (test set)" in seeds


def test_a_runs_own_plot_says_what_ran_and_what_it_measures(tmp_path, monkeypatch):
    """From a review of the outputs: a run's accuracy.png was titled by its folder name alone,
    its y-axis 'accuracy' whether that was the test set, a linear probe or personalised."""
    from flowerbed import results

    drawn = []
    monkeypatch.setattr(results, "plot_curves", lambda curves, out, **kw: drawn.append(kw))
    cfg = {"method": "fedx", "dataset": "fashion-mnist", "partition": "dirichlet:0.5",
           "num-partitions": 10, "seed": 1}
    with results.RunDir(str(tmp_path), "r", cfg) as run:
        run.log_round({"round": 1, "accuracy": 0.5})
        run.finish({})
    assert drawn[-1]["title"] == "r: fedx on fashion-mnist, dirichlet:0.5, 10 clients, seed 1"
    assert drawn[-1]["ylabel"] == "linear-probe accuracy (test set)"
    assert results.measure("fedfew").startswith("personalised") and results.measure("fedcc").startswith(
        "ensemble") and results.measure("fedavg") == "accuracy (test set)"
    assert results.measure("fedade").startswith("online accuracy")


def test_plots_keep_a_readable_y_span():
    """From a review of the outputs: Fed-ADE's two curves, 0.733 to 0.740, filled the whole plot
    (a 0.7-point change looked like a large one), one hiding the other."""
    from flowerbed.results import min_span

    assert min_span(0.733, 0.740, 0.05) == pytest.approx((0.7115, 0.7615))
    assert min_span(0.1, 0.9, 0.05) == (0.1, 0.9)


def test_results_files_are_on_disk_before_they_replace_the_old_ones(tmp_path, monkeypatch):
    """From a review: summary.json's presence says "finished"; renamed unsynced, a power loss
    could leave it empty, and a resume was then refused as finished."""
    import os

    from flowerbed import results

    synced = []
    real = os.fsync
    monkeypatch.setattr(results.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    results.write_json_atomic(tmp_path / "summary.json", {"a": 1})
    assert synced and json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_seeds_final_from_an_earlier_round_is_marked_in_the_table_over_seeds():
    """From a review: the single-run table marked it '(round 1)', the table over seeds averaged
    it with the other seeds' last-round figures without a word."""
    def run(acc, final_round):
        return {"final-accuracy": acc, "best-accuracy": acc, "final-round": final_round, "rounds": 3}

    st = cmp.seed_stats({0: run(0.4, 1), 1: run(0.9, 3), 2: run(0.9, 3)})
    table = cmp.seeds_table({"ditto": st}, {"num-server-rounds": 3}, 3, [0, 1, 2])
    assert "73.33 ± 28.87 (1 from an earlier round)" in table
    assert "40.00 (round 1) (s0), 90.00 (s1), 90.00 (s2)" in table
    back = json.loads(json.dumps(st))  # as results.json holds it: the seeds are str keys
    assert "40.00 (round 1) (s0)" in cmp.seeds_table({"ditto": back}, {}, 3, [0, 1, 2])


def test_a_deployment_run_whose_stream_ends_early_says_how_to_follow_or_stop_it(tmp_path, monkeypatch):
    """From a review: `flwr run --stream` ending on a lost connection left the ServerApp going
    on the deployment's SuperLink, and the error named neither its run id nor `flwr stop`."""
    fake = tmp_path / "flwr"
    fake.write_text("#!/bin/sh\necho 'Successfully started run 4242'\necho 'connection lost'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cmp.engine, "_bin", lambda name: str(fake))
    rc = {"output-dir": str(tmp_path), "run-name": "gone"}
    with pytest.raises(cmp.engine.RunFailed, match="`flwr stop 4242 dep` stops it"):
        cmp.engine.flwr_run(tmp_path, "dep", rc, None, quiet=True)
