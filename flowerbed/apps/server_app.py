"""ServerApp: validate the config, meet the nodes, run the method's strategy, write results."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from flowerbed import checkpoint, client_state, faults
from flowerbed.config import (
    DISTILL_METHODS,
    SSL_METHODS,
    Config,
    ConfigError,
    defaults,
    normalised_settings,
    reads,
)
from flowerbed.datasets.federated import client_partitions, full_train, split_settings, test_set, train_set
from flowerbed.datasets.partition import labels_digest, warn_unheld
from flowerbed.registry import METHODS
from flowerbed.results import (
    RunDir,
    make_folder,
    measure,
    new_folder,
    read_json,
    refuse_existing,
    software,
    writable_folder,
)
from flowerbed.strategies.base import WHOAMI, cast_like
from flowerbed.training import pick_device

log = logging.getLogger("flowerbed")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        cfg = Config.from_run_config(context.run_config)
    except ConfigError as e:
        log.error("%s", e)
        raise
    try:
        run(grid, cfg)
    except (checkpoint.CheckpointError, NothingAggregated, ClientSetupError) as e:
        log.error("%s", e)
        raise


class NothingAggregated(RuntimeError):
    """Every round of a run was skipped: no client reply was ever aggregated."""


class ClientSetupError(RuntimeError):
    """No node could say which partition it serves: each replied with an error (its data or
    the split is impossible)."""


def wait_for_nodes(grid: Grid, n: int, timeout: float = 120.0) -> list[int]:
    """Wait until ``n`` nodes are connected (right after start the list can be empty)."""
    t0 = time.time()
    while len(ids := sorted(grid.get_node_ids())) < n:
        if time.time() - t0 > timeout:
            raise TimeoutError(f"only {len(ids)} of the {n} nodes (min-clients) connected "
                               f"within {timeout:g} s: start more SuperNodes (a simulation: "
                               "num-supernodes in --federation-config) or lower min-clients")
        time.sleep(0.2)
    return ids


def default_run_name(cfg: Config) -> str:
    """A plain ``flwr run`` without run-name: a new folder named for the method, data set,
    partition, seed and time (the launcher names its runs itself)."""
    part = str(cfg.partition).replace(":", "")
    return new_folder(Path(cfg.output_dir), f"{cfg.method}-{cfg.dataset}-{part}-s{cfg.seed}").name


def check_output(cfg: Config) -> None:
    """Where a new run writes: a folder that cannot be one, or a run-name that holds a run, is
    refused before the data loads and the nodes are asked (the launcher checks this too; plain
    `flwr run` gets it here)."""
    if cfg.resume:  # its folder is checked with its checkpoint
        return
    out = Path(cfg.output_dir).expanduser()
    writable_folder("output-dir", out / cfg.run_name if cfg.run_name else out)
    make_folder(out)  # where the kernel refuses it (/proc/...), though the checks above pass
    if cfg.run_name:
        refuse_existing(out.resolve() / cfg.run_name)


def warn_runtime_env(env: str) -> None:
    """A ServerApp in an environment Flower built for the run (a SuperLink started without
    ``--disable-runtime-dependency-installation``, e.g. the managed ``:local:`` one) runs
    pyproject's unpinned dependencies, not the project's .venv: said, since the figures may
    differ."""
    if f"{os.sep}runtime-envs{os.sep}" in env + os.sep:
        log.warning("this run uses an environment Flower built for it (%s: torch %s), not the "
                    "project's .venv; for .venv, start the SuperLink with "
                    "--disable-runtime-dependency-installation (`flowerbed run` and `flowerbed "
                    "superlink up` do)", env, torch.__version__)


def warn_unused_data(cfg: Config, test) -> None:
    """Settings that leave data out of a run, or ask for more than there is: each a warning."""
    if cfg.method in SSL_METHODS and cfg.local_test_fraction > 0:
        log.warning("%s's clients never evaluate: local-test-fraction=%g holds that share of each "
                    "client's data out of training, unused; set it to 0 (the fedx presets do)",
                    cfg.method, cfg.local_test_fraction)
    if cfg.public_fraction > 0 and cfg.method not in DISTILL_METHODS:
        log.warning("public-fraction=%g sets that share of the training set aside as the public set, "
                    "which %s does not use: its clients train on the rest (as the distillation "
                    "methods' clients do, so that such runs compare on the same private data)",
                    cfg.public_fraction, cfg.method)
    if unread := [f"{k}={v}" for k, v in cfg.to_run_config().items()
                  if v != defaults()[k] and not reads(cfg.method, k)]:
        log.warning("%s does not read %s (keys only some methods read: config.KEY_READERS); this "
                    "run is as it would be without them", cfg.method, ", ".join(unread))
    for key, asked, there in (("train-samples", cfg.train_samples, len(full_train(cfg))),
                              ("test-samples", cfg.test_samples, len(test))):
        if asked > there:
            log.warning("%s=%d is more than the %d samples %s has: all %d are used", key, asked,
                        there, cfg.dataset, there)


def client_data(folders: dict[int, tuple[str, dict[str, Any]]], cfg: Config,
                num_partitions: int, answered: Any = (), warn: bool = True) -> dict[str, Any]:
    """config.json's ``client-data`` (None: the seeded split) where clients train on their own
    data folders (``deploy up --data-dirs``, ``data-dir=`` in a SuperNode's node config), as the
    nodes that answered so far report them (:class:`ClientDataRecord` adds later ones): how many of
    the clients, and the split
    settings their exports record (normalised as the run config's; one dict where they agree,
    else each partition's, {} for a folder without partition.json; and by partition, null for
    one on the seeded split), so that a run on exported folders is not taken for a run of its
    run config's split (``flowerbed table`` compares it). Warns (``warn``) where an export's
    settings differ from the run config's."""
    if not folders:
        return {"client-data": None}  # the seeded split
    run = split_settings(cfg)
    settings = {pid: normalised_settings(exported) for pid, (_, exported) in sorted(folders.items())}
    distinct = {json.dumps(e, sort_keys=True) for e in settings.values()}
    exported_with = next(iter(settings.values())) if len(distinct) == 1 else {
        str(pid): e for pid, e in settings.items()}
    differ = sorted({k for e in settings.values() for k, v in e.items() if k in run and v != run[k]})
    if differ and warn:
        exported = sum(bool(e) for e in settings.values())
        log.warning("%d of %d clients train on their own data folders (%d exported with %s; this "
                    "run's config has %s): they train on their folders' split%s; config.json records "
                    "both (client-data)", len(folders), num_partitions, exported,
                    ", ".join(f"{k}=" + "/".join(sorted({repr(e[k]) for e in settings.values() if k in e}))
                              for k in differ), ", ".join(f"{k}={run[k]!r}" for k in differ),
                    f", the other {num_partitions - len(folders)} on the run config's"
                    if len(folders) < num_partitions else "")
    return {"client-data": {"own-folders": len(folders), "clients": num_partitions,
                            "exported-with": exported_with,  # and each partition that answered:
                            "by-partition": {str(p): settings.get(p) for p in sorted({*answered, *folders})}}}


#: how to resume a run whose clients read other data than it started on
SERVE_THE_SAME = ("resume it where the same data is served (deploy up --data-dirs with the same "
                  "folders, then deploy run --resume)")


class ClientDataRecord:
    """config.json's ``client-data``, kept as nodes join: each partition is recorded with the
    data it read when it first answered, in this attempt or (a resumed run) an earlier one. A
    node that joins after round 1 is added (one that comes back with other data than its
    partition first read, in this attempt or, through :meth:`hold`, an earlier one, is left out
    by the strategy, :attr:`FlowerbedFedAvg.first_data`); should one with other data than an
    earlier attempt's record still be trained, :attr:`refusal` stops the ServerApp after that
    round's checkpoint."""

    def __init__(self, strategy: Any, cfg: Config, num_partitions: int) -> None:
        self.cfg, self.num_partitions = cfg, num_partitions
        self.answered = {*strategy.data_folders, *strategy.node_of}  # in this attempt
        self.first: dict[int, dict[str, Any] | None] = {}
        self._add(strategy, self.answered)
        self.now = self.value = client_data(strategy.data_folders, cfg, num_partitions, self.answered)
        self.refusal: ConfigError | None = None
        self.path = Path()

    @staticmethod
    def reads(strategy: Any, p: int) -> dict[str, Any] | None:
        """What partition ``p``'s node reads as its last accepted answer: its folder's export
        settings, or None for the seeded split."""
        return normalised_settings(strategy.data_folders[p][1]) if p in strategy.data_folders else None

    def _add(self, strategy: Any, partitions: set[int]) -> None:
        for p in partitions:
            self.first.setdefault(p, self.reads(strategy, p))

    def _render(self) -> dict[str, Any]:
        folders = {p: ("", e) for p, e in self.first.items() if e is not None}
        return client_data(folders, self.cfg, self.num_partitions, self.first, warn=False)

    def keep_earlier(self, earlier: Any, path: Path) -> None:
        """A resumed run (in ``path``): the partitions an earlier attempt recorded keep that
        record (those that answered this attempt were checked against it,
        :func:`check_resumed_data`)."""
        self.path = path
        if isinstance(earlier, dict) and isinstance(earlier.get("by-partition"), dict):
            for p, e in earlier["by-partition"].items():
                self.first.setdefault(int(p), e)
            self.value = self._render()

    def hold(self, strategy: Any) -> None:
        """A resumed run: each partition an earlier attempt recorded must serve that data in this
        one too, so a late node with other data is left out of the rounds by the strategy (its
        :attr:`first_data`) rather than trained on (:attr:`refusal` stays as a backstop)."""
        for p, e in self.first.items():
            strategy.first_data.setdefault(p, normalised_settings(e) if isinstance(e, dict) else None)

    def joined(self, strategy: Any) -> dict[str, Any] | None:
        """The new ``client-data`` where partitions that answered since changed the record."""
        new = {*strategy.data_folders, *strategy.node_of} - self.answered
        if not new:
            return None
        self.answered |= new
        known = {p: self.first[p] for p in new if p in self.first}
        self._add(strategy, new)
        now = {p: self.reads(strategy, p) for p in known}
        if changed := sorted(p for p in known if now[p] != known[p]):
            p = changed[0]
            self.refusal = ConfigError("resume", str(self.path), (
                f"partition {p}'s client read {json.dumps(known[p])} when the run started and reads "
                f"{json.dumps(now[p])} now (null: the seeded split; it answered late in this attempt): "
                + SERVE_THE_SAME))
        value = self._render()
        if value == self.value:
            return None
        log.info("partition%s %s answered after round 1 of this attempt: config.json's client-data now "
                 "records %s", "s" * (len(new) > 1), ", ".join(map(str, sorted(new))),
                 "them" if len(new) > 1 else "it")
        self.value = value
        return value


def check_resumed_data(earlier: dict[str, Any], now: dict[str, Any], path: Path,
                       answered: Any = ()) -> None:
    """A resumed run must read the data it started on: config.json's ``client-data`` records,
    for each partition that answered, its own folder's export settings or (null) the seeded
    split. Partitions both record are compared (a node late to answer is no difference; where
    ``now`` is the seeded split, ``answered`` are the partitions it holds for null); runs made
    before it was recorded per partition are not checked."""
    if "client-data" not in earlier:
        return
    before, after = earlier["client-data"], now.get("client-data")
    if isinstance(before, dict) and not isinstance(before.get("by-partition"), dict):
        return

    def parts(data: Any) -> dict[str, Any]:  # {} for the seeded split: every partition null
        return data["by-partition"] if isinstance(data, dict) else {}

    b, a = parts(before), parts(after) or {str(p): None for p in answered}
    if all(b.get(p) == a.get(p) for p in (set(b) & set(a) if b and a else set(b) | set(a))):
        return

    def said(data: Any) -> str:
        return ("the seeded split" if not isinstance(data, dict) else f"their own data folders, "
                f"exported with {json.dumps(data.get('exported-with'))} ({data.get('own-folders')} of "
                f"{data.get('clients')} clients)")
    raise ConfigError("resume", str(path), f"its clients trained on {said(before)}; this run's "
                      f"clients read {said(after)}: " + SERVE_THE_SAME)


def run(grid: Grid, cfg: Config) -> dict[str, Any]:
    """The whole run; returns the summary also written to ``summary.json``."""
    method = METHODS[cfg.method]
    check_output(cfg)
    warn_runtime_env(software()["environment"])
    torch.manual_seed(cfg.seed)
    train, test = train_set(cfg), test_set(cfg)
    wait_for_nodes(grid, cfg.min_clients)
    strategy = method.strategy(cfg)
    strategy.train_labels = labels_digest(train.y)  # what every node's seeded split must be made from
    num_partitions = strategy.discover(grid, wait_all=60.0, timeout=cfg.round_timeout)
    if num_partitions == 0:
        nodes = len(list(grid.get_node_ids()))
        if strategy.whoami_error:  # e.g. an impossible split under plain `flwr run`
            raise ClientSetupError(f"none of the {nodes} connected nodes could serve a partition; "
                                   f"they replied: {strategy.whoami_error}")
        raise TimeoutError(f"none of the {nodes} connected nodes said which partition it serves "
                           f"(the '{WHOAMI}' message) within {cfg.round_timeout:g} s "
                           "(round-timeout; a node's first reply waits for its data to load); "
                           "errors they replied, if any, are logged above. On a loaded machine "
                           "raise round-timeout.")
    # impossible splits stop here, before round 1; not when every client reads its own folder,
    # where the run config's split is nobody's (`flowerbed run` skips that check too)
    if len(strategy.data_folders) < num_partitions:
        warn_unheld(train.y.numpy(), client_partitions(cfg, num_partitions), cfg.partition)
    strategy.check_setup(num_partitions)
    if num_partitions < cfg.min_clients:
        raise ConfigError("min-clients", cfg.min_clients,
                          f"larger than the number of clients ({num_partitions})")
    strategy.model = method.model(cfg, train)
    device = pick_device(cfg.server_device)
    identity = {**cfg.to_run_config(), "num-partitions": num_partitions}  # what a resume must match
    ckpt, output_dir, run_name = _resume_point(cfg, identity)
    data_record = ClientDataRecord(strategy, cfg, num_partitions)
    if ckpt is not None:
        earlier = read_json(Path(output_dir) / run_name / "config.json")
        check_resumed_data(earlier, data_record.now, Path(output_dir) / run_name, data_record.answered)
        data_record.keep_earlier(earlier.get("client-data"), Path(output_dir) / run_name)
        data_record.hold(strategy)
    described = {**identity, "server-device-used": str(device), "software": software(), **strategy.describe(),
                 **data_record.value}
    with RunDir(output_dir, run_name, described,
                resume_round=ckpt["round"] if ckpt else None) as run_dir:  # this ServerApp's till it ends
        strategy.run_key = client_state.run_key(run_dir.path, run_dir.run_id)
        strategy.resumed_after = list(run_dir.config.get("resumed-after-rounds", []))
        warn_unused_data(cfg, test)
        log.info("run directory: %s | %s on %s, %s, %d clients, server device %s | acc: %s",
                 run_dir.path, cfg.method, cfg.dataset, cfg.partition, num_partitions, device,
                 measure(cfg.method))  # what each round's "acc" is

        last = {"t": time.time()}
        # best over trained rounds: round 0 (the initial model; for the self-supervised methods the
        # random-init probe, reported as initial-accuracy) is not a result of training
        best: dict[str, Any] = {"accuracy": None, "round": None}
        for r in run_dir.rows:  # a resumed run continues the best-so-far of the rows it keeps
            if r["round"] > 0 and r.get("accuracy") is not None and (
                    best["accuracy"] is None or r["accuracy"] > best["accuracy"]):
                best.update(accuracy=r["accuracy"], round=r["round"])

        def end_of_round(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
            row: dict[str, Any] = {"round": rnd, "rounds": cfg.num_server_rounds}
            res = (strategy.evaluate_global(rnd, arrays, train, test, device)
                   if rnd == 0 or strategy.evaluates(rnd) else None)
            nan_model = res is not None and not math.isfinite(res[1])  # a diverged model
            if nan_model:
                log.warning("round %d: the model's outputs are NaN (the run diverged: a step size too "
                            "large?); no accuracy", rnd)
            if res is not None:
                loss, acc = res
                row.update(accuracy=acc, loss=loss)
                if rnd > 0 and acc is not None and math.isfinite(acc) and (
                        best["accuracy"] is None or acc > best["accuracy"]):
                    best.update(accuracy=acc, round=rnd)
            if rnd > 0:
                rl = strategy.take_round_log()
                row.update({"train-loss": None, "client-accuracy": None, "client-loss": None})
                # every aggregated client metric: training ones by name, evaluation ones as client-*
                row.update({k: v for k, v in rl.train_metrics.items() if k != "num-examples"})
                row.update({f"client-{k}": v for k, v in rl.eval_metrics.items() if k != "num-examples"})
                row.update({
                    "clients-sampled": len(rl.sampled), "clients-replied": rl.replied,
                    "clients-ok": len(rl.ok),
                    "clients-failed": len(rl.failed), "failures": rl.failed, "clients-lost": rl.lost,
                    "skipped": rl.skipped, "diverged": rl.diverged, "nan-outputs": nan_model,
                    "bytes-up": rl.bytes_up, "bytes-down": rl.bytes_down,
                    "bytes-up-eval": rl.bytes_up_eval, "bytes-down-eval": rl.bytes_down_eval,
                    "per-client": {str(k): v for k, v in sorted(rl.clients.items())},
                    **fairness([v["evaluate-accuracy"] for v in rl.clients.values()
                                if "evaluate-accuracy" in v]),
                })
            now = time.time()
            row["seconds"] = round(now - last["t"], 3)
            last["t"] = now
            run_dir.log_round(row)
            if rnd > 0:
                checkpoint.save(run_dir.path, rnd, arrays, strategy.checkpoint_state(), identity)
                if (joined := data_record.joined(strategy)) is not None:
                    try:
                        run_dir.update_config(joined)
                    except OSError as e:  # the round's metrics and checkpoint are kept
                        log.warning("could not record the data of partitions that answered late in "
                                    "%s: %s", run_dir.path / "config.json", e)
                if data_record.refusal is not None:
                    raise data_record.refusal
            if rnd > 0 and rnd == cfg.fault_crash_after:
                log.error("fault-crash-after=%d: the ServerApp dies now (checkpoint of round %d written)",
                          rnd, rnd)
                raise faults.SimulatedCrash(f"fault-crash-after={rnd}: the ServerApp stops after "
                                            f"round {rnd}'s checkpoint, without a summary")
            keep = {k: v for k, v in row.items() if isinstance(v, int | float) and v is not None
                    and not isinstance(v, bool)}
            return MetricRecord({k: float(v) for k, v in keep.items()})

        arrays = strategy.initial_arrays(strategy.model)
        if ckpt:
            strategy.restore_state(ckpt["strategy"])
            # in the dtypes of a fresh model: checkpoints from before cast_like hold ResNets' int64
            # num_batches_tracked as float64, and every (int64) reply to it would be refused
            arrays = cast_like(ckpt["arrays"], arrays)
            checkpoint.set_rng_state(ckpt["rng"])
            log.info("resuming %s after round %d of %d", run_dir.path, ckpt["round"], cfg.num_server_rounds)
        result = strategy.start(grid=grid, initial_arrays=arrays,
                                num_rounds=cfg.num_server_rounds, timeout=cfg.round_timeout,
                                train_config=ConfigRecord(), evaluate_config=ConfigRecord(),
                                evaluate_fn=end_of_round, first_round=ckpt["round"] + 1 if ckpt else 1)
        rows = run_dir.rows
        aggregated = sum(1 for r in rows if r["round"] > 0 and not r.get("skipped"))
        diverged = sum(1 for r in rows[1:] if r.get("diverged"))  # aggregates refused (NaN or inf)
        if aggregated == 0:  # too few clients replied every round: the "result" is the initial model
            most = max((r.get("clients-ok") or 0 for r in rows if r["round"] > 0), default=0)
            why = (f"the aggregate held NaN or inf in {diverged} of {cfg.num_server_rounds} rounds: the "
                   "run diverged (a step size too large?), see 'diverged' and 'failures'" if diverged else
                   f"every client failed in all {cfg.num_server_rounds} rounds; the reasons are under "
                   "'failures'" if not most else
                   f"no round had min-clients={cfg.min_clients} valid replies (at most {most}); the "
                   "other clients' reasons are under 'failures'")
            raise NothingAggregated(f"no round aggregated a client reply ({why} in {run_dir.metrics_path}); "
                                    "no summary is written, the rounds' metrics and checkpoint are kept")
        if aggregated < cfg.num_server_rounds:
            skipped = [r["round"] for r in rows if r.get("skipped")]
            log.warning("only %d of %d rounds aggregated client replies (skipped: %s; the reasons are "
                        "under 'failures'%s in %s)", aggregated, cfg.num_server_rounds,
                        ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else ""),
                        f", and {diverged} aggregate(s) held NaN or inf ('diverged')" if diverged else "",
                        run_dir.metrics_path)
        # the last evaluated model's: one with NaN outputs has none, not an earlier round's (a
        # refused aggregate keeps the model, whose accuracy that round's row holds)
        final = next((r for r in reversed(rows) if r.get("accuracy") is not None or r.get("nan-outputs")), {})
        final_client = _last_with(rows, "client-accuracy")
        if final.get("accuracy") is None and final_client.get("client-accuracy") is None:
            log.warning("the run finished without an accuracy: every evaluation failed or diverged "
                        "(see 'nan-outputs', 'diverged' and 'failures' in %s)", run_dir.metrics_path)
        summary = {
            "method": cfg.method, "dataset": cfg.dataset, "partition": str(cfg.partition),
            "seed": cfg.seed, "num-clients": num_partitions, "rounds": cfg.num_server_rounds,
            "final-accuracy": final.get("accuracy"), "final-loss": final.get("loss"),
            "final-round": final.get("round"),  # the last round that was evaluated
            # the clients' local test splits (personalised accuracy): one column for every method
            "final-client-accuracy": final_client.get("client-accuracy"),
            "final-client-round": final_client.get("round"),
            "best-accuracy": best["accuracy"], "best-round": best["round"],
            "initial-accuracy": rows[0].get("accuracy") if rows else None,
            "mean-accuracy": _mean([r.get("accuracy") for r in rows[1:]]),
            "mean-pre-accuracy": _mean([r.get("pre-accuracy") for r in rows[1:]]),
            "bytes-up-total": sum(r.get("bytes-up", 0) for r in rows),
            "bytes-down-total": sum(r.get("bytes-down", 0) for r in rows),
            "bytes-up-eval-total": sum(r.get("bytes-up-eval", 0) for r in rows),
            "bytes-down-eval-total": sum(r.get("bytes-down-eval", 0) for r in rows),
            "client-failures-total": sum(r.get("clients-failed", 0) for r in rows),
            "bytes-up-per-client-round": _per_client_round(rows, "bytes-up"),
            "server-device": str(device),
            "rounds-aggregated": aggregated,
        }
        if (strategy.model is not None and strategy.server_model and result.arrays is not None
                and len(result.arrays)):
            checkpoint.write_synced(run_dir.path / "model.pt", result.arrays.to_torch_state_dict())
        # clients' filed state on this machine: the newest the run stands on only
        client_state.prune(cfg, strategy.run_key, strategy.resumed_after)
        summary = run_dir.finish(summary)  # last: its presence means the run finished
        acc = summary["final-accuracy"]
        log.info("finished: final accuracy %s, summary in %s", "-" if acc is None else f"{acc:.4f}",
                 run_dir.path / "summary.json")
        return summary


def _resume_point(cfg: Config, current: dict[str, Any]) -> tuple[dict[str, Any] | None, str, str]:
    """(checkpoint, output dir, run name): a fresh run, or the one ``resume`` names. A run that
    died after its last round's checkpoint but before its summary resumes to write its outputs."""
    if not cfg.resume:
        return None, cfg.output_dir, cfg.run_name or default_run_name(cfg)
    path = Path(cfg.resume).expanduser().resolve()
    ckpt = checkpoint.load(path)
    saved = checkpoint.with_added_keys(ckpt["config"], current)  # an older checkpoint's config
    checkpoint.check_compatible(saved, current, path / checkpoint.FILE)
    if reason := checkpoint.finished_reason(path, cfg.num_server_rounds, ckpt["round"]):
        raise checkpoint.CheckpointError(f"resume: {reason}")
    return ckpt, str(path.parent), path.name


def fairness(accs: list[float]) -> dict[str, float]:
    """Spread of the clients' accuracies: min, max, std and Jain's index (Σx)² / (n Σx²)."""
    if not accs:
        return {}
    a = np.asarray(accs, dtype=float)
    sq = float((a ** 2).sum())
    return {"client-accuracy-min": float(a.min()), "client-accuracy-max": float(a.max()),
            "client-accuracy-std": float(a.std()),
            "jain-index": float(a.sum() ** 2 / (len(a) * sq)) if sq > 0 else 1.0}


def _last_with(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The last round's row that has ``key`` (evaluation runs every ``eval-every`` rounds)."""
    return next((r for r in reversed(rows) if r.get(key) is not None), {})


def _mean(values: list[float | None]) -> float | None:
    """Mean of the non-missing values (Fed-ADE's average online accuracy over time steps)."""
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _per_client_round(rows: list[dict[str, Any]], key: str) -> float | None:
    """Bytes per replying client and round: an error reply or a missing one uploads nothing
    (rows from before ``clients-replied`` was kept divide by the clients sampled)."""
    def n(r: dict[str, Any]) -> int:
        return r.get("clients-replied", r.get("clients-sampled") or 0)

    vals = [r[key] / n(r) for r in rows if n(r)]
    return sum(vals) / len(vals) if vals else None
