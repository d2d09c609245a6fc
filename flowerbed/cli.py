"""``flowerbed`` command line: run, compare, table, methods, partitions, superlink, deploy."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flowerbed.config import DATASETS, Config, ConfigError, defaults, load_preset, parse_overrides
from flowerbed.results import writable_folder

log = logging.getLogger("flowerbed")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The preset files' keys (if any), then the -c/--run-config overrides on top; a relative
    data-root made absolute (relative to where the launcher runs)."""
    out: dict[str, Any] = {}
    for preset in args.preset or []:  # several: layered in order, a later one's keys win
        out.update(load_preset(preset))
    out.update(parse_overrides(list(args.run_config or []), "--run-config/-c"))
    # the engines' processes run in the project folder: a relative data-root means here, where
    # the launcher checks the split (a SuperNode elsewhere sets its own with --node-config;
    # client-state-dir stays as given: a relative one is each SuperNode's own folder)
    if isinstance(out.get("data-root"), str) and out["data-root"]:
        out["data-root"] = str(Path(out["data-root"]).expanduser().resolve())
    return out


def _federation_args(p: argparse.ArgumentParser, resumable: bool = False) -> None:
    p.add_argument("--num-clients", type=int, default=None,
                   help="simulated SuperNodes, one partition each (default 10"
                        + ("; with --resume, the run's own)" if resumable else ")"))
    p.add_argument("--cpus-per-client", type=float, default=1.0,
                   help="whole Ray CPUs per client; clients in parallel = CPUs / this (default 1)")
    p.add_argument("--gpus-per-client", type=float, default=0.0,
                   help="GPU share per client, e.g. 0.25 = four clients per GPU (default 0)")
    p.add_argument("--preset", action="append", default=None,
                   help="a TOML file of run-config values, e.g. presets/fedx-cpu.toml (repeat it to "
                        "layer several: a later file's keys win)")
    p.add_argument("--run-config", "-c", action="append", default=[],
                   help="run-config overrides, flwr syntax: \"method='fedprox' lr=0.05\"")


# the launchers' shortcuts for the run-config keys users change most, over the preset and -c
SHORTCUTS = {"method": "method", "dataset": "dataset", "partition": "partition",
             "rounds": "num-server-rounds", "seed": "seed"}


def _shortcut_args(p: argparse.ArgumentParser, defaults: dict[str, Any], method: bool = False) -> None:
    """--dataset/--partition/--rounds/--seed (and --method): each sets its run-config key over
    the preset and -c; ``defaults`` names the value a key none of them sets gets."""
    def default(key: str) -> str:
        return f"default: the preset's or -c's, else {defaults[key]}"
    if method:
        p.add_argument("--method", default=None, help=f"{default('method')} (`flowerbed methods`)")
    p.add_argument("--dataset", default=None, help=f"one of {', '.join(DATASETS)}; {default('dataset')}")
    p.add_argument("--partition", default=None,
                   help=f"e.g. iid, dirichlet:0.1, pathological:2; {default('partition')}")
    p.add_argument("--rounds", type=int_in(1), default=None,
                   help=f"num-server-rounds; {default('num-server-rounds')}")
    p.add_argument("--seed", type=int, default=None, help=default("seed"))


def _with_shortcuts(overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``overrides`` (preset, then -c) with the --method/--dataset/--partition/--rounds/--seed
    given."""
    given = {key: getattr(args, opt, None) for opt, key in SHORTCUTS.items()}
    return {**overrides, **{k: v for k, v in given.items() if v is not None}}


@contextlib.contextmanager
def clients_are_partitions(num_clients: int) -> Iterator[None]:
    """The launcher's clients are its partitions: a bad ``num-partitions`` names --num-clients."""
    try:
        yield
    except ConfigError as e:
        if e.key != "num-partitions":
            raise
        raise ConfigError("--num-clients", num_clients, e.allowed) from None


def int_in(low: int, high: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (``what`` names it in the refusal)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= (value if high is None else high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what or f'an integer >= {low}'}")
        return value
    return parse


port = int_in(1, 65535, "a port (1-65535)")


def preflight(overrides: dict[str, Any], num_clients: int, gpus: float, warn: bool = True) -> Config:
    """Validate keys, values and the split here, before any process starts. ``warn=False``:
    the method's setup warnings are left to the ServerApp, whose output the caller streams to
    the console (`run`, `deploy run`; a comparison's goes to its runs' logs)."""
    import torch

    from flowerbed.datasets.federated import client_partitions
    from flowerbed.registry import METHODS
    cfg = Config.from_run_config(overrides)
    if gpus > 0 and not torch.cuda.is_available():
        raise ConfigError("--gpus-per-client", gpus, "torch sees no CUDA GPU here; use 0 (with a "
                          f"GPU: this torch is built for CUDA {torch.version.cuda or '- (a CPU build)'}"
                          ", which needs an NVIDIA driver that supports it; `nvidia-smi` shows the "
                          "driver's CUDA version)")
    if gpus > max(torch.cuda.device_count(), 1):  # Ray could place no client
        raise ConfigError("--gpus-per-client", gpus, f"more than this machine's "
                          f"{torch.cuda.device_count()} GPUs")
    if num_clients < cfg.min_clients:
        raise ConfigError("--num-clients", num_clients, f"must be >= min-clients ({cfg.min_clients})")
    with clients_are_partitions(num_clients):
        client_partitions(cfg, num_clients)
    before = logging.root.manager.disable
    logging.disable(max(before, logging.WARNING if not warn else logging.NOTSET))
    try:
        METHODS[cfg.method].strategy(cfg).check_setup(num_clients)  # what the ServerApp checks first
    finally:
        logging.disable(before)
    if cfg.client_state_dir:  # the clients run here: they file their state there
        writable_folder("client-state-dir", cfg.client_state_dir)
    return cfg


def resume_overrides(run_dir: str) -> tuple[dict[str, Any], int]:
    """The run config and client count of the run in ``run_dir``, set to resume it."""
    path = Path(run_dir).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError("--resume", run_dir, f"no such folder: {path}")
    if not (path / "config.json").exists():
        from flowerbed.compare import is_comparison

        raise ConfigError("--resume", run_dir, (
            f"{path} holds a comparison, not a run: continue it with `flowerbed compare --out "
            f"{path} --resume` and its --methods" if is_comparison(path) else
            f"{path} is not a run folder (no config.json; a run's folder is <output-dir>/<run-name>)"))
    try:
        saved = json.loads((path / "config.json").read_text())
        n = int(saved.get("num-partitions", 0))
    except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError("--resume", run_dir, f"no readable config.json in {path} "
                          f"({type(e).__name__}: {e})") from None
    from flowerbed.checkpoint import with_added_keys

    keys = set(defaults())  # keys added since the run: as it ran without them (INHERITED)
    rc = with_added_keys({k: v for k, v in saved.items() if k in keys}, defaults())
    if "server-device-used" not in saved:  # before the key, "server-device" was the device used
        rc["server-device"] = defaults()["server-device"]  # (not a choice to pin on another machine)
    rc.update({"resume": str(path), "output-dir": str(path.parent), "run-name": path.name})
    return rc, n


def with_resume(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``overrides`` for ``args.resume``'s run (also given as ``-c resume=<dir>``): its saved
    config, where -c may change only what a resume may (num-server-rounds & co.), and its client
    count (0 for a fresh run, or a config that does not record it)."""
    if overrides.get("resume") and not args.resume:  # -c resume='<dir>': the same as --resume
        args.resume = overrides.pop("resume")
    if not args.resume:
        return overrides, 0
    saved, n = resume_overrides(args.resume)
    for key in ("output-dir", "run-name", "resume"):
        given = overrides.get(key, saved[key])
        if (given if key == "run-name" else str(Path(given).expanduser().resolve())) != saved[key]:
            raise ConfigError(key, given, f"a resumed run stays where it is ({saved['resume']})")
    from flowerbed.checkpoint import config_changes, resumable_changes

    changed = config_changes(Config.from_run_config(saved).to_run_config(),  # normalised,
                             Config.from_run_config({**saved, **overrides}).to_run_config())
    # as the ServerApp compares them (dirichlet:1 is dirichlet:1.0)
    if changed:  # the ServerApp refuses them too, but only after the engine has started
        free = sorted(resumable_changes(saved) - {"resume", "run-name", "output-dir"})
        raise ConfigError("--resume", args.resume, f"a resumed run keeps its config; this "
                          f"changes {', '.join(changed[:5])} (only {', '.join(free)} may "
                          "change); start a new run for other settings")
    return {**saved, **overrides}, n


def cmd_run(args: argparse.Namespace) -> int:
    from flowerbed import engine
    from flowerbed.results import read_json

    overrides, n = with_resume(args, _with_shortcuts(_overrides(args), args))
    if args.resume and isinstance(read_json(Path(overrides["resume"]) / "config.json").get("client-data"),
                                  dict):  # (the ServerApp refuses it too, once the engine has started)
        raise ConfigError("--resume", args.resume, "its clients trained on their own data folders "
                          "(client-data in its config.json), and a simulation's clients read the "
                          "seeded split: continue it with `flowerbed deploy run --resume` on a "
                          "deployment whose SuperNodes read the same folders (deploy up --data-dirs)")
    if n:
        if args.num_clients is not None and args.num_clients != n:
            raise ConfigError("--num-clients", args.num_clients, f"the run in {args.resume} has "
                              f"{n} clients (partitions); a resumed run keeps them")
        args.num_clients = n
    args.num_clients = 10 if args.num_clients is None else args.num_clients
    fed = engine.federation_config(args.num_clients, args.cpus_per_client, args.gpus_per_client)
    cfg = preflight(overrides, args.num_clients, args.gpus_per_client, warn=False)  # loads the data
    with place_run(overrides, cfg), engine.local_superlink() as (home, conn):  # last: the folder
        summary = engine.flwr_run(home, conn, overrides, fed, log_file=run_log(overrides), tee=True)
    print(json.dumps(summary, indent=2))
    return 0


@contextlib.contextmanager
def place_run(overrides: dict[str, Any], cfg: Config, kind: str = "") -> Iterator[None]:
    """Where a run of ``cfg`` lands, set in ``overrides``: an absolute output-dir, and a run-name
    (method, ``kind``, time) where none is given ("" too: the launcher must know where the run
    lands); then the refusals the ServerApp would make there, before anything starts. A folder
    made here that the run leaves empty (its SuperLink did not start, Ctrl-C before round 0) is
    removed again. The folder is this launcher's while the run lasts: a second launcher that
    names it (the same run-name, or ``--resume`` of the run) is refused until it ends."""
    from flowerbed.results import (
        folder_in_use,
        make_folder,
        new_folder,
        refuse_live_writer,
    )

    out = Path(cfg.output_dir).expanduser()  # where the run writes: its folder if it exists
    writable_folder("output-dir", out / overrides["run-name"] if overrides.get("run-name") else out)
    overrides["output-dir"] = str(out.resolve())
    made = None
    if not overrides.get("run-name"):
        stem = "-".join([cfg.method, *([kind] if kind else [])])
        made = new_folder(Path(overrides["output-dir"]), stem)
        overrides["run-name"] = made.name
    run_dir = Path(overrides["output-dir"]) / overrides["run-name"]
    if made is None and make_folder(run_dir):
        made = run_dir  # else it was there: a run to resume, or refused below
    # refused there: the folder is another launcher's, even where this one made it a moment ago
    with folder_in_use("run-name", run_dir):
        try:
            refuse_live_writer(run_dir)  # a ServerApp that outlived its launcher
            check_run_dir(overrides)
            yield
        except BaseException:
            if made is not None:
                with contextlib.suppress(OSError):
                    made.rmdir()  # only if empty
            raise


def run_log(overrides: dict[str, Any]) -> Path:
    """A run's whole console output, kept beside its folder (as a comparison's ``<label>.log``;
    a resumed run appends to it)."""
    return Path(overrides["output-dir"]) / f"{overrides['run-name']}.log"


def check_run_dir(overrides: dict[str, Any]) -> None:
    """A new run into a folder that holds a run, or a resume of a run that finished as many
    rounds as asked: refused here, not after the simulation has started."""
    from flowerbed.results import refuse_existing

    run_dir = Path(overrides["output-dir"]) / overrides["run-name"]
    if not overrides.get("resume"):
        refuse_existing(run_dir)
        return
    from flowerbed.checkpoint import finished_reason

    asked = Config.from_run_config(overrides).num_server_rounds
    if reason := finished_reason(run_dir, asked):  # anything else the ServerApp names
        raise ConfigError("num-server-rounds", asked, reason)


COMPARE_DEFAULTS = {"partition": "dirichlet:0.5", "num-server-rounds": 20, "seed": 0}


def compare_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The preset, then -c, then --partition/--rounds/--seed where given; a key none of them
    sets gets the launcher's default (dirichlet:0.5, 20 rounds, seed 0)."""
    return _with_shortcuts({**COMPARE_DEFAULTS, **_overrides(args)}, args)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError("--seeds", text, "expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError("--seeds", text, "expected distinct comma-separated integers, e.g. 0,1,2")
    return seeds


def cmd_compare(args: argparse.Namespace) -> int:
    from flowerbed import compare as cmp
    overrides = compare_overrides(args)
    args.num_clients = 10 if args.num_clients is None else args.num_clients
    if args.resume and not args.out:
        raise ConfigError("--resume", True, "needs --out: the folder of the comparison to continue")
    seeds = _seeds(args.seeds) if args.seeds else None
    if seeds and args.seed is not None:
        raise ConfigError("--seed", args.seed, "give either --seed or --seeds, not both")
    methods = cmp.split_methods(args.methods)
    cmp.check_labels(methods, seeds)
    out = writable_folder("--out", args.out) if args.out else None  # checked before a folder is made
    if out:
        cmp.check_out(out, args.resume, seeds)
    for m in methods:
        rc = {**overrides, **cmp.parse_variant(m)[1]}
        if rc.get("resume"):
            raise ConfigError("resume", rc["resume"], "compare continues a comparison with --out "
                              "<its folder> --resume, not a run's resume key")
        for key in ("output-dir", "run-name"):  # compare places each run itself
            if rc.get(key):
                raise ConfigError(key, rc[key], "compare writes each run to <--out>/<method>: "
                                  "give the comparison's folder with --out")
        for s in seeds or [rc["seed"]]:
            preflight({**rc, "seed": s}, args.num_clients, args.gpus_per_client)
    from flowerbed.engine import federation_config

    federation_config(args.num_clients, args.cpus_per_client, args.gpus_per_client)  # refused
    out = out or cmp.default_out()  # made here, once nothing was refused
    kw = {"num_clients": args.num_clients, "cpus_per_client": args.cpus_per_client,
          "gpus_per_client": args.gpus_per_client, "out": out, "resume": args.resume}
    table = (cmp.compare_seeds(methods, overrides, seeds, **kw) if seeds
             else cmp.compare(methods, overrides, **kw))
    print(table)
    if failed := cmp.failed_runs(out):
        log.error("compare: %d run(s) failed: %s (their logs are in %s)", len(failed),
                  ", ".join(failed), out.resolve())
        return 1
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from flowerbed.registry import METHODS

    width = max(map(len, METHODS))
    for name, m in METHODS.items():
        print(f"{name:<{width}}  {m.summary}")
    print("\n(run one: flowerbed run --method <name>, or plain flwr run's --run-config \"method='<name>'\";"
          "\n every key and its default: pyproject.toml, [tool.flwr.app.config])")
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    from flowerbed.compare import failed_runs
    from flowerbed.run_table import table_of_runs

    table, out = table_of_runs([Path(p) for p in args.run_dirs],
                               writable_folder("--out", args.out) if args.out else None)
    print(table)
    if failed := failed_runs(out):  # as compare does: a script can tell a table with holes
        log.error("table: %d run(s) did not finish or cannot be read: %s", len(failed), ", ".join(failed))
        return 1
    return 0


def cmd_partitions(args: argparse.Namespace) -> int:
    from flowerbed.datasets.federated import client_partitions, train_set
    from flowerbed.datasets.partition import label_histogram, plot_histogram, warn_unheld

    given = {"dataset": args.dataset, "partition": args.partition, "seed": args.seed,
             "data-root": args.data_root, "min-partition-size": args.min_partition_size}
    cfg = Config.from_run_config({**_overrides(args), **{k: v for k, v in given.items() if v is not None}})
    # the plot's file first: a bad --out used to come after the whole table
    name = f"partitions-{cfg.dataset}-{str(cfg.partition).replace(':', '')}.png"
    out = Path(args.out or name).expanduser()
    if out.is_dir() or str(args.out or "").endswith("/") or (args.out and not out.suffix):
        out = out / name  # a folder (made if new): the default name in it
    writable_folder("--out", out.parent)
    from matplotlib.figure import Figure

    if out.suffix.lower()[1:] not in (kinds := Figure().canvas.get_supported_filetypes()):
        raise ConfigError("--out", args.out, f"a file matplotlib can write ({', '.join(kinds)}) "
                          "or a folder")
    train = train_set(cfg)
    with clients_are_partitions(args.num_clients):
        parts = client_partitions(cfg, args.num_clients)
    warn_unheld(train.y.numpy(), parts, cfg.partition)  # as the server does
    hist = label_histogram(train.y.numpy(), parts, train.num_classes)
    width = max(6, len(str(hist.max())) + 1)
    print(f"{cfg.dataset} {cfg.partition} seed={cfg.seed}: {args.num_clients} clients")
    print("client " + "".join(f"{c:>{width}}" for c in range(train.num_classes)) + f"{'total':>8}")
    for i, row in enumerate(hist):
        print(f"{i:>6} " + "".join(f"{v:>{width}}" for v in row) + f"{row.sum():>8}")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_histogram(train.y.numpy(), parts, out, f"{cfg.dataset} {cfg.partition} (seed {cfg.seed})")
    print(f"plot: {out.resolve()}")
    return 0


def cmd_superlink(args: argparse.Namespace) -> int:
    from flowerbed import engine

    home = Path(args.home).expanduser() if args.home else engine.shared_home()
    if args.action == "up":
        writable_folder("--home", home)
        pid = engine.superlink_up(home, port=args.port)
        print(f"SuperLink pid {pid} on 127.0.0.1:{args.port} (simulation, this venv, no per-run installs)")
        print(f"now: FLWR_HOME={home} flwr run . --stream --federation-config "
              f"\"num-supernodes=10 client-resources-num-cpus=1\"")
    else:
        pid = engine.superlink_down(home)
        print(f"no SuperLink was started by flowerbed from {home}" if pid is None
              else f"stopped SuperLink pid {pid}")
    return 0


DEPLOY_ADDRESS, DEPLOY_PORT = "127.0.0.1", 8000  # deploy up's SuperLink, by default
# deploy's options that only some of its actions read: (argparse dest, those actions); given to
# another action, one is refused rather than ignored (`deploy up --method fedx` ran nothing of it)
DEPLOY_OPTION_ACTIONS = {
    "--home": ("home", ("up", "run", "status", "down", "certs", "node-key")),
    "--num-clients": ("num_clients", ("up", "run", "export-data")),
    "--address": ("address", ("certs", "up")),
    "--port": ("port", ("up",)),
    "--host-bind": ("host_bind", ("up",)),
    "--host": ("host", ("certs", "up")),
    "--insecure": ("insecure", ("up",)),
    "--force": ("force", ("certs", "node-key", "export-data")),
    "--auth": ("auth", ("up",)),
    "--data-root": ("data_root", ("up",)),
    "--data-dirs": ("data_dirs", ("up",)),
    "--out": ("out", ("certs", "node-key", "export-data")),
    "--preset": ("preset", ("run", "export-data")),
    "--run-config": ("run_config", ("run", "export-data")),
    "--resume": ("resume", ("run",)),
    **{f"--{opt}": (opt, ("run", "export-data")) for opt in SHORTCUTS},
}


def check_deploy_options(args: argparse.Namespace) -> None:
    """A ConfigError for an option given to a deploy action that does not read it."""
    for opt, (dest, actions) in DEPLOY_OPTION_ACTIONS.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False and value not in ("", []) \
                and args.action not in actions:  # (0 == False: `--seed 0` is given)
            raise ConfigError(opt, value, f"only `deploy {' / '.join(actions)}` reads it, "
                                          f"not `deploy {args.action}`")


def cmd_deploy(args: argparse.Namespace) -> int:
    from flowerbed import certs, deploy

    check_deploy_options(args)
    home = Path(args.home).expanduser() if args.home else deploy.DEFAULT_HOME
    if args.action in ("certs", "node-key", "up"):  # (a file there: a bare OSError after the work)
        writable_folder("--home", home)
    args.address = args.address or DEPLOY_ADDRESS
    args.port = args.port or DEPLOY_PORT
    if args.action in ("certs", "up"):  # a certificate may name a host only the clients resolve
        deploy.check_address(args.address, resolve=args.action == "up")
        for h in args.host:
            deploy.check_address(h, resolve=False, option="--host")
        if args.host_bind:
            deploy.check_address(args.host_bind, resolve=False, option="--host-bind")
    if args.action == "certs":
        hosts = list(dict.fromkeys([*certs.DEFAULT_HOSTS, args.address, *args.host]))
        out = writable_folder("--out", args.out or home / "certs")
        if (out / certs.CA_CERT).exists() and not args.force:
            raise ConfigError("--out", str(out), f"holds certificates already ({certs.CA_CERT}); "
                              "new ones need a new CA, so every SuperNode would need the new "
                              f"{certs.CA_CERT}: pass --force to replace them")
        files = certs.make_certs(out, hosts)
        print(f"CA {files['ca']}, SuperLink certificate {files['cert']} (+ key) for {', '.join(hosts)}")
    elif args.action == "node-key":
        key = Path(args.out or home / "keys" / "supernode-0")  # the private key's file
        writable_folder("--out", key.parent)
        pub = certs.make_node_key(key, force=args.force)
        print(f"private key {pub.with_suffix('')}, public key {pub} "
              f"(register it: flwr supernode register {pub} <connection>)")
    elif args.action == "export-data":
        cfg = Config.from_run_config(_with_shortcuts(_overrides(args), args))
        from flowerbed.datasets.federated import client_folders, export_partitions

        n = 2 if args.num_clients is None else args.num_clients
        out = writable_folder("--out", args.out or "client-data")  # before the data loads
        if (earlier := [p.name for p in client_folders(out)]) and not args.force:
            raise ConfigError("--out", str(out), f"holds client data folders ({', '.join(earlier[:3])}"
                              f"{', ...' if len(earlier) > 3 else ''}); give another --out, or "
                              "--force to replace them")
        with clients_are_partitions(n):
            written = export_partitions(cfg, n, out, replace=args.force)
        for f in written:
            print(f"{f}: {json.loads((f / 'partition.json').read_text())['num-train']} train samples")
    elif args.action == "up":
        if args.data_dirs and not Path(args.data_dirs).is_dir():
            raise ConfigError("--data-dirs", args.data_dirs, "no such folder (make it with "
                              "`flowerbed deploy export-data --out <folder>`)")
        if args.data_dirs:  # one SuperNode per exported client folder, client-0 ... client-<n-1>
            from flowerbed.datasets.federated import client_folders

            ids = [int(d.name[7:]) for d in client_folders(Path(args.data_dirs))]
            if not ids or ids != list(range(len(ids))) or args.num_clients not in (None, len(ids)):
                raise ConfigError("--num-clients", args.num_clients, f"{args.data_dirs} holds client "
                                  f"folders {ids or 'none'}; start one SuperNode per folder, "
                                  "client-0 ... client-<n-1>")
            args.num_clients = len(ids)
        args.num_clients = 2 if args.num_clients is None else args.num_clients
        if args.num_clients < 1:
            raise ConfigError("--num-clients", args.num_clients, "must be >= 1 (one SuperNode each)")
        data_root = str(Path(args.data_root).expanduser().resolve()) if args.data_root else ""
        extra = [{"data-root": data_root,  # SuperNodes run in the project folder, not here
                  "data-dir": str(Path(args.data_dirs).resolve() / f"client-{i}") if args.data_dirs else ""}
                 for i in range(args.num_clients)]
        dep = deploy.up(deploy.Deployment(home=home, address=deploy.with_port(args.address, args.port),
                                          insecure=args.insecure, auth=args.auth,
                                          own_data=bool(args.data_dirs)),
                        args.num_clients, host=args.host_bind or deploy.bind_for(args.address),
                        node_extra=extra, cert_hosts=args.host)
        print(f"SuperLink on {dep.address} ({'insecure' if dep.insecure else 'TLS'}"
              f"{', SuperNode auth' if dep.auth else ''}), {args.num_clients} SuperNodes; "
              f"logs in {dep.home / 'logs'}")
        print(f"now: flowerbed deploy run{deploy.home_option(dep.home)} --method fedavg   or   "
              f"FLWR_HOME={dep.home} flwr run . {deploy.CONNECTION} --stream")
    elif args.action == "run":
        overrides, resumed_n = with_resume(args, _with_shortcuts(_overrides(args), args))
        dep = deploy.Deployment.load(home)
        deploy.check_superlink(dep)  # before the data loads for the split check
        n = dep.supernodes()
        if resumed_n and resumed_n != n:
            raise ConfigError("--resume", args.resume, f"the run has {resumed_n} clients "
                              f"(partitions) and the deployment in {dep.home} {n} SuperNodes; a "
                              "resumed run keeps its clients (`deploy up --num-clients` sets them)")
        if args.num_clients not in (None, n):
            raise ConfigError("--num-clients", args.num_clients, f"the deployment in {dep.home} has "
                              f"{n} SuperNodes (`deploy up --num-clients` sets them)")
        # as `run` does, before anything starts: the split is checked unless the SuperNodes
        # read their own data folders (then each one's data is what it holds)
        try:
            cfg = (Config.from_run_config(overrides) if dep.own_data
                   else preflight(overrides, n, 0.0, warn=False))
        except ConfigError as e:
            if e.key != "--num-clients":
                raise
            raise ConfigError("--num-clients", n, f"{e.allowed}: the deployment in {dep.home} has {n} "
                              "SuperNodes (`deploy up --num-clients` sets them)") from None
        with place_run(overrides, cfg, "deploy"):
            print(json.dumps(deploy.run(dep, overrides, log_file=run_log(overrides), tee=True), indent=2))
    elif args.action == "status":
        dep = deploy.Deployment.load(home)
        for name, pid in dep.pids.items():
            print(f"{name:>14} pid {pid}: {'running' if dep.alive(name) else 'gone'}")
        if dep.superlink_gone():
            print(f"the SuperLink is gone: restart with `flowerbed deploy down{deploy.home_option(home)}`, "
                  "then `up`")
        else:
            n = deploy.online_nodes(dep)
            print(f"SuperNodes online (flwr supernode list): "
                  f"{'unknown (the SuperLink did not answer)' if n is None else n}")
    elif not (home / "pids.json").exists():  # as `superlink down`: not an error
        print(f"no deployment was started from {home.resolve()}: nothing to stop")
    else:
        print("stopped: " + ", ".join(deploy.down(deploy.Deployment.load(home))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowerbed", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="one simulation through a local SuperLink and `flwr run`")
    _shortcut_args(r, defaults(), method=True)
    _federation_args(r, resumable=True)
    r.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last complete round (its config and "
                        "client count are reused; --rounds N extends it)")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("compare", help="several methods on identical partitions and seeds")
    c.add_argument("--methods", required=True,
                   help="comma-separated names or variants, e.g. fedavg,fedprox,scaffold or "
                        "\"fedsimclr,fedx,fedbyol,fedx@fedx-base='byol'\" (quoted, so that the "
                        "shell keeps the TOML string's quotes)")
    _shortcut_args(c, {**defaults(), **COMPARE_DEFAULTS})
    c.add_argument("--seeds", default=None,
                   help="comma-separated seeds, e.g. 0,1,2: every method once per seed "
                        "(<out>/seed-<s>/), then a table of mean ± std over the seeds")
    c.add_argument("--out", default=None, help="output folder (default runs/compare-<time>)")
    c.add_argument("--resume", action="store_true",
                   help="with --out of an earlier compare: keep finished runs, resume stopped ones")
    _federation_args(c)
    c.set_defaults(fn=cmd_compare)

    sub.add_parser("methods", help="the methods: the values of the run-config key `method`"
                   ).set_defaults(fn=cmd_methods)

    t = sub.add_parser("table", help="a comparison's table and plots from runs made separately")
    t.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run folders (or folders of runs, e.g. a comparison's): they must share "
                        "their data (data set, partition, seed, clients, samples)")
    t.add_argument("--out", default=None, help="output folder (default runs/table-<time>)")
    t.set_defaults(fn=cmd_table)

    u = sub.add_parser("superlink", help="start/stop a background SuperLink for plain `flwr run .`")
    u.add_argument("action", choices=["up", "down"])
    u.add_argument("--port", type=port, default=39191, help="SuperLink port (default 39191)")
    u.add_argument("--home", default=None, help="its FLWR_HOME (default .flwr-home/; `down` also "
                   "stops the SuperLink of a killed launcher, .flwr-home/local-<pid>-<port>/)")
    u.set_defaults(fn=cmd_superlink)

    d = sub.add_parser("deploy", help="Flower's deployment engine: SuperLink + SuperNodes as processes")
    d.add_argument("action", choices=["up", "run", "status", "down", "certs", "node-key", "export-data"])
    d.add_argument("--home", default=None,
                   help="folder for the deployment's state, logs, certificates (default "
                        "<project>/.flwr-deploy, wherever the command runs)")
    d.add_argument("--num-clients", type=int, default=None,
                   help="SuperNodes to start / partitions to export (default 2; up --data-dirs: "
                        "one per client-<i> folder)")
    d.add_argument("--address", default=None, help="address SuperNodes and flwr use to reach "
                   f"the SuperLink (default {DEPLOY_ADDRESS})")
    d.add_argument("--port", type=port, default=None, help=f"SuperLink port (default {DEPLOY_PORT})")
    d.add_argument("--host-bind", default=None,
                   help="interface the SuperLink listens on (default: the --address itself "
                        "where it is a loopback address, else all interfaces, 0.0.0.0 or :: for "
                        "an IPv6 address)")
    d.add_argument("--host", action="append", default=[],
                   help="extra name/IP for the SuperLink's TLS certificate (repeatable)")
    d.add_argument("--insecure", action="store_true", help="no TLS (plain HTTP); only when asked")
    d.add_argument("--force", action="store_true",
                   help="certs, node-key, export-data: replace existing certificates (and their "
                        "CA), key pair, or exported client folders")
    d.add_argument("--auth", action="store_true",
                   help="SuperNode authentication: only registered keys may connect")
    d.add_argument("--data-root", default="", help="data set folder the SuperNodes read")
    d.add_argument("--data-dirs", default="",
                   help="folder from `export-data`: SuperNode i reads only <folder>/client-i")
    d.add_argument("--out", default=None, help="certs / node-key / export-data: where to write")
    d.add_argument("--preset", action="append", default=None,
                   help="run / export-data: a TOML file of run-config values (repeatable, a later one wins)")
    _shortcut_args(d, defaults(), method=True)  # run / export-data
    d.add_argument("--run-config", "-c", action="append", default=[],
                   help="run / export-data: run-config overrides, flwr syntax")
    d.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="run: continue the run in RUN_DIR from its last complete round (its config "
                        "is reused; --rounds N extends it)")
    d.set_defaults(fn=cmd_deploy)

    s = sub.add_parser("partitions", help="print and plot the per-client label histogram")
    s.add_argument("--dataset", default=None, help="default: the preset's or -c's, else fashion-mnist")
    s.add_argument("--partition", default=None, help="default: the preset's or -c's, else dirichlet:0.5")
    s.add_argument("--num-clients", type=int, default=10, help="clients to split among (default 10)")
    s.add_argument("--seed", type=int, default=None, help="default: the preset's or -c's, else 0")
    s.add_argument("--data-root", default=None,
                   help="folder holding the data set's files (default: as a run finds them)")
    s.add_argument("--min-partition-size", type=int, default=None,
                   help="dirichlet: redraw until every client has this many samples "
                        "(default: the preset's or -c's, else 10)")
    s.add_argument("--preset", action="append", default=None,
                   help="a TOML file of run-config values: shows the split that preset's runs use "
                        "(repeatable, a later one wins)")
    s.add_argument("--run-config", "-c", action="append", default=[],
                   help="run-config overrides (train-samples, public-fraction, ...), flwr syntax")
    s.add_argument("--out", default=None, help="the plot: a file (PNG, PDF, SVG, ...) or a folder "
                   "(default: partitions-<data set>-<partition>.png here)")
    s.set_defaults(fn=cmd_partitions)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``kill``, a closed terminal, a lost SSH session), raised so that it
    ends a command as Ctrl-C does: the run stopped on its SuperLink, our processes stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt():
    """While a command runs, the first Ctrl-C (SIGINT) raises KeyboardInterrupt, the first SIGTERM
    or SIGHUP :class:`Terminated`; from then on until the command returns, every further one is
    noted, not raised: the way out is the clean-up (the run stopped on its SuperLink, our
    processes stopped, each step bounded), and a second Ctrl-C that landed between two of its
    steps left the SuperLink and the simulation running. An ignored one (nohup's SIGHUP) stays
    ignored; the earlier handlers come back afterwards. Main thread only, where Python delivers
    signals. (``engine.shielded`` guards the clean-ups that start without a signal.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    watched = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(s) is not signal.SIG_IGN]

    def note(signum, frame):
        log.warning("still stopping (%s); a moment", signal.Signals(signum).name)

    note.notes_only = True  # (engine.shielded: not a signal to pass on after its clean-up)

    def interrupt(signum, frame):
        for s in watched:
            signal.signal(s, note)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    old = {s: signal.signal(s, interrupt) for s in watched}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with signals_interrupt():
            return int(args.fn(args) or 0)
    except ConfigError as e:
        print(f"flowerbed: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head` closed the output; what ran is on disk and in its logs
        with contextlib.suppress(OSError):  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as e:  # what was running is stopped on the way out (flwr_run, up)
        print(f"flowerbed: {'terminated' if isinstance(e, Terminated) else 'interrupted'}",
              file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback, for users
        from flowerbed.datasets.loading import DataError
        from flowerbed.deploy import DeployError
        from flowerbed.engine import EngineError

        # OSError: a path given that cannot be used (a file where a folder must be, no such
        # folder, no permission): its message names the path
        if isinstance(e, DataError | EngineError | DeployError | OSError):
            print(f"flowerbed: error: {e}", file=sys.stderr)
            return 1
        raise
