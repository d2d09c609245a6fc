"""The launcher: several methods through the same Flower apps, identical partitions and seeds."""

from __future__ import annotations

import contextlib
import json
import logging
import re
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
    read_json,
    read_metrics,
    refuse_live_writer,
    software_differences,
    write_text_atomic,
)

log = logging.getLogger("flowerbed")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``method`` or ``method@key=value@key=value`` -> (label, run-config overrides).

    E.g. ``fedx@fedx-base='byol'`` runs FedX over BYOL; the label names its run directory.
    """
    method, *pairs = spec.split("@")
    extra = parse_overrides([" ".join(pairs)], "--methods") if pairs else {}
    if "method" in extra:  # (it would win over the name before the '@', and the label mislead)
        raise ConfigError("--methods", spec, "a variant cannot set method: name it before the '@'")
    return spec, {"method": method.strip(), **extra}


def split_methods(text: str) -> list[str]:
    """``--methods``' comma-separated specs; a comma inside quotes belongs to a variant's value
    (``fedprotocl@protocl-clusters='2,3'``)."""
    return [m.strip() for m in re.findall(r"""(?:[^,'"]|'[^']*'|"[^"]*")+""", text) if m.strip()]


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
            raise ConfigError("--methods", ",".join(methods), f"{m!r} is given twice" if other == m
                              else f"{other!r} and {m!r} would share the run folder {run_label(m)}")


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
                with engine.shielded("the table of the runs that ended"):
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
            write_text_atomic(out / "results.json", json.dumps(results, indent=2))


def _write_tables(out: Path, results: dict[str, dict[str, Any]], overrides: dict[str, Any],
                  num_clients: int) -> str:
    """A comparison's ``results.json``, ``table.md`` and plots, of the runs in ``results``."""
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))  # also when all were kept
    curves = {m: read_metrics(out / run_label(m)) for m, r in results.items() if "error" not in r}
    plot_comparison(curves, out, comparison_title(overrides, num_clients),
                    [m for m, r in results.items() if "error" in r])
    configs = {m: c for m in results if (c := read_json(out / run_label(m) / "config.json"))}
    table = "\n".join([markdown_table(results, overrides, num_clients),
                       *shared_settings(configs.values()), *software_differences(configs)])
    write_text_atomic(out / "table.md", table + "\n")
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
        changed = [k for k in sorted(RESUMABLE_CHANGES - BOOKKEEPING - {"num-server-rounds"})
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


def comparison_title(overrides: dict[str, Any], n: int) -> str:
    settings = [f"{k} {overrides[k]}" for k in SHARED_KEYS[4:] if overrides.get(k) is not None]
    return (f"{overrides.get('dataset', 'fashion-mnist')}, {overrides.get('partition')}, "
            f"{n} clients{''.join(', ' + x for x in settings)}, seed {overrides.get('seed', 0)}")


#: the settings a comparison's header says every method shares (the first four always named)
SHARED_KEYS = ("dataset", "partition", "seed", "num-server-rounds", "train-samples", "test-samples",
               "min-partition-size", "local-test-fraction")
#: besides those, the settings that change the clients' data ("same partitions" no longer holds)
DATA_KEYS = ("public-fraction", "fedade-shift", "fedade-schedule", "fedade-batch", "fedade-ber-chain",
             "fedade-ber-p")


def megabytes(n: float) -> str:
    """Bytes as MB, two decimals; below 0.1 MB two significant digits (the distillation
    methods' predictions, about 0.005 MB, read 0.00)."""
    return f"{n / 1e6:.2f}" if n >= 1e5 or n == 0 else f"{n / 1e6:.2g}"


def exceptions(methods: Any) -> list[str]:
    """A line naming the rows whose @-overrides change a setting the header says is shared."""
    changed = {m: [k for k in (*SHARED_KEYS, *DATA_KEYS) if k in parse_variant(m)[1]] for m in methods}
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
        ("final acc %", lambda s: pct(s.get("final-accuracy")) + early(s, "final-round")),
        *([("client acc %", lambda s: pct(s.get(CLIENT_ACC)) + early(s, "final-client-round"))]
          if client else []),
        ("best acc % (round)", lambda s: f"{pct(s.get('best-accuracy'))} ({s.get('best-round')})"),
        ("up MB/client/round", lambda s: "-" if s.get("bytes-up-per-client-round") is None
         else megabytes(s["bytes-up-per-client-round"])),
        ("failures", lambda s: str(s.get("client-failures-total", 0))),
        ("wall s", lambda s: f"{s.get('wall-seconds', 0):.0f}")]
    rows = [[m, *(["failed", *["-"] * (len(cols) - 1)] if "error" in s
                  else [cell(s) for _, cell in cols])] for m, s in results.items()]
    varied = exceptions(results) if variants else []
    but = " (except the rows named below)" if varied else ""
    lines = [f"Same partitions and seed for every method{but}: {comparison_title(overrides, n)}, "
             f"{_rounds(overrides)}.", "",
             *md_table(["method", *(h for h, _ in cols)], rows), *varied, *skipped_rounds(results)]
    lines += failed_reasons({m: s["error"] for m, s in results.items() if "error" in s})
    return "\n".join(lines + notes(client, stream, initial, (s.get("method") for s in results.values())))


def early(s: dict[str, Any], key: str) -> str:
    """" (round r)" after a final figure that comes from a round before the run's last (no later
    round was scored: every client failed, or the model's outputs were NaN)."""
    r, n = s.get(key), s.get("rounds")
    return f" (round {r})" if r is not None and n is not None and r < n else ""


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
    configs = {f"{m} (seed {s})": c for s in seeds for m in methods
               if (c := read_json(out / f"seed-{s}" / run_label(m) / "config.json"))}
    return write_seed_tables(out, summary, per_seed, runs, overrides, num_clients, seeds,
                             (*shared_settings(configs.values()), *software_differences(configs)))


def write_seed_tables(out: Path, summary: dict[str, dict[str, Any]], per_seed: dict[int, Any],
                      runs: dict[str, list[list[dict[str, Any]]]], overrides: dict[str, Any],
                      n: int, seeds: list[int], extra: tuple[str, ...] = (),
                      command: str = "compare") -> str:
    """A table over seeds into ``out``: ``results.json`` (summary and per seed), ``table.md``
    (``extra`` lines under it) and the mean curves of each row's finished ``runs``; returns the
    table."""
    write_text_atomic(out / "results.json", json.dumps(
        {"seeds": seeds, "summary": summary, "per-seed": per_seed}, indent=2))
    curves = {}
    for m, rows in runs.items():  # a method some of whose seeds failed: its label names the others
        ok = summary[m]["seeds-ok"]
        label = m if len(ok) in (0, len(seeds)) else f"{m} (seeds {', '.join(map(str, ok))})"
        curves[label] = mean_curve(rows)
        last = max((r["round"] for run in rows for r in run if r.get("accuracy") is not None), default=None)
        cut = max((r["round"] for r in curves[label] if r.get("accuracy") is not None), default=last)
        if last is not None and cut is not None and cut < last:  # a seed stopped reporting
            curves[f"{label} (to round {cut}: a seed has no figure after it)"] = curves.pop(label)
    plot_comparison({m: c for m, c in curves.items() if c}, out,
                    comparison_title(overrides, n).rsplit(",", 1)[0]
                    + f", mean of seeds {seeds} (band: ± 1 std)",
                    [m for m, c in curves.items() if not c])
    table = "\n".join([seeds_table(summary, overrides, n, seeds), *extra])
    write_text_atomic(out / "table.md", table + "\n")
    log.info("%s: wrote %s", command, out)
    return table


def seed_stats(by_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One method's runs over seeds -> per-seed values, mean and sample std of its accuracies
    (failed seeds are listed and left out of the mean). Per-seed fields are keyed by the seed
    as text, as they read back from results.json."""
    ok = {s: r for s, r in by_seed.items() if "error" not in r}
    stats: dict[str, Any] = {"seeds-ok": sorted(ok), "seeds-failed": sorted(set(by_seed) - set(ok)),
                             "seed-errors": {str(s): r["error"] for s, r in by_seed.items() if s not in ok}}
    for key in ("final-accuracy", "best-accuracy", "initial-accuracy", CLIENT_ACC,
                "mean-accuracy", "mean-pre-accuracy"):
        vals = {str(s): r.get(key) for s, r in ok.items()}
        finite = [v for v in vals.values() if v is not None]
        stats[key] = vals
        stats[f"{key}-mean"] = statistics.fmean(finite) if finite else None
        stats[f"{key}-std"] = statistics.stdev(finite) if len(finite) > 1 else None
        stats[f"{key}-n"] = len(finite)  # < seeds-ok: a seed that ran but has no figure (diverged)
    for key in ("rounds", "rounds-aggregated", "client-failures-total", "final-round",
                "final-client-round"):  # per seed, as they are
        stats[key] = {str(s): r.get(key) for s, r in ok.items()}
    return stats


def mean_curve(runs: list[list[dict[str, Any]]], keys: tuple[str, ...] = ("accuracy", "client-accuracy")
               ) -> list[dict[str, Any]]:
    """Rows of several runs -> one row per round with the mean of each of ``keys`` over the runs,
    and (``<key>-std``) their sample std where two or more report it. A round where some run
    that reports the key has no figure (it diverged, or every client failed) is left out of
    that key's curve: a mean over fewer seeds would jump to another level there."""
    by_round: dict[int, dict[str, list[float]]] = {}
    reporting = {k: sum(any(r.get(k) is not None for r in rows) for rows in runs) for k in keys}
    for rows in runs:
        for r in rows:
            for k in keys:
                if r.get(k) is not None:
                    by_round.setdefault(r["round"], {}).setdefault(k, []).append(r[k])
    whole = [(rnd, {k: v for k, v in vals.items() if len(v) == reporting[k]})
             for rnd, vals in sorted(by_round.items())]
    return [{"round": rnd, **{k: statistics.fmean(v) for k, v in vals.items()},
             **{f"{k}-std": statistics.stdev(v) for k, v in vals.items() if len(v) > 1}}
            for rnd, vals in whole if vals]


def seeds_table(summary: dict[str, dict[str, Any]], overrides: dict[str, Any], n: int,
                seeds: list[int]) -> str:
    def at(st: dict[str, Any], key: str, s: int) -> dict[str, Any]:  # one seed's round fields
        return {k: st.get(k, {}).get(str(s)) for k in ("rounds", key)}

    def mean_sd(st: dict[str, Any], key: str) -> str:
        sd, n, ran = st.get(f"{key}-std"), st.get(f"{key}-n"), len(st["seeds-ok"])
        short = f" ({n} of {ran} seeds)" if n is not None and 0 < n < ran else ""
        by = {"final-accuracy": "final-round", CLIENT_ACC: "final-client-round"}.get(key)
        early_n = sum(bool(early(at(st, by, s), by)) for s in st["seeds-ok"]) if by else 0
        short += f" ({early_n} from an earlier round)" if early_n else ""  # a final no later round had
        return pct(st.get(f"{key}-mean")) + ("" if sd is None else f" ± {100 * sd:.2f}") + short

    def per_seed(st: dict[str, Any]) -> str:  # each value named by its seed
        by_seed = st["final-accuracy"]
        return ", ".join(f"{pct(by_seed.get(str(s)))}{early(at(st, 'final-round', s), 'final-round')} (s{s})"
                         for s in st["seeds-ok"]) or "-"

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
    title = comparison_title(overrides, n).rsplit(",", 1)[0]
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


#: run-config keys that name where a run is, not what it is: never listed as a difference
BOOKKEEPING = {"run-name", "output-dir", "resume", "data-root", "client-state-dir", "method",
               "fault-crash-after",  # a run it crashed, once resumed, equals an unbroken one
               "server-device"}  # where it ran (before the key, config.json held the device used)


def read_values(configs: Any, key: str) -> set[str]:
    """The values (as JSON) of ``key`` among ``configs`` that have it and whose method reads it."""
    return {json.dumps(c[key], sort_keys=True) for c in configs if key in c and reads(c.get("method"), key)}


def spec_value(v: Any) -> str:
    """A value as ``compare --methods`` variants spell it (fedx@fedx-base='byol')."""
    return f"'{v}'" if isinstance(v, str) else engine.toml_value(v)


def shared_settings(configs: Any) -> list[str]:
    """The line under a table naming the settings every run shares (among the runs whose method
    reads them) that are not the defaults, beyond the data settings its header names."""
    default, shown = defaults(), []
    for key in sorted(set(default) - BOOKKEEPING - set(SHARED_KEYS)):
        values = read_values(configs, key)
        if len(values) == 1 and (v := json.loads(values.pop())) != default[key]:
            shown.append(f"{key} {spec_value(v)}")
    head = "Settings not at their defaults, the same in every run that reads them: "
    return ["", head + ", ".join(shown) + "."] if shown else []


