"""Benchmarks keep the splits an earlier run measured only when those were measured the same way."""

import json

import pytest

import benchmarks.common as common


def test_kept_splits_only_with_the_same_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    base = {"num-server-rounds": 10, "seed": 0, "train-samples": 12000}
    (tmp_path / "b.json").write_text(json.dumps({
        "results": {"s1": {"m": 1}, "s2": {"m": 2}, "s3": {"m": 3}},
        "split-configs": {"s1": base, "s2": {**base, "num-server-rounds": 30},
                          "s3": {**base, "train-samples": 6000}}}))
    results, configs = common.kept_splits("b", {**base, "num-server-rounds": 5},
                                          vary=("num-server-rounds",))
    assert results == {"s1": {"m": 1}, "s2": {"m": 2}}  # s3 had other data: dropped
    assert configs["s2"]["num-server-rounds"] == 30
    assert common.kept_splits("b", {**base, "num-server-rounds": 5}) == ({}, {})
    assert common.kept_splits("missing", base) == ({}, {})
    assert common.kept_splits("b", {**base, "lr": 0.01, "num-server-rounds": 5},  # lr's default
                              vary=("num-server-rounds",))[0] == results


def test_merged_rows_overlay_the_kept_ones_in_order():
    kept = {"a": 1, "b": 2, "stale": 9}
    assert common.merged_rows(kept, {"b": 20, "c": 3}, ["c", "b", "a"]) == {"c": 3, "b": 20, "a": 1}


def test_only_the_benchmarks_own_rows_can_be_run():
    """A row spelt otherwise (fedfew-server-lr=3 for =3.0) ran for an hour, then merged_rows
    dropped it from the table without a word."""
    assert common.rows_to_run("b,a", ["a", "b", "c"]) == ["b", "a"]
    with pytest.raises(SystemExit, match=r"not rows of this benchmark: \['fedfew@fedfew-server-lr=3'\]"):
        common.rows_to_run("fedfew@fedfew-server-lr=3", ["fedfew@fedfew-server-lr=3.0"])


def test_fedade_plot_per_time_step(tmp_path, monkeypatch):
    """The Fed-ADE benchmark's plot reads each variant's run and draws one point per time step."""
    import benchmarks.fedade as fedade
    from flowerbed.compare import run_label

    monkeypatch.setattr(fedade, "RESULTS", tmp_path)
    for variant in fedade.VARIANTS:  # 3 steps x 2 rounds: pre-accuracy first, online at step end
        run = tmp_path / "runs" / "bench-fedade-label-lin" / run_label(variant)
        run.mkdir(parents=True)
        rows = [{"round": 0}] + [{"round": r, "time-step": (r - 1) // 2,
                                  "accuracy": 0.8 if r % 2 == 0 else None,
                                  "pre-accuracy": 0.7 if r % 2 else None} for r in range(1, 7)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = fedade.plot_setting(tmp_path / "runs", "label", "lin")
    assert out == tmp_path / "fedade-label-lin.png" and out.stat().st_size > 1000


def test_fedfew_table_reports_bytes_and_checks_the_default_only():
    from benchmarks.fedfew import UP, render

    row = {"client-accuracy": 0.9, "client-accuracy-min": 0.5, "client-accuracy-std": 0.1,
           "jain-index": 0.99}
    results = {"dirichlet:0.1": {"fedfew": {**row, UP: 19.96e6}, "ifca": {**row, UP: 6.65e6},
                                 "fedavg": {**row, "client-accuracy": 0.8},
                                 "fedfew@fedfew-eval='local'": {**row, "client-accuracy": 0.99}}}
    table, checks = render(results, {"dirichlet:0.1": {"num-server-rounds": 30}})
    assert "| dirichlet:0.1 | 30 | fedfew | 90.00 | 50.00 | 0.100 | 0.990 | 19.96 |" in table
    assert "| dirichlet:0.1 | 30 | fedavg | 80.00 | 50.00 | 0.100 | 0.990 | - |" in table
    assert checks["dirichlet:0.1 fedfew >= ifca"] and checks["dirichlet:0.1 fedfew >= fedavg + 5pp"]
    assert not any("eval" in k for k in checks)  # the official-evaluation row is not checked
    assert checks["pathological:2 fedfew >= ifca"] is None  # split not measured


def test_fedade_bounds_scale_every_variant_alike():
    """The bounds sweep scales both bounds, and FixLR(low/mid/high) follow them."""
    from benchmarks.fedade import HI, LO, VARIANTS
    from benchmarks.fedade_bounds import scaled
    from flowerbed.compare import parse_variant

    assert scaled(1)[0] == VARIANTS[:4]  # scale 1 is the Fed-ADE benchmark's own variants
    variants, bounds = scaled(10)
    assert bounds == {"fedade-lr-min": LO * 10, "fedade-lr-max": HI * 10}
    lrs = [parse_variant(v)[1]["fedade-fixed-lr"] for v in variants[1:]]
    assert lrs == pytest.approx([LO * 10, (LO + HI) * 5, HI * 10])


def test_fedade_bounds_table_orders_settings_then_pixels_then_bounds():
    from benchmarks.fedade_bounds import render

    def row(lo, mid, **extra):
        acc = {"Fed-ADE": 0.9, "FixLR(low)": 0.8, "FixLR(mid)": mid, "FixLR(high)": 0.7}
        return {"bounds": [lo, lo * 100], "mean-accuracy": acc, "fedade-mean-lr": lo * 5, **extra}

    # rows written before the pixels option carry no "pixels": standardised
    table = render({"covariate/lin x1": row(1e-5, 0.9), "label/ber x1": row(1e-5, 0.9),
                    "label/lin x1 raw": row(1e-5, 0.9, pixels="raw"),
                    "label/lin x100": row(1e-3, 0.8755), "label/lin x1": row(1e-5, 0.9033)}
                   ).splitlines()
    assert [r.split(" | ")[:4] for r in table[2:]] == [
        ["| label", "lin", "raw", "[1e-05, 1e-03]"],
        ["| label", "lin", "standardised", "[1e-05, 1e-03]"],
        ["| label", "lin", "standardised", "[1e-03, 1e-01]"],
        ["| label", "ber", "standardised", "[1e-05, 1e-03]"],
        ["| covariate", "lin", "standardised", "[1e-05, 1e-03]"]]
    assert table[4].endswith("| +2.45 | 5.0e-03 |")


def test_fedx_keeps_earlier_rows_only_with_the_same_settings_and_seeds(tmp_path, monkeypatch):
    import benchmarks.fedx as fedx

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    cfg = {"num-server-rounds": 10, "train-samples": 20000}
    (tmp_path / "fedx.json").write_text(json.dumps({
        "config": cfg, "seeds": [0, 1, 2], "results": {"fedx": {"x": 1}},
        "machine": {"date": "2026-12-01 22:19"}, "note": "Older note."}))
    rows, old = fedx.kept_rows(cfg, [0, 1, 2])
    assert rows == {"fedx": {"x": 1}}
    assert fedx.kept_rows({**cfg, "num-server-rounds": 20}, [0, 1, 2]) == ({}, {})
    assert fedx.kept_rows(cfg, [0]) == ({}, {})
    # a preset that later names a key at its default measures what it measured: kept (the
    # MoCo rows of 2026-12-06 dropped every earlier row when fedx-tau-local = 0.1 was added)
    assert fedx.kept_rows({**cfg, "fedx-tau-local": 0.1}, [0, 1, 2])[0] == {"fedx": {"x": 1}}
    assert fedx.kept_rows({**cfg, "fedx-tau-local": 0.2}, [0, 1, 2]) == ({}, {})
    old["row-dates"] = {"fedx": "2026-12-01 22:19", "fedbyol": "2026-11-30 10:00"}
    assert fedx.row_dates(["fedbyol"], {"fedx": {}, "fedu": {}}, old, "2026-12-02 09:25") == {
        "fedx": "2026-12-01 22:19", "fedu": "2026-12-01 22:19", "fedbyol": "2026-12-02 09:25"}


def test_seeds_table_reads_summaries_read_back_from_json():
    """A summary read back from results.json has str seed keys; the per-seed column still shows."""
    from flowerbed.compare import seed_stats, seeds_table

    summary = {"fedx": seed_stats({0: {"final-accuracy": 0.85}, 1: {"final-accuracy": 0.86}})}
    for s in (summary, json.loads(json.dumps(summary))):
        assert "| fedx | 85.50 ± 0.71 | 85.00 (s0), 86.00 (s1) |" in seeds_table(s, {}, 10, [0, 1])


def test_readme_blocks_are_rendered_from_the_results():
    """The README's "Measured" section and the checks at a glance in "Known gaps" are what
    benchmarks.report renders from benchmarks/results: no figure there is typed by hand or stale."""
    import re

    from benchmarks.report import GLANCE_START, README, RUNS, START, _anchor, render_runs, write_readme

    readme = README.read_text()
    assert START in readme and GLANCE_START in readme
    assert write_readme(readme) == readme, "run: .venv/bin/python -m benchmarks.report --write-readme"
    # the notes moved out of the README (a 10,000-character paragraph under a table) are there too,
    # and every link into them lands on a heading
    runs = RUNS.read_text()
    assert runs == render_runs(), "run: .venv/bin/python -m benchmarks.report --write-readme"
    links = re.findall(r"\(docs/benchmark-runs\.md#([^)]+)\)", readme)
    headings = {_anchor(h) for h in re.findall(r"^## (.+)$", runs, flags=re.M)}
    assert len(links) >= 8 and set(links) <= headings


def test_glance_statuses_follow_the_checks(monkeypatch):
    """A check's status in the at-a-glance table is the benchmark's own verdict."""
    import benchmarks.report as report

    monkeypatch.setattr(report, "read_result", lambda name: {
        "fedxds_privacy": {"checks": {"inversion SSIM masked < unmasked": False},
                           "masked": {"inversion-ssim": 0.8}, "unmasked": {"inversion-ssim": 0.7}},
        "fedfew": {"checks": {}, "results": {"dirichlet:0.1": {}}},  # an incomplete result
    }.get(name))
    table = report.glance()
    assert "| #5 FedXDS | inversion SSIM masked < unmasked | not met | 0.800 vs 0.700 |" in table
    assert "| fedfew | - | n/a | benchmarks/results/fedfew.json lacks 'fedfew' |" in table


def test_benchmarks_refuse_bad_input_before_running_and_keep_their_results():
    """From a review: `benchmarks.foundation --methods fedavgg` ran, failed, replaced the stored
    results with one error row and exited 0; `fedcc --splits bogus:3` added a bogus split;
    `default_run --help` started the 3-minute benchmark. Now each run is checked first, as
    `flowerbed compare` does, and a script exits 1 when a run failed."""
    import subprocess
    import sys

    from flowerbed.config import ConfigError

    stored = (common.RESULTS / "foundation-dirichlet0.5.json").read_bytes()
    for argv, said in ((["foundation", "--methods", "fedavgg"], "benchmark: run-config 'method'"),
                       (["fedcc", "--rounds", "0"], "benchmark: run-config 'num-server-rounds'"),
                       (["fedcc", "--splits", "bogus:3"], "not splits of this benchmark")):
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{argv[0]}", *argv[1:]],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and done.stderr.startswith(said), done.stderr[-500:]
    assert (common.RESULTS / "foundation-dirichlet0.5.json").read_bytes() == stored
    helped = subprocess.run([sys.executable, "-m", "benchmarks.default_run", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "What `make run` does" in helped.stdout
    with pytest.raises(ConfigError, match="'--num-clients' = 3"):
        common.checked(["fedavg"], {"partition": "pathological:1", "train-samples": 2}, 3)


def test_benchmark_options_of_the_wrong_form_are_refused_by_the_parser():
    """From a review: `fedx --seeds a,b`, `fedade --settings label` and the like were
    tracebacks; `fedx --rounds 0` was silently ignored."""
    import argparse

    from flowerbed.cli import int_in

    assert common.seed_list("0,1,2") == [0, 1, 2]
    assert common.setting_list("label/lin,covariate/ber") == [("label", "lin"), ("covariate", "ber")]
    assert common.scale_list("1,0.5") == [1.0, 0.5] and int_in(1)("3") == 3
    for parse, text in ((common.seed_list, "a,b"), (common.seed_list, "-1"), (common.scale_list, "0"),
                        (common.setting_list, "label"), (int_in(1), "0")):
        with pytest.raises(argparse.ArgumentTypeError, match="is not"):
            parse(text)


@pytest.mark.parametrize("script, argv", [
    ("fedxds", []), ("fedfew", []), ("fedcc", []), ("fedade", ["--steps", "2"]),
    ("fedade_bounds", ["--steps", "2"]), ("foundation", [])])
def test_a_benchmark_whose_runs_failed_ends_with_one_line(script, argv, tmp_path, monkeypatch):
    """Regression: a failed run (its summary holds only the error, its folder no metrics) made
    fedxds, fedfew and fedade_bounds end in a KeyError or FileNotFoundError after hours of the
    other runs. Now every script finishes its tables (the failed rows empty, their checks not
    met) and exits with the failed runs named."""
    import importlib
    import sys

    mod = importlib.import_module(f"benchmarks.{script}")

    def failed_compare(methods, overrides, num_clients, out, **kw):
        out.mkdir(parents=True, exist_ok=True)  # as compare: every run's folder and summary
        (out / "results.json").write_text(json.dumps({m: {"error": "boom"} for m in methods}))
        return ""

    (tmp_path / "results").mkdir()
    for m in (mod, common):
        monkeypatch.setattr(m, "RESULTS", tmp_path / "results", raising=False)
    monkeypatch.setattr(mod, "ROOT", tmp_path, raising=False)
    monkeypatch.setattr(mod, "compare", failed_compare)
    monkeypatch.setattr(mod, "checked", lambda *a, **k: None)
    monkeypatch.setattr(mod, "pretrained", lambda cfg: None, raising=False)
    monkeypatch.setattr(common, "FAILED", [])
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit, match=r"benchmark: \d+ run\(s\) failed: bench-"):
        common.run_main(mod.main)
    import benchmarks.report as report  # and the README's sections render those results

    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    # (foundation keeps the stored results when every run failed: nothing to render)
    assert (script == "foundation" or report.render()) and "lacks" not in report.glance()
