"""``flowerbed table``: one comparison's table and plots from runs made separately (``flowerbed
run``, ``deploy run``, plain ``flwr run``, other comparisons), as the launcher
(:mod:`flowerbed.compare`) writes its own; runs that differ in their seed alone make a table over
seeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowerbed.compare import (
    BOOKKEEPING,
    comparison_title,
    keep_earlier_tables,
    log,
    markdown_table,
    plot_comparison,
    read_values,
    seed_stats,
    shared_settings,
    spec_value,
    write_seed_tables,
)
from flowerbed.config import ConfigError, defaults, reads
from flowerbed.results import new_folder, read_metrics, software_differences, write_text_atomic

#: what fixes the clients' data (and Fed-ADE's streams): runs that differ in one of these were
#: not on the same data
SPLIT_KEYS = ("dataset", "train-samples", "public-fraction", "partition", "seed",
              "min-partition-size", "local-test-fraction", "num-partitions", "test-samples",
              "fedade-shift", "fedade-schedule", "fedade-batch", "fedade-ber-chain", "fedade-ber-p",
              "client-data")  # the clients' own data folders (None: the seeded split)


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
    ``accuracy.png`` (and ``client-accuracy.png``), as :func:`flowerbed.compare.compare` writes
    them (``out``: default ``runs/table-<time>``). Runs that do not share their data
    (:data:`SPLIT_KEYS`; a key a run's config lacks, written by older code, is not compared, but
    one without ``client-data`` counts as on the seeded split) are refused, naming the key;
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
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))
    plot_comparison(curves, out, comparison_title(shared, n), [m for m in results if m not in curves])
    write_text_atomic(out / "table.md", table + "\n")
    log.info("table: wrote %s", out)
    return table, out


def _values(configs: dict[Any, dict[str, Any]], labels: dict[Any, str], key: str) -> str:
    return "; ".join(f"{labels.get(d, d)}: {c.get(key)!r}" for d, c in configs.items()
                     if reads(c.get("method"), key))


def _differs(configs: dict[Any, dict[str, Any]], key: str) -> bool:
    """Whether ``key`` differs among the runs that have it and whose method reads it."""
    return len(read_values(configs.values(), key)) > 1


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
    return lines + software_differences({labels.get(d, d): c for d, c in runs.items()})


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
    how = ("with " + ", ".join(f"{k} {spec_value(v)}" for k, v in exported.items())
           if all(k in SPLIT_KEYS for k in exported) else "with settings that differ between them")
    return ["", f"{data.get('own-folders')} of the {data.get('clients', '?')} clients read their own "
            "data folders, "
            f"exported {how if exported else 'by hand (no partition.json)'}; the header's split "
            "settings are the run config's (config.json: client-data)."]


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
        names[g] = c["method"] + "".join(f"@{k}={spec_value(c[k])}" for k in varied)
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
