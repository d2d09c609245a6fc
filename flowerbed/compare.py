"""The launcher: several methods through the same Flower apps, identical partitions and seeds."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowerbed import engine
from flowerbed.config import (
    Config,
    ConfigError,
    defaults,
    parse_overrides,
    reads,
)
from flowerbed.results import (
    GLOBAL_MEASURE,
    folder_in_use,
    md_table,
    new_folder,
    own_measures,
    pct,
    plot_curves,
    read_metrics,
    refuse_live_writer,
)

log = logging.getLogger("flowerbed")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``method`` or ``method@key=value@key=value`` -> (label, run-config overrides).

    E.g. ``fedx@fedx-base='byol'`` runs FedX over BYOL; the label names its run directory.
    """
    method, *pairs = spec.split("@")
    extra = parse_overrides([" ".join(pairs)], f"--methods {spec}") if pairs else {}
    return spec, {"method": method.strip(), **extra}


def _rounds(overrides: dict[str, Any]) -> str:
    n = overrides.get("num-server-rounds")
    if n is None:  # runs tabulated together that ran different numbers of rounds
        return "each run's own number of rounds (listed below)"
    return f"{n} round{'' if n == 1 else 's'}"


def run_label(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.replace("'", ""))


def check_labels(methods: list[str], seeds: list[int] | None = None) -> None:
    """Each spec once, no two specs sharing a run directory, and no ``@seed=`` variant in a
    comparison over ``seeds`` (each seed would rerun its one seed)."""
    if not methods:
        raise ConfigError("--methods", "", "name at least one method, e.g. --methods fedavg,fedprox")
    seen: dict[str, str] = {}
    for m in methods:
        if any(not part.strip() for part in m.split("@")):
            raise ConfigError("--methods", m, "an empty part between '@'s; write method@key=value")
        if seeds and "seed" in parse_variant(m)[1]:
            raise ConfigError("--methods", m, "a method@seed=... variant cannot be compared over "
                              "--seeds (every seed would run its one seed)")
        if (other := seen.setdefault(run_label(m), m)) is not m:
            raise ConfigError("--methods", ",".join(methods), f"{other!r} and {m!r} " + (
                "are given twice" if other == m else f"would share the run folder {run_label(m)}"))


def default_out() -> Path:
    return new_folder(Path("runs"), "compare")


def is_comparison(path: Path) -> bool:
    """Whether ``path`` holds a comparison (its tables, or a ``--seeds`` one's seed folders)."""
    return (path / "results.json").exists() or any(path.glob("seed-*/"))


def check_out(out: Path, resume: bool, seeds: list[int] | None) -> None:
    """Refuse an ``--out`` that a comparison would damage or misread, before anything runs: a
    run's own folder; with ``--resume``, a folder with nothing to continue, or one made with
    --seeds resumed without them (or the other way round: its tables would be set aside)."""
    if (out / "config.json").exists():
        raise ConfigError("--out", str(out), "this is a run's folder, not a comparison's: give "
                          "a new folder or an earlier comparison's")
    if not resume:
        return
    if not out.is_dir() or not any(out.iterdir()):
        raise ConfigError("--resume", True, f"nothing to continue in {out} (no earlier comparison "
                          "there); drop --resume to start one")
    try:
        earlier = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        earlier = None
    made_with = (sorted(earlier.get("seeds", [])) if isinstance(earlier, dict) and "seeds" in earlier
                 else sorted(int(p.name[5:]) for p in out.glob("seed-*/") if p.name[5:].isdigit()))
    if made_with and not seeds:
        raise ConfigError("--resume", True, f"the comparison in {out} was made with --seeds "
                          f"{','.join(map(str, made_with))}: give them again")
    if seeds and not made_with and (out / "results.json").exists():
        raise ConfigError("--seeds", ",".join(map(str, seeds)), f"the comparison in {out} was "
                          "made without --seeds: resume it without them (or give a new --out)")


def failed_runs(out: Path) -> list[str]:
    """The runs of the comparison in ``out`` that failed: ``method`` or ``method (seed s)``."""
    results = json.loads((out / "results.json").read_text())
    if "summary" in results:  # several seeds
        return [f"{m} (seed {s})" for m, st in results["summary"].items() for s in st["seeds-failed"]]
    return [m for m, r in results.items() if "error" in r]


def compare(methods: list[str], overrides: dict[str, Any], num_clients: int,
            cpus_per_client: float = 1.0, gpus_per_client: float = 0.0,
            out: Path | None = None, resume: bool = False) -> str:
    """Run each method with the same run config (partition, seed, rounds...) and tabulate.

    ``methods`` are names or variants (:func:`parse_variant`). With ``resume`` (an existing
    ``out``), a method whose run finished with this run config is kept (with more
    ``num-server-rounds`` it is extended), one that stopped continues from its checkpoint, one
    that never started runs; an earlier run with another config stops the comparison before
    anything runs. Writes ``<out>/<label>/`` run directories, ``results.json``, ``table.md``
    and ``accuracy.png`` (every method's curve); returns the markdown table.
    """
    check_labels(methods)
    out = (out or default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with folder_in_use("--out", out):  # one launcher per comparison folder at a time
        fed = engine.federation_config(num_clients, cpus_per_client, gpus_per_client)
        plan = {}
        for m in methods:
            rc = {**overrides, **parse_variant(m)[1], "output-dir": str(out), "run-name": run_label(m)}
            plan[m] = (rc, earlier_run(out / run_label(m), rc, num_clients) if resume else "fresh")
        keep_earlier_tables(out, resume, methods)  # once the plan stands: a refusal moves nothing
        results: dict[str, dict[str, Any]] = {}
        nothing_to_run = all(action == "keep" for _, action in plan.values())
        try:
            _run_plan(out, plan, results, fed, nothing_to_run)
        except KeyboardInterrupt:  # Ctrl-C: the runs that finished still get their table
            if results:
                _write_tables(out, results, overrides, num_clients)
                log.warning("compare: interrupted; the table holds the %d run(s) that ended; "
                            "`--resume` with the same command runs the rest", len(results))
            raise
        return _write_tables(out, results, overrides, num_clients)


def _run_plan(out: Path, plan: dict[str, tuple[dict[str, Any], str]],
              results: dict[str, dict[str, Any]], fed: dict[str, Any], nothing_to_run: bool) -> None:
    """Each planned run in order (kept, resumed or fresh), its summary into ``results``."""
    with (contextlib.nullcontext((None, None)) if nothing_to_run  # no SuperLink to start
          else engine.local_superlink()) as (home, conn):
        for m in plan:
            rc, action = plan[m]
            name = rc["run-name"]
            run_dir = out / name
            if action == "keep":
                log.info("compare: %s finished before; kept", m)
                results[m] = json.loads((run_dir / "summary.json").read_text())
                continue
            if action == "resume":
                rc["resume"] = str(run_dir)
            log.info("compare: %s%s", m, " (resumed)" if "resume" in rc else "")
            run_dir.mkdir(exist_ok=True)  # held while it runs: a `run --resume` of it is refused
            try:
                with contextlib.ExitStack() as held:
                    held.enter_context(folder_in_use("run-name", run_dir))  # before an old run moves
                    refuse_live_writer(run_dir)  # a ServerApp another launcher left running
                    if action != "resume" and any(run_dir.iterdir()):  # keep the old run aside
                        log.warning("compare: an earlier %s run was moved to %s", m, set_aside(run_dir))
                        run_dir.mkdir()
                        held.enter_context(folder_in_use("run-name", run_dir))
                    results[m] = engine.flwr_run(home, conn, rc, fed, log_file=out / f"{name}.log")
            except (engine.RunFailed, ConfigError) as e:  # keep the other methods' results
                log.error("%s", e)
                results[m] = {"error": str(e)}
            except KeyboardInterrupt as e:  # a run that had finished when it came counts
                if getattr(e, "summary", None) is not None:
                    results[m] = e.summary
                raise
            finally:  # failed or interrupted before its first file: no empty folder left
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # only if empty
            (out / "results.json").write_text(json.dumps(results, indent=2))


def _write_tables(out: Path, results: dict[str, dict[str, Any]], overrides: dict[str, Any],
                  num_clients: int) -> str:
    """A comparison's ``results.json``, ``table.md`` and plots, of the runs in ``results``."""
    (out / "results.json").write_text(json.dumps(results, indent=2))  # also when all were kept
    curves = {m: read_metrics(out / run_label(m)) for m, r in results.items() if "error" not in r}
    plot_comparison(curves, out, _title(overrides, num_clients),
                    [m for m, r in results.items() if "error" in r])
    table = "\n".join([markdown_table(results, overrides, num_clients),
                       *shared_settings(run_configs(out / run_label(m) for m in results))])
    (out / "table.md").write_text(table + "\n")
    log.info("compare: wrote %s", out)
    return table


#: a comparison's own files in its folder (besides the runs' folders and logs)
TABLES = ("results.json", "table.md", "accuracy.png", "client-accuracy.png")


def set_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.old-<time>[-n]<suffix>`` next to it; returns the new path."""
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    # a run folder's name may hold a dot (fedavg_lr_0.05): only a file's suffix is kept last
    stem, suffix = (path.name, "") if path.is_dir() else (path.stem, path.suffix)
    while (aside := path.with_name(f"{stem}.old-{stamp}" + (f"-{n}" if n > 1 else "")
                                   + suffix)).exists():
        n += 1
    return path.rename(aside)


def keep_earlier_tables(out: Path, resume: bool, methods: list[str],
                        seeds: list[int] | None = None, command: str = "compare") -> None:
    """A comparison into a folder that holds an earlier one's tables sets them aside: a fresh
    one always, a resumed one where they hold methods or seeds it does not run (its tables
    would drop their rows; the runs themselves stay where they are)."""
    if resume:
        try:
            earlier = json.loads((out / "results.json").read_text())
        except (OSError, ValueError):
            earlier = {}
        earlier = earlier if isinstance(earlier, dict) else {}
        extra = sorted(set(earlier.get("summary", earlier) if "seeds" in earlier else earlier)
                       - set(methods))
        extra += [f"seed {s}" for s in sorted(set(earlier.get("seeds", [])) - set(seeds or []))]
        if not extra:
            return
        log.warning("%s: the earlier tables also hold %s, which this comparison does not run",
                    command, ", ".join(map(str, extra)))
    for f in TABLES:
        if (out / f).exists():
            log.warning("%s: the earlier %s was moved to %s", command, f, set_aside(out / f))


def earlier_run(run_dir: Path, rc: dict[str, Any], num_clients: int) -> str:
    """What ``--resume`` does with the run in ``run_dir``: ``keep`` it (finished, same config),
    ``resume`` it (stopped, or finished with fewer rounds than asked), or start it ``fresh``
    (none there). An earlier run with another config is a ConfigError naming the keys."""
    from flowerbed.checkpoint import (
        FILE,
        NOT_EXTENDABLE,
        RESUMABLE_CHANGES,
        config_changes,
        extendable,
        finished_rounds,
    )
    done, stopped = finished_rounds(run_dir), (run_dir / FILE).exists()
    if (done is None and not stopped) or not (run_dir / "config.json").exists():
        return "fresh"
    try:
        saved = dict(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError, TypeError) as e:  # (a JSONDecodeError is a ValueError)
        raise ConfigError("--resume", str(run_dir), f"its config.json is unreadable ({e}); move "
                          "the folder aside to run that method afresh") from None
    current = {**Config.from_run_config(rc).to_run_config(), "num-partitions": num_clients}
    if diff := config_changes(saved, current):
        shown = ", ".join(diff[:5]).replace("num-partitions:", "num-partitions (--num-clients):")
        why = (f"; {NOT_EXTENDABLE}: give the longer run another --out" if not extendable(saved)
               and any(d.startswith("num-server-rounds:") for d in diff) else "")
        raise ConfigError("--resume", str(run_dir), f"the earlier run there differs in {shown}{why}; "
                          "rerun without --resume (it is moved aside) or pass its settings again")
    asked = current["num-server-rounds"]
    if done == asked:
        same_run = {"resume", "run-name", "output-dir", "num-server-rounds"}
        changed = [k for k in sorted(RESUMABLE_CHANGES - same_run)
                   if saved.get(k, current.get(k)) != current.get(k)]
        if changed:  # a finished run is kept only if it ran with what this comparison asks for
            shown = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
            raise ConfigError("--resume", str(run_dir), f"the earlier run there finished with "
                              f"other settings ({shown}); rerun without --resume (it is moved "
                              "aside) or pass its settings again")
        return "keep"
    if done is not None and (done > asked or not stopped):
        raise ConfigError("--resume", str(run_dir), f"the earlier run there finished {done} "
                          f"rounds; this comparison asks for {asked}")
    from flowerbed.checkpoint import CheckpointError, load

    try:
        reached = load(run_dir)["round"]
    except CheckpointError:
        return "resume"  # the ServerApp refuses it, naming the damage; the other runs go on
    if reached > asked:
        raise ConfigError("--resume", str(run_dir), f"the earlier run there stopped after round "
                          f"{reached}; this comparison asks for {asked}")
    return "resume"


CLIENT_ACC = "final-client-accuracy"
FINAL_NOTE = ("final acc: each method's own measure in its last evaluated round: the global "
              f"model's {GLOBAL_MEASURE}; " + "; ".join(f"for {', '.join(methods)} {what}"
                                                      for methods, what in own_measures()) + ".")
CLIENT_NOTE = ("client acc: every method on the clients' local test splits, with the model each "
               "client uses (the global model for fedavg and the like, its own for the "
               "personalised methods).")
#: the methods whose final acc is not the global model on the test set: FINAL_NOTE says what
OWN_MEASURES = {m for methods, _ in own_measures() for m in methods}
STREAM_NOTE = ("mean online acc: a stream's result (Fed-ADE, Fed-POE), the online accuracy averaged "
               "over the time steps; mean pre-update acc: the same, each step's batch scored before "
               "adapting to it.")


def streams(s: dict[str, Any]) -> bool:
    """Whether a run's summary is a stream's (Fed-ADE: scored by its mean online accuracy)."""
    return s.get("mean-pre-accuracy") is not None


def _title(overrides: dict[str, Any], n: int) -> str:
    settings = [f"{k} {overrides[k]}" for k in SHARED_KEYS[4:] if overrides.get(k) is not None]
    return (f"{overrides.get('dataset', 'fashion-mnist')}, {overrides.get('partition')}, "
            f"{n} clients{''.join(', ' + x for x in settings)}, seed {overrides.get('seed', 0)}")


#: the settings a comparison's header says every method shares (the first four always named)
SHARED_KEYS = ("dataset", "partition", "seed", "num-server-rounds", "train-samples", "test-samples",
               "min-partition-size", "local-test-fraction")


def megabytes(n: float) -> str:
    """Bytes as MB, two decimals; below 0.1 MB two significant digits (the distillation
    methods' predictions, about 0.005 MB, read 0.00)."""
    return f"{n / 1e6:.2f}" if n >= 1e5 or n == 0 else f"{n / 1e6:.2g}"


def exceptions(methods: Any) -> list[str]:
    """A line naming the rows whose @-overrides change a setting the header says is shared."""
    changed = {m: [k for k in SHARED_KEYS if k in parse_variant(m)[1]] for m in methods}
    varied = [f"{m} ({', '.join(keys)})" for m, keys in changed.items() if keys]
    return ["", "Except where a row's own settings change them: " + "; ".join(varied) + "."
            ] if varied else []


def skipped_rounds(results: dict[str, dict[str, Any]]) -> list[str]:
    """A line naming the runs some of whose rounds kept the previous model (too few valid
    replies): their accuracy is not that of the rounds the header states."""
    short = [f"{m} ({s['rounds'] - s['rounds-aggregated']} of {s['rounds']})"
             for m, s in results.items()
             if "error" not in s and s.get("rounds-aggregated") is not None
             and s["rounds-aggregated"] < s["rounds"]]
    return ["", "Rounds skipped (fewer than min-clients valid replies, or an aggregate that held "
            "NaN or inf; the reasons are under 'failures' and 'diverged' in the run's "
            "metrics.jsonl): " + "; ".join(short) + "."] if short else []


INITIAL_NOTE = ("initial acc: the initial model (round 0) by each method's own measure; for the "
                "self-supervised methods the random-init encoder's linear probe, their floor.")


def notes(client: bool, stream: bool, initial: bool = False, methods: Any = ()) -> list[str]:
    """The notes under a table with an ``initial acc``, a ``client acc`` or a stream's columns,
    and what ``final acc`` measures where one of ``methods`` measures its own way."""
    final = client or bool(OWN_MEASURES.intersection(methods))
    text = " ".join([INITIAL_NOTE] * initial + [FINAL_NOTE] * final + [CLIENT_NOTE] * client
                    + [STREAM_NOTE] * stream)
    return ["", text] if text else []


def markdown_table(results: dict[str, dict[str, Any]], overrides: dict[str, Any], n: int,
                   variants: bool = True) -> str:
    """The comparison's table; ``variants``: the rows are ``method@key=value`` specs, whose
    changes to the shared settings are named under it."""
    client = any(s.get(CLIENT_ACC) is not None for s in results.values())
    stream = any(streams(s) for s in results.values())
    initial = any(s.get("initial-accuracy") is not None for s in results.values())
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        *([("mean online acc %", lambda s: pct(s.get("mean-accuracy")) if streams(s) else "-"),
           ("mean pre-update acc %", lambda s: pct(s.get("mean-pre-accuracy")))] if stream else []),
        *([("initial acc %", lambda s: pct(s.get("initial-accuracy")))] if initial else []),
        ("final acc %", lambda s: pct(s.get("final-accuracy"))),
        *([("client acc %", lambda s: pct(s.get(CLIENT_ACC)))] if client else []),
        ("best acc % (round)", lambda s: f"{pct(s.get('best-accuracy'))} ({s.get('best-round')})"),
        ("up MB/client/round", lambda s: "-" if s.get("bytes-up-per-client-round") is None
         else megabytes(s["bytes-up-per-client-round"])),
        ("failures", lambda s: str(s.get("client-failures-total", 0))),
        ("wall s", lambda s: f"{s.get('wall-seconds', 0):.0f}")]
    rows = [[m, *(["failed", *["-"] * (len(cols) - 1)] if "error" in s
                  else [cell(s) for _, cell in cols])] for m, s in results.items()]
    varied = exceptions(results) if variants else []
    but = " (except the rows named below)" if varied else ""
    lines = [f"Same partitions and seed for every method{but}: {_title(overrides, n)}, "
             f"{_rounds(overrides)}.", "",
             *md_table(["method", *(h for h, _ in cols)], rows), *varied, *skipped_rounds(results)]
    lines += failed_reasons({m: s["error"] for m, s in results.items() if "error" in s})
    return "\n".join(lines + notes(client, stream, initial, (s.get("method") for s in results.values())))


def failed_reasons(errors: dict[str, str]) -> list[str]:
    """The line under a table naming each failed run's reason, as results.json has it."""
    return ["", "Failed: " + "; ".join(f"{m}: {e}" for m, e in errors.items())] if errors else []


def plot_comparison(curves: dict[str, list[dict[str, Any]]], out: Path, title: str,
                    failed: list[str]) -> None:
    """``accuracy.png`` (each method's own measure, as ``final acc``) and, where the clients
    evaluate, ``client-accuracy.png`` (every method on the clients' local test splits: the plot
    to read when personalised and global methods meet); failed runs named under the plot."""
    note = f"failed, not drawn: {', '.join(failed)}" if failed else ""
    plot_curves(curves, out / "accuracy.png", title=title, note=note,
                ylabel="accuracy (each method's own)")
    if any(r.get("client-accuracy") is not None for rows in curves.values() for r in rows):
        plot_curves(curves, out / "client-accuracy.png", title=title, note=note,
                    key="client-accuracy", ylabel="client accuracy (local test splits)")


def compare_seeds(methods: list[str], overrides: dict[str, Any], seeds: list[int],
                  num_clients: int, out: Path | None = None, resume: bool = False,
                  **resources: float) -> str:
    """:func:`compare` once per seed (``<out>/seed-<s>/``, seed after seed, so a stopped
    comparison keeps whole seeds), then each method's mean and spread over the seeds:
    ``<out>/results.json`` (per seed and summary), ``table.md`` and ``accuracy.png`` (mean
    curves). Returns the markdown table of means."""
    check_labels(methods, seeds)
    out = (out or default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with folder_in_use("--out", out):  # one launcher per comparison folder at a time
        return _compare_seeds(methods, overrides, seeds, num_clients, out, resume, **resources)


def _compare_seeds(methods: list[str], overrides: dict[str, Any], seeds: list[int],
                   num_clients: int, out: Path, resume: bool, **resources: float) -> str:
    if resume:  # every seed's earlier runs checked before anything runs
        for s in seeds:
            for m in methods:
                rc = {**overrides, **parse_variant(m)[1], "seed": s}
                earlier_run(out / f"seed-{s}" / run_label(m), rc, num_clients)
    keep_earlier_tables(out, resume, methods, seeds)
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for s in seeds:
        log.info("compare: seed %d (%d of %d)", s, len(per_seed) + 1, len(seeds))
        compare(methods, {**overrides, "seed": s}, num_clients, out=out / f"seed-{s}",
                resume=resume, **resources)
        per_seed[s] = json.loads((out / f"seed-{s}" / "results.json").read_text())
    summary = {m: seed_stats({s: r.get(m, {"error": "no result"}) for s, r in per_seed.items()})
               for m in methods}
    runs = {m: [read_metrics(out / f"seed-{s}" / run_label(m)) for s in summary[m]["seeds-ok"]]
            for m in methods}
    configs = run_configs(out / f"seed-{s}" / run_label(m) for s in seeds for m in methods)
    return write_seed_tables(out, summary, per_seed, runs, overrides, num_clients, seeds,
                             tuple(shared_settings(configs)))


def write_seed_tables(out: Path, summary: dict[str, dict[str, Any]], per_seed: dict[int, Any],
                      runs: dict[str, list[list[dict[str, Any]]]], overrides: dict[str, Any],
                      n: int, seeds: list[int], extra: tuple[str, ...] = (),
                      command: str = "compare") -> str:
    """A table over seeds into ``out``: ``results.json`` (summary and per seed), ``table.md``
    (``extra`` lines under it) and the mean curves of each row's finished ``runs``; returns the
    table."""
    (out / "results.json").write_text(json.dumps(
        {"seeds": seeds, "summary": summary, "per-seed": per_seed}, indent=2))
    curves = {}
    for m, rows in runs.items():  # a method some of whose seeds failed: its label names the others
        ok = summary[m]["seeds-ok"]
        label = m if len(ok) in (0, len(seeds)) else f"{m} (seeds {', '.join(map(str, ok))})"
        curves[label] = mean_curve(rows)
    plot_comparison({m: c for m, c in curves.items() if c}, out,
                    _title(overrides, n).rsplit(",", 1)[0] + f", mean of seeds {seeds} (band: ± 1 std)",
                    [m for m, c in curves.items() if not c])
    table = "\n".join([seeds_table(summary, overrides, n, seeds), *extra])
    (out / "table.md").write_text(table + "\n")
    log.info("%s: wrote %s", command, out)
    return table


def seed_stats(by_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One method's runs over seeds -> per-seed values, mean and sample std of its accuracies
    (failed seeds are listed and left out of the mean)."""
    ok = {s: r for s, r in by_seed.items() if "error" not in r}
    stats: dict[str, Any] = {"seeds-ok": sorted(ok), "seeds-failed": sorted(set(by_seed) - set(ok)),
                             "seed-errors": {s: r["error"] for s, r in by_seed.items() if s not in ok}}
    for key in ("final-accuracy", "best-accuracy", "initial-accuracy", CLIENT_ACC,
                "mean-accuracy", "mean-pre-accuracy"):
        vals = {s: r.get(key) for s, r in ok.items()}
        finite = [v for v in vals.values() if v is not None]
        stats[key] = vals
        stats[f"{key}-mean"] = statistics.fmean(finite) if finite else None
        stats[f"{key}-std"] = statistics.stdev(finite) if len(finite) > 1 else None
    for key in ("rounds", "rounds-aggregated", "client-failures-total"):  # per seed, as they are
        stats[key] = {s: r.get(key) for s, r in ok.items()}
    return stats


def mean_curve(runs: list[list[dict[str, Any]]], keys: tuple[str, ...] = ("accuracy", "client-accuracy")
               ) -> list[dict[str, Any]]:
    """Rows of several runs -> one row per round with the mean of each of ``keys`` over the runs
    that report it in that round, and (``<key>-std``) their sample std where two or more do."""
    by_round: dict[int, dict[str, list[float]]] = {}
    for rows in runs:
        for r in rows:
            for k in keys:
                if r.get(k) is not None:
                    by_round.setdefault(r["round"], {}).setdefault(k, []).append(r[k])
    return [{"round": rnd, **{k: statistics.fmean(v) for k, v in vals.items()},
             **{f"{k}-std": statistics.stdev(v) for k, v in vals.items() if len(v) > 1}}
            for rnd, vals in sorted(by_round.items())]


def seeds_table(summary: dict[str, dict[str, Any]], overrides: dict[str, Any], n: int,
                seeds: list[int]) -> str:
    def mean_sd(st: dict[str, Any], key: str) -> str:
        sd = st.get(f"{key}-std")
        return pct(st.get(f"{key}-mean")) + ("" if sd is None else f" ± {100 * sd:.2f}")

    def per_seed(st: dict[str, Any]) -> str:  # each value named by its seed
        by_seed = {str(s): v for s, v in st["final-accuracy"].items()}  # str keys once read back
        return ", ".join(f"{pct(by_seed.get(str(s)))} (s{s})" for s in st["seeds-ok"]) or "-"

    def failures(st: dict[str, Any]) -> str:  # over the seeds that ran to the end
        counts = st.get("client-failures-total", {}).values()
        return str(sum(v or 0 for v in counts)) if counts else "-"

    client = any(st.get(f"{CLIENT_ACC}-mean") is not None for st in summary.values())
    stream = any(st.get("mean-pre-accuracy-mean") is not None for st in summary.values())
    initial = any(st.get("initial-accuracy-mean") is not None for st in summary.values())
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        *([("mean online acc %", lambda st: mean_sd(st, "mean-accuracy")
            if st.get("mean-pre-accuracy-mean") is not None else "-"),
           ("mean pre-update acc %", lambda st: mean_sd(st, "mean-pre-accuracy"))] if stream else []),
        *([("initial acc %", lambda st: mean_sd(st, "initial-accuracy"))] if initial else []),
        ("final acc %", lambda st: mean_sd(st, "final-accuracy")),
        ("per seed", per_seed),
        *([("client acc %", lambda st: mean_sd(st, CLIENT_ACC))] if client else []),
        ("best acc %", lambda st: mean_sd(st, "best-accuracy")),
        ("failures", failures),
        ("failed seeds", lambda st: ", ".join(f"seed {s}" for s in st["seeds-failed"]) or "-")]
    title = _title(overrides, n).rsplit(",", 1)[0]
    lines = [f"Same partitions and seed for every method within a seed: {title}, "
             f"{_rounds(overrides)}, seeds {', '.join(map(str, seeds))} "
             "(mean ± sample std over seeds).", "",
             *md_table(["method", *(h for h, _ in cols)],
                       [[m, *(cell(st) for _, cell in cols)] for m, st in summary.items()]),
             *exceptions(summary), *skipped_rounds({
                 f"{m} (seed {s})": {"rounds": st["rounds"][s], "rounds-aggregated": a}
                 for m, st in summary.items() for s, a in st.get("rounds-aggregated", {}).items()}),
             *failed_reasons({f"{m} (seed {s})": e for m, st in summary.items()
                              for s, e in st.get("seed-errors", {}).items()})]
    return "\n".join(lines + notes(client, stream, initial, (m.split("@")[0] for m in summary)))


#: what fixes the clients' data (and Fed-ADE's streams): runs that differ in one of these were
#: not on the same data
SPLIT_KEYS = ("dataset", "train-samples", "public-fraction", "partition", "seed",
              "min-partition-size", "local-test-fraction", "num-partitions", "test-samples",
              "fedade-shift", "fedade-schedule", "fedade-batch", "fedade-ber-chain", "fedade-ber-p",
              "client-data")  # the clients' own data folders (None: the seeded split)
#: run-config keys that name where a run is, not what it is: never listed as a difference
BOOKKEEPING = {"run-name", "output-dir", "resume", "data-root", "client-state-dir", "method",
               "fault-crash-after"}  # a run it crashed, once resumed, equals an unbroken one


def run_folders(paths: list[Path]) -> list[Path]:
    """Each path that holds a run (its ``config.json``), or, for a folder that holds none (a
    comparison, ``runs/``), the run folders directly under it."""
    found: list[Path] = []
    for p in paths:
        p = p.expanduser().resolve()
        if not p.is_dir():
            raise ConfigError("RUN_DIR", str(p), "not a folder")
        # a run; else the runs directly under it; else a `compare --seeds` folder's seed-<s>/
        # runs; not the earlier runs a comparison set aside (<label>.old-<time>)
        folders = [p] if (p / "config.json").is_file() else [d for d in [
            *p.iterdir(), *(d for s in sorted(p.glob("seed-*/")) for d in s.iterdir())]
            if ".old-" not in d.name]
        inner = sorted({d.resolve() for d in folders  # a linked run once
                        if d.is_dir() and (d / "config.json").is_file()})
        if not inner:
            raise ConfigError("RUN_DIR", str(p), "holds no run (no config.json in it, in a "
                              "folder directly under it, or in its seed-<s>/ folders)")
        found += [d for d in inner if d not in found]
    return found


def run_labels(runs: list[Path], configs: dict[Path, dict[str, Any]]) -> dict[Path, str]:
    """Each run's label: its folder's name, with as many parent folders as it takes to tell
    runs apart, and its method where the name does not start with it."""
    labels = {}
    for d in runs:
        depth = 1
        while depth < len(d.parts) and sum(
                o.parts[-depth:] == d.parts[-depth:] for o in runs) > 1:
            depth += 1
        method = str(configs[d].get("method"))
        labels[d] = "/".join(d.parts[-depth:]) + ("" if d.name.startswith(method) else f" ({method})")
    return labels


def _summary(d: Path) -> dict[str, Any]:
    """A run's summary.json, or an error naming why there is none."""
    try:
        summary = json.loads((d / "summary.json").read_text())
        if not isinstance(summary, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return {"error": f"no readable summary.json: the run did not finish ({e})", "run-dir": str(d)}
    return {**summary, "run-dir": str(d)}


def table_of_runs(paths: list[Path], out: Path | None = None) -> tuple[str, Path]:
    """A comparison's table and plots from runs made separately (``flowerbed run``, ``deploy
    run``, plain ``flwr run``, other comparisons): ``<out>/results.json``, ``table.md``,
    ``accuracy.png`` (and ``client-accuracy.png``), as :func:`compare` writes them (``out``:
    default ``runs/table-<time>``). Runs that do not share their data (:data:`SPLIT_KEYS`; a key
    a run's config lacks, written by older code, is not compared, but one without ``client-data``
    counts as on the seeded split) are refused, naming the key;
    other settings that differ are listed under the table. Runs that differ in their seed alone
    are a table over seeds, as ``compare --seeds`` writes it (every method on the same seeds).
    A run without ``summary.json`` did not finish: its row says failed. Returns the markdown
    table and the folder written."""
    runs = run_folders(paths)
    if out is not None and any(out.resolve() == d or d in out.resolve().parents for d in runs):
        raise ConfigError("--out", str(out), "is one of the runs, or inside one: its own files "
                          "would be replaced; choose a folder outside them")
    configs: dict[Path, dict[str, Any]] = {}
    for d in runs:
        try:
            configs[d] = {"method": defaults()["method"], "client-data": None,
                          **json.loads((d / "config.json").read_text())}
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError("RUN_DIR", str(d), f"its config.json is unreadable ({e})") from None
    labels = run_labels(runs, configs)
    # runs over seeds: on own data folders, each seed's may be an export of that seed (but the
    # runs of one seed share theirs)
    by_seed: dict[Any, dict[Path, dict[str, Any]]] = {}
    for d, c in configs.items():
        by_seed.setdefault(json.dumps(c.get("seed")), {})[d] = c
    over_seeds = _differs(configs, "seed") and not any(
        _differs(configs, k) for k in SPLIT_KEYS if k not in ("seed", "client-data")) and not _differs(
        {d: {**c, "client-data": _export_seed_left_out(c["client-data"])} for d, c in configs.items()},
        "client-data") and not any(_differs(runs, "client-data") for runs in by_seed.values())
    for key in sorted(SPLIT_KEYS, key=lambda k: k == "seed"):  # a key besides the seed first
        if _differs(configs, key) and not over_seeds:
            raise ConfigError("RUN_DIR", "; ".join(labels.values()), f"the runs were not on the "
                              f"same data: their {key} differs ({_values(configs, labels, key)}); a "
                              "table compares methods on the same partitions and seed")
    if over_seeds:
        return _table_over_seeds(runs, configs, out)
    results = {labels[d]: _summary(d) for d in runs}
    curves = {}
    for d in runs:
        if "error" not in results[labels[d]]:
            try:
                curves[labels[d]] = read_metrics(d)
            except (OSError, ValueError) as e:
                results[labels[d]] = {"error": f"unreadable metrics.jsonl ({e})", "run-dir": str(d)}
    shared = _shared(configs)
    n = int(shared.get("num-partitions") or 0)
    table = "\n".join([markdown_table(results, shared, n, variants=False), *own_folders(shared),
                       *shared_settings(configs.values()), *_differences(configs, labels),
                       "", "Runs: " + "; ".join(f"{labels[d]}: {d}" for d in runs) + "."])
    out = _table_folder(out, list(results))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot_comparison(curves, out, _title(shared, n), [m for m in results if m not in curves])
    (out / "table.md").write_text(table + "\n")
    log.info("table: wrote %s", out)
    return table, out


def _values(configs: dict[Any, dict[str, Any]], labels: dict[Any, str], key: str) -> str:
    return "; ".join(f"{labels.get(d, d)}: {c.get(key)!r}" for d, c in configs.items()
                     if reads(c.get("method"), key))


def _read_values(configs: Any, key: str) -> set[str]:
    """The values (as JSON) of ``key`` among ``configs`` that have it and whose method reads it."""
    return {json.dumps(c[key], sort_keys=True) for c in configs if key in c and reads(c.get("method"), key)}


def _differs(configs: dict[Any, dict[str, Any]], key: str) -> bool:
    """Whether ``key`` differs among the runs that have it and whose method reads it."""
    return len(_read_values(configs.values(), key)) > 1


def _spec_value(v: Any) -> str:
    """A value as ``compare --methods`` variants spell it (fedx@fedx-base='byol')."""
    return f"'{v}'" if isinstance(v, str) else engine.toml_value(v)


def _shared(configs: dict[Path, dict[str, Any]]) -> dict[str, Any]:
    """The settings every run shares, for the table's header (rounds None where they differ)."""
    first = {k: next((c[k] for c in configs.values() if k in c), None) for k in SPLIT_KEYS}
    return {**first, "num-server-rounds": None if _differs(configs, "num-server-rounds")
            else next(iter(configs.values())).get("num-server-rounds")}


def _differences(configs: dict[Any, dict[str, Any]], labels: dict[Any, str],
                 runs: dict[Any, dict[str, Any]] | None = None) -> list[str]:
    """The lines under a table naming the other settings that differ between ``configs`` (rows)
    and the software that differs between ``runs`` (default: the same)."""
    lines = []
    if differ := sorted(k for k in set(defaults()) - BOOKKEEPING if _differs(configs, k)):
        shown = [f"{k} ({_values(configs, labels, k)})" for k in differ[:8]]
        lines += ["", "Settings that differ between the runs: " + "; ".join(shown)
                  + (f"; and {len(differ) - 8} more" if len(differ) > 8 else "") + "."]
    runs = configs if runs is None else runs
    software = {labels.get(d, d): f"torch {sw.get('torch')}, flwr {sw.get('flwr')}"
                for d, c in runs.items() if isinstance(sw := c.get("software"), dict)}
    if len(set(software.values())) > 1:  # e.g. runs from two machines: say so beside the figures
        lines += ["", "The runs ran on different software: "
                  + "; ".join(f"{k}: {v}" for k, v in software.items()) + "."]
    return lines


def _export_seed_left_out(data: Any) -> Any:
    """``client-data`` without the exports' seed (a table over seeds compares the rest)."""
    if not isinstance(data, dict) or not isinstance(exported := data.get("exported-with"), dict):
        return data

    def drop(e: Any) -> Any:
        return {k: v for k, v in e.items() if k != "seed"} if isinstance(e, dict) else e

    per_client = all(k.isdigit() for k in exported) and bool(exported)  # {"0": {...}, "1": {...}}
    by_partition = data.get("by-partition")
    return {**data, "exported-with": {p: drop(e) for p, e in exported.items()} if per_client
            else drop(exported), **({"by-partition": {p: drop(e) for p, e in by_partition.items()}}
                                    if isinstance(by_partition, dict) else {})}


def own_folders(shared: dict[str, Any]) -> list[str]:
    """The line under a table of runs whose clients read their own data folders: the header's
    split is the run config's, the folders' is what their export recorded."""
    if not isinstance(data := shared.get("client-data"), dict):
        return []
    exported = data.get("exported-with") or {}
    how = ("with " + ", ".join(f"{k} {_spec_value(v)}" for k, v in exported.items())
           if all(k in SPLIT_KEYS for k in exported) else "with settings that differ between them")
    return ["", f"{data.get('own-folders')} of the {data.get('clients', '?')} clients read their own "
            "data folders, "
            f"exported {how if exported else 'by hand (no partition.json)'}; the header's split "
            "settings are the run config's (config.json: client-data)."]


def shared_settings(configs: Any) -> list[str]:
    """The line under a table naming the settings every run shares (among the runs whose method
    reads them) that are not the defaults, beyond the data settings its header names."""
    default, shown = defaults(), []
    for key in sorted(set(default) - BOOKKEEPING - set(SHARED_KEYS)):
        values = _read_values(configs, key)
        if len(values) == 1 and (v := json.loads(values.pop())) != default[key]:
            shown.append(f"{key} {_spec_value(v)}")
    head = "Settings not at their defaults, the same in every run that reads them: "
    return ["", head + ", ".join(shown) + "."] if shown else []


def run_configs(folders: Any) -> list[dict[str, Any]]:
    """The config.json of each of ``folders`` that has one (a run that never started has none)."""
    return [json.loads((d / "config.json").read_text()) for d in folders
            if (d / "config.json").is_file()]


def _table_over_seeds(runs: list[Path], configs: dict[Path, dict[str, Any]],
                      out: Path | None) -> tuple[str, Path]:
    """:func:`table_of_runs` for runs that differ in their seed: the runs of one method and
    settings are one row, mean ± std over its seeds, as ``compare --seeds`` writes it."""
    for d, c in configs.items():
        if isinstance(c.get("seed"), bool) or not isinstance(c.get("seed"), int):
            raise ConfigError("RUN_DIR", str(d), f"its config.json has no integer seed ({c.get('seed')!r})")
    # a run's row: its method and the settings it reads, grouped by the keys every config holds;
    # a key some lack (written by older code) must then agree among the runs of a row that have it
    default = defaults()
    keys = sorted(set(default).intersection(*configs.values()) - BOOKKEEPING - {"seed"})
    groups: dict[str, list[Path]] = {}
    for d, c in configs.items():
        row = {"method": c["method"], **{k: c[k] for k in keys if reads(c["method"], k)}}
        groups.setdefault(json.dumps(row, sort_keys=True), []).append(d)
    first = {g: configs[ds[0]] for g, ds in groups.items()}
    names = {}
    for g, c in first.items():  # methods run with several settings: method@key=value
        same = [o for o in first if first[o]["method"] == c["method"]]
        varied = [k for k in keys if reads(c["method"], k) and c[k] != default[k]
                  and len({json.dumps(first[o][k]) for o in same}) > 1]
        names[g] = c["method"] + "".join(f"@{k}={_spec_value(c[k])}" for k in varied)
    for g, ds in groups.items():
        rows = {d: configs[d] for d in ds}
        if differ := [k for k in set(default) - set(keys) - BOOKKEEPING - {"seed"}
                      if reads(first[g]["method"], k) and _differs(rows, k)]:
            raise ConfigError("RUN_DIR", names[g], f"its runs differ in {differ[0]} ("
                              + "; ".join(f"{d}: {c.get(differ[0])!r}" for d, c in rows.items())
                              + "): a row over seeds is one setting; give runs of the same settings")
    seeds_of = {names[g]: sorted(configs[d]["seed"] for d in ds) for g, ds in groups.items()}
    for g, ds in groups.items():
        if len({configs[d]["seed"] for d in ds}) < len(ds):
            raise ConfigError("RUN_DIR", names[g], "holds two runs of one seed: give one run per "
                              "method and seed (" + "; ".join(
                                  f"seed {configs[d]['seed']}: {d}" for d in ds) + ")")
    if len({tuple(ss) for ss in seeds_of.values()}) > 1:
        raise ConfigError("RUN_DIR", "; ".join(seeds_of), "the runs differ in their seed, but not "
                          "every method ran on the same seeds (" + "; ".join(
                              f"{m}: {', '.join(map(str, ss))}" for m, ss in seeds_of.items())
                          + "); a table over seeds compares methods on the same partitions and seeds")
    seeds = next(iter(seeds_of.values()))
    per_seed: dict[int, dict[str, Any]] = {s: {} for s in seeds}
    finished, labels = {}, {}
    for g, ds in groups.items():
        runs_ok = finished[names[g]] = []
        for d in sorted(ds, key=lambda d: configs[d]["seed"]):
            s = configs[d]["seed"]
            per_seed[s][names[g]] = summary = _summary(d)
            labels[d] = f"{names[g]} (seed {s})"
            if "error" not in summary:
                try:
                    runs_ok.append(read_metrics(d))
                except (OSError, ValueError) as e:
                    per_seed[s][names[g]] = {"error": f"unreadable metrics.jsonl ({e})", "run-dir": str(d)}
    summary = {names[g]: seed_stats({s: per_seed[s][names[g]] for s in seeds}) for g in groups}
    shared = _shared(configs)
    n = int(shared.get("num-partitions") or 0)
    extra = (*own_folders({"client-data": _export_seed_left_out(shared.get("client-data"))}),
             *shared_settings(configs.values()),
             *_differences({names[g]: {**c, "seed": None} for g, c in first.items()}, {},
                           {labels[d]: configs[d] for d in labels}),
             "", "Runs: " + "; ".join(f"{label}: {d}" for d, label in labels.items()) + ".")
    out = _table_folder(out, list(summary))
    return write_seed_tables(out, summary, per_seed, finished, shared, n, seeds, extra, "table"), out


def _table_folder(out: Path | None, rows: list[str]) -> Path:
    """``flowerbed table``'s folder (default ``runs/table-<time>``), made once the runs are
    accepted; an earlier table there is set aside."""
    out = out or new_folder(Path("runs"), "table")
    out.mkdir(parents=True, exist_ok=True)
    keep_earlier_tables(out, False, rows, command="table")
    return out
