"""What every flowerbed strategy adds to Flower's FedAvg.

- **Deterministic sampling by partition id** (node ids are random per run): a ``query.whoami``
  round maps nodes to partitions; clients are sampled from partition ids with a generator seeded
  by (seed, round) and replies are aggregated in partition order (flower-guide §8.4).
- **Reply validation**: error replies, missing records, wrong shapes and NaN/inf values are left
  out of aggregation with a warning naming the client; the round is skipped (the model kept) when
  fewer than ``min-clients`` valid replies remain. A client that raises or never answers does not
  end the run.
- **Accounting**: bytes down and up, per-client metrics and failures per round, read by the
  ServerApp's end-of-round hook (:meth:`take_round_log`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log as flog
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerbed.config import Config, ConfigError, normalised_settings
from flowerbed.datasets.loading import DataSet
from flowerbed.tracebacks import ANSI, exception_of, original_text, wrapper
from flowerbed.training import evaluate, is_finite, load_record, to_record

log = logging.getLogger("flowerbed")

WHOAMI = "query.whoami"
MAX_EXAMPLES = 1e12  # a reply's sample count above this is refused (weights would overflow)


#: config keys that say where a client files its state (Strategy.bookkeeping), not what the
#: method sends: left out of the byte counts, so a resumed run's equal an unbroken one's
BOOKKEEPING_KEYS = ("run-key", "resumed-after")


def record_bytes(content: RecordDict) -> int:
    """Payload size of a RecordDict: the sum of its records' byte counts, without the
    bookkeeping keys of its config."""
    return int(sum(ConfigRecord({k: v for k, v in rec.items() if k not in BOOKKEEPING_KEYS}).count_bytes()
                   if isinstance(rec, ConfigRecord) else rec.count_bytes() for rec in content.values()))


def with_record(content: RecordDict, key: str, record: ArrayRecord) -> RecordDict:
    """A copy of ``content`` with ``record`` under ``key`` (the other records shared)."""
    out = RecordDict(dict(content.items()))
    out[key] = record
    return out


def metric_record(content: RecordDict) -> MetricRecord:
    """The (single, validated) MetricRecord of a reply's content."""
    return next(iter(content.metric_records.values()))


def aggregate_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Each metric's ``weight_key``-weighted mean over the replies that report it (Flower's
    ``aggregate_metricrecords`` divides by every reply's weight, so a reply without a metric
    pulls that metric towards 0); a metric whose replies weigh 0 in all is left out."""
    sums: dict[str, Any] = {}
    totals: dict[str, float] = {}
    for record in records:
        mr = metric_record(record)
        w = float(mr[weight_key])
        for key, value in mr.items():
            if key == weight_key:
                continue
            v = np.asarray(value, dtype=np.float64) * w
            sums[key] = v if key not in sums else sums[key] + v
            totals[key] = totals.get(key, 0.0) + w
    out = MetricRecord()
    for key, total in totals.items():
        if total > 0:
            mean = sums[key] / total
            out[key] = [float(x) for x in mean] if mean.ndim else float(mean)
    return out


def metric_kind(value: Any) -> str:
    """A metric's shape, for comparing replies: "a number" or "a list of n values"."""
    return f"a list of {len(value)} values" if isinstance(value, list) else "a number"


_FLOWER_REASON = re.compile(r"^<class '([^']+)'>:<'(.*)'>$", re.S)  # Flower's str(type) + message
#: what Flower's error codes mean, for a failure's reason
ERROR_NAMES = {ErrorCode.LOAD_CLIENT_APP_EXCEPTION: "the ClientApp could not be loaded",
               ErrorCode.CLIENT_APP_RAISED_EXCEPTION: "the ClientApp raised",
               ErrorCode.MESSAGE_UNAVAILABLE: "the message was unavailable",
               ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "the reply was unavailable",
               ErrorCode.NODE_UNAVAILABLE: "its node was unavailable",
               ErrorCode.MOD_FAILED_PRECONDITION: "a client mod refused the message",
               ErrorCode.CLIENT_APP_CRASHED: "the ClientApp's process crashed"}


def short_reason(reason: str) -> str:
    """A client's error reason in one line, at most 300 characters (the middle of a longer one
    cut). Flower writes an exception as ``<class 'X'>:<'text'>``: a deployed ClientApp's X is the
    exception itself; under the simulation engine X is Ray's RayTaskError(...), whose text is
    Ray's traceback of the original: named from it, as under deployment (``KeyError: 'lr'``).
    Anything else: its last meaningful line (of a possibly 1 kB traceback)."""
    text = ANSI.sub("", str(reason)).strip()
    if m := _FLOWER_REASON.match(text):
        kind, text = m.group(1), m.group(2)
        found = exception_of(text)  # a traceback in the text (Ray's): its exception
        if found and not wrapper(found[0]):
            kind, text = found
        elif found or wrapper(kind):  # only Flower's wrapper: its text ends in the original's
            kind, text = "", original_text(text)
        lines = " | ".join(ln.strip() for ln in text.splitlines() if ln.strip())
        kind = kind.rsplit(".", 1)[-1]
        said = f"{kind}: {lines}" if kind and lines else kind and f"{kind} (no message)" or lines
        return (said if len(said) <= 300 else f"{said[:150]} … {said[-147:]}") or "unknown error"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # (a reason cut from Flower's repr can still end in its "'>")
    return lines[-1].removesuffix("'>")[:300] if lines else "unknown error"


@dataclass
class RoundLog:
    """What happened in one round, as the strategy saw it."""

    started: float = field(default_factory=time.time)
    sampled: list[int] = field(default_factory=list)
    ok: list[int] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    bytes_down: int = 0          # training messages
    bytes_up: int = 0
    replied: int = 0             # training replies with content (their bytes are in bytes_up)
    bytes_down_eval: int = 0     # evaluation messages
    bytes_up_eval: int = 0
    train_metrics: dict[str, Any] = field(default_factory=dict)
    eval_metrics: dict[str, Any] = field(default_factory=dict)
    clients: dict[int, dict[str, Any]] = field(default_factory=dict)
    skipped: bool = False
    diverged: bool = False       # the aggregate held NaN or inf: refused, the model kept
    lost: list[int] = field(default_factory=list)  # partitions whose node left the federation


class FlowerbedFedAvg(FedAvg):
    """Flower's FedAvg with flowerbed's sampling, validation and accounting (see module doc)."""

    #: ArrayRecords every training reply must carry, each compared with the sent model:
    #: "exact" (same keys, shapes, dtypes) or "subset" (the keys :meth:`subset_keys` names).
    reply_arrays: dict[str, str] = {"arrays": "exact"}
    #: attributes that hold server state beyond the loop's arrays; saved in every checkpoint
    #: (see :mod:`flowerbed.checkpoint`) and restored on resume
    checkpoint_attrs: tuple[str, ...] = ()
    #: whether the server's arrays are a trained model, written to ``model.pt`` at the end
    server_model = True

    def __init__(self, cfg: Config | None = None, **fedavg_kwargs: Any) -> None:
        # A subclass that also inherits another Flower strategy (FedProx) sets self.cfg first,
        # because that strategy calls this __init__ with FedAvg's keywords only.
        self.cfg: Config = cfg if cfg is not None else self.cfg
        kwargs = dict(fraction_train=self.cfg.fraction_train,
                      fraction_evaluate=self.cfg.fraction_evaluate,
                      min_train_nodes=self.cfg.min_clients, min_evaluate_nodes=1,
                      min_available_nodes=self.cfg.min_clients,
                      train_metrics_aggr_fn=aggregate_metrics,
                      evaluate_metrics_aggr_fn=aggregate_metrics)
        kwargs.update(fedavg_kwargs)
        super().__init__(**kwargs)
        self.node_of: dict[int, int] = {}       # partition id -> node id
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.num_test: dict[int, int] = {}      # partition id -> its local test samples (whoami)
        # partition id -> (its own data folder, the split settings its partition.json records)
        self.data_folders: dict[int, tuple[str, dict[str, Any]]] = {}
        # partition id -> what it read when it first answered in this attempt (its folder's
        # normalised export settings; None: the seeded split): a node back with other data is ignored
        self.first_data: dict[int, dict[str, Any] | None] = {}
        self.num_partitions: int | None = None
        self.ignored_nodes: set[int] = set()  # nodes whose whoami reply could not be used
        self.running = False  # rounds have begun: a bad node is ignored, not a startup error
        self.round_asked = 0  # the round whose sampling asks new nodes their partition
        self.unanswered: dict[int, int] = {}  # node -> the round its whoami last went unused
        self.whoami_error: str | None = None  # the last error a node replied to whoami
        self.train_labels: str = ""  # digest of the server's training labels (labels_digest)
        self.round = RoundLog()
        self.model: torch.nn.Module | None = None  # the global model's network, set by the ServerApp
        self._sent: list[Message] = []
        self._reference: ArrayRecord | None = None
        self.run_key = ""  # the run directory's name: where clients file their per-round state
        self.resumed_after: list[int] = []  # the run's resume points (config.json's resumed-after-rounds)

    # ------------------------------------------------------------------ nodes and sampling
    def discover(self, grid: Grid, wait_all: float = 0.0, timeout: float = 120.0) -> int:
        """Map nodes to partition ids (whoami round for new nodes); returns num-partitions.

        With ``wait_all > 0``, keep waiting up to that many seconds until every partition has
        a node (nodes register one by one when a federation starts). ``timeout`` bounds the wait
        for whoami replies (a deployed ClientApp is a new process per message: on a loaded
        machine its first reply can take minutes).
        """
        deadline = time.time() + wait_all
        while True:
            nodes = set(grid.get_node_ids())
            for nid in [n for n in self.partition_of if n not in nodes]:
                pid = self.partition_of.pop(nid)
                self.node_of.pop(pid, None)
                self.round.lost.append(pid)
                log.warning("partition %d (node %d) left the federation", pid, nid)
            new = sorted(n for n in nodes - set(self.partition_of) - self.ignored_nodes
                         if not self.running or self.unanswered.get(n) != self.round_asked)
            if new:  # once rounds run, a node that gave no usable answer is asked once a round
                self._whoami(grid, new, timeout)
            n = self.num_partitions or 0
            if len(self.node_of) >= n or time.time() >= deadline:
                return n
            time.sleep(0.5)

    def _whoami(self, grid: Grid, node_ids: list[int], timeout: float) -> None:
        msgs = [Message(content=RecordDict({"config": ConfigRecord()}), message_type=WHOAMI,
                        dst_node_id=n) for n in node_ids]
        self.unanswered.update(dict.fromkeys(node_ids, self.round_asked))  # until it answers
        replies = grid.send_and_receive(msgs, timeout=timeout)
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}  # ids set when sent
        for reply in replies:
            if reply.has_error():
                self.whoami_error = short_reason(reply.error.reason)
                node = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
                log.warning("node %s did not answer whoami: %s%s", node, self.whoami_error,
                            "" if node == reply.metadata.src_node_id else " (the SuperLink answered "
                            "for it: a node that left, or one of an earlier deployment it still lists)")
                continue
            node = reply.metadata.src_node_id
            try:
                info = reply.content["info"]
                pid, num = int(info["partition-id"]), int(info["num-partitions"])
                num_test = int(info.get("num-test", 1))
            except (KeyError, TypeError, ValueError) as e:
                log.warning("node %d ignored: its whoami reply has no valid partition-id and "
                            "num-partitions (%s: %s)", node, type(e).__name__, e)
                self.ignored_nodes.add(node)
                continue
            problem = None
            if self.num_partitions not in (None, num):
                problem = ConfigError("num-partitions", num, f"node {node} disagrees with the "
                                      f"other nodes ({self.num_partitions})")
            elif not 0 <= pid < num:
                problem = ConfigError("partition-id", pid, f"must be in [0, {num}) (node {node})")
            elif self.train_labels and (theirs := str(info.get("train-labels", ""))) not in (
                    "", self.train_labels):  # (a node with its own data folder, or an older one: none)
                problem = ConfigError("data-root", f"node {node}'s", "its copy of the training set "
                                      "differs from the server's (other files, another order or "
                                      f"subset; its labels' sha256 {theirs[:12]}, the server's "
                                      f"{self.train_labels[:12]}), so its seeded partition would "
                                      "overlap the others' or miss samples: give every node, and "
                                      "the server (its run-config data-root), the same files")
            if problem and not self.running:  # a misconfigured federation: stop before round 1
                raise problem
            if problem:  # a node that joins a running federation: the run goes on without it
                log.warning("node %d ignored: %s", node, problem)
                self.ignored_nodes.add(node)
                continue
            folder = str(info.get("data-dir", ""))  # (older clients send none: the seeded split)
            try:
                exported = json.loads(str(info.get("exported-with", "{}"))) if folder else {}
            except ValueError:
                exported = {}
            exported = exported if isinstance(exported, dict) else {}
            reads = normalised_settings(exported) if folder else None
            if self.running and pid in self.first_data and reads != self.first_data[pid]:
                # training it on other data mid-run would mix two data sets in one run (and a
                # resume, which checks the data, would refuse it): the run goes on without it
                log.warning("node %d ignored this round: it serves partition %d from other data (%s) "
                            "than the partition read when it first answered (%s; null: the seeded "
                            "split); serve the same data (the same --data-dirs folder) and it is "
                            "asked again next round", node, pid, json.dumps(reads),
                            json.dumps(self.first_data[pid]))
                continue
            old = self.node_of.get(pid)
            if old is not None and old != node:  # (nodes that left were dropped above)
                problem = ConfigError("partition-id", pid, f"nodes {old} and {node} both serve it")
                if not self.running:
                    raise problem
                log.warning("node %d ignored this round: %s; it is asked again next round "
                            "(it takes over once node %d has left)", node, problem, old)
                continue
            # the first answer's data, or (before round 1, nothing trained yet) the newest; once
            # rounds run, an answer that got here reads what the partition first read
            self.first_data[pid] = reads
            self.unanswered.pop(node, None)
            self.num_partitions = num
            self.node_of[pid] = reply.metadata.src_node_id
            self.partition_of[reply.metadata.src_node_id] = pid
            self.num_test[pid] = num_test
            self.on_whoami(pid, info)
            if folder:
                self.data_folders[pid] = (folder, exported)
            else:
                self.data_folders.pop(pid, None)

    def on_whoami(self, pid: int, info: ConfigRecord) -> None:
        """A node's accepted whoami reply for partition ``pid`` (FedConcat reads its label counts)."""

    def sample(self, grid: Grid, server_round: int, fraction: float, stream: int) -> list[int]:
        """Node ids of the sampled partitions, in partition order (deterministic per seed)."""
        self.round_asked = server_round
        # a newcomer's answer is waited for within the round's time, at most 2 minutes a round
        self.discover(grid, timeout=min(self.cfg.round_timeout, 120.0))
        available = sorted(self.node_of)
        if not available or fraction <= 0:  # fraction-evaluate = 0: no client-side evaluation
            return []
        k = max(int(round(len(available) * fraction)), min(self.cfg.min_clients, len(available)))
        if k >= len(available):
            chosen = available
        else:
            rng = np.random.default_rng([self.cfg.seed, server_round, stream])
            chosen = sorted(int(p) for p in rng.choice(available, size=k, replace=False))
        return [self.node_of[p] for p in chosen]

    def _messages(self, content: RecordDict, node_ids: list[int], message_type: str
                  ) -> list[Message]:
        msgs = [Message(content=self.content_for(n, content), message_type=message_type,
                        dst_node_id=n) for n in node_ids]
        self._sent = msgs
        size = sum(record_bytes(m.content) for m in msgs)
        if message_type.startswith(MessageType.TRAIN):
            self.round.bytes_down += size
        else:
            self.round.bytes_down_eval += size
        return msgs

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        """What the message to ``node`` carries: the round's ``content``, or a copy made with
        :func:`with_record` (FedXDS adds D_g for a client without it; FedRep and Fed-ADE leave
        out the personal layers of a client that holds its own)."""
        return content

    def bookkeeping(self, config: ConfigRecord) -> None:
        """Where the clients file their state (client_state): the run key and, in a resumed
        run, its resume points; left out of the byte counts (:func:`record_bytes`), which are the
        method's."""
        if self.run_key:  # (Flower cannot count the bytes of an empty string)
            config["run-key"] = self.run_key
        if self.resumed_after:
            config["resumed-after"] = list(self.resumed_after)

    # ------------------------------------------------------------------ training
    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        """What a training message carries; methods add their records here."""
        return RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.round = RoundLog()
        config["server-round"] = server_round
        self.bookkeeping(config)
        node_ids = self.sample(grid, server_round, self.fraction_train, stream=0)
        self.round.sampled = [self.partition_of[n] for n in node_ids]
        self._reference = arrays
        return self._messages(self.train_content(server_round, arrays, config), node_ids,
                              MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.round.train_metrics = dict(metrics or {})
        if arrays is not None and self._reference is not None:
            arrays = cast_like(arrays, self._reference)
        return arrays, metrics

    def client_metrics(self, valid: list[Message], extra: dict[str, Any] | None = None,
                       drop: tuple[str, ...] = ()) -> MetricRecord:
        """The round's training metrics, recorded for its row: the sample-weighted mean of the
        valid replies' metrics less ``drop`` (a metric whose mean means nothing), with the
        server's own ``extra``."""
        mean = self.train_metrics_aggr_fn([RecordDict({"m": metric_record(r.content)}) for r in valid],
                                          self.weighted_by_key)
        metrics = MetricRecord({**{k: v for k, v in mean.items() if k not in drop}, **(extra or {})})
        self.round.train_metrics = dict(metrics)
        return metrics

    def sample_counts(self, replies: Iterable[Message]) -> np.ndarray:
        """n_i: each reply's weighting metric (``num-examples``), float64."""
        return np.array([metric_record(r.content)[self.weighted_by_key] for r in replies], np.float64)

    def valid_mean(self, replies: Iterable[Message]
                   ) -> tuple[list[Message], dict[str, Array], list[str]] | None:
        """For a server update of its own (SCAFFOLD, FedDyn, FedNova, FedAMP): the round's valid
        training replies, their sample-weighted mean (which the buffers keep) and the names of
        the parameters to update; None when no reply is valid."""
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid or self._reference is None:
            return None
        mean = aggregate_arrayrecords([RecordDict({"arrays": r.content["arrays"],
                                                   "m": metric_record(r.content)}) for r in valid],
                                      self.weighted_by_key)
        return valid, dict(mean.items()), self.parameter_names(self._reference)

    def network_with(self, arrays: ArrayRecord) -> torch.nn.Module:
        """A copy of the global model's network loaded with ``arrays`` (``self.model`` untouched):
        the server's own models (FedFTG's teachers and student, FedConcat's encoders)."""
        return load_record(copy.deepcopy(self.model), arrays)

    def parameter_names(self, arrays: ArrayRecord) -> list[str]:
        """The model's trainable parameters' names: a server step moves them, while buffers
        (BatchNorm's running statistics and step counter) are averaged. Without a network (a
        unit test's bare records) every key of ``arrays`` but BatchNorm's buffers."""
        if self.model is not None:
            return [k for k, _ in self.model.named_parameters()]
        return [k for k in arrays if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]

    # ------------------------------------------------------------------ the round loop
    def checkpoint_state(self) -> dict[str, Any]:
        return {a: getattr(self, a) for a in self.checkpoint_attrs}

    def restore_state(self, state: dict[str, Any]) -> None:
        """The checkpoint's strategy state. An attribute it lacks or holds as None (saved before
        it was kept) keeps its fresh value; one of another type than that value is a
        CheckpointError."""
        from flowerbed.checkpoint import CheckpointError

        for a in self.checkpoint_attrs:
            fresh, value = getattr(self, a), state.get(a)
            if value is None and fresh is not None:
                continue
            if fresh is not None and not isinstance(value, type(fresh)):
                raise CheckpointError(f"resume: the checkpoint's strategy state '{a}' is a "
                                      f"{type(value).__name__}, expected a {type(fresh).__name__}")
            setattr(self, a, value)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              first_round: int = 1) -> Result:
        """Flower's round loop (``Strategy.start``), able to begin at ``first_round`` (resume).

        Same steps as Flower's: configure/send/aggregate training, then evaluation, then
        ``evaluate_fn(round, arrays)``; round 0's evaluation only on a fresh start.
        """
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        flog(INFO, "Starting %s, rounds %d..%d", type(self).__name__, first_round, num_rounds)
        if evaluate_fn and first_round == 1:
            res = evaluate_fn(0, initial_arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        arrays = initial_arrays
        self.running = True
        for rnd in range(first_round, num_rounds + 1):
            flog(INFO, "[ROUND %s/%s]", rnd, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(rnd, arrays, ConfigRecord(dict(train_config)), grid),
                timeout=timeout)
            agg_arrays, agg_metrics = self.aggregate_train(rnd, replies)
            if agg_arrays is not None and not is_finite(agg_arrays):  # valid replies, too big a step
                log.warning("round %d: the aggregated model holds NaN or inf (the run diverges: a "
                            "step size too large?); the model is kept unchanged this round", rnd)
                self.round.skipped = self.round.diverged = True
                agg_arrays = None
            if agg_arrays is not None:
                result.arrays = arrays = agg_arrays
            if agg_metrics is not None:
                result.train_metrics_clientapp[rnd] = agg_metrics
            replies = grid.send_and_receive(
                messages=self.configure_evaluate(rnd, arrays, ConfigRecord(dict(evaluate_config)),
                                                 grid),
                timeout=timeout)
            agg_eval = self.aggregate_evaluate(rnd, replies)
            if agg_eval is not None:
                result.evaluate_metrics_clientapp[rnd] = agg_eval
            if evaluate_fn:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
        if result.arrays is None or not len(result.arrays):
            result.arrays = arrays
        return result

    # ------------------------------------------------------------------ evaluation
    def evaluates(self, server_round: int) -> bool:
        """Whether round ``server_round`` evaluates (every eval-every rounds, and the last)."""
        return (server_round % self.cfg.eval_every == 0
                or server_round == self.cfg.num_server_rounds)

    def check_setup(self, num_partitions: int) -> None:
        """Method-specific checks of the run before round 1 (raise :class:`ConfigError`)."""

    def describe(self) -> dict[str, Any]:
        """Method-specific facts recorded in the run's config.json."""
        return {}

    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        """What round 1 starts from: the initial global model."""
        return to_record(model)

    def evaluate_global(self, server_round: int, arrays: ArrayRecord, train: DataSet,
                        test: DataSet, device: torch.device) -> tuple[float, float] | None:
        """Server-side (loss, accuracy) after ``server_round``: the global model on the test set."""
        return evaluate(load_record(self.model, arrays), test, device)

    def clients_evaluate(self) -> bool:
        """Whether evaluation rounds send messages to clients (here: only with local test data)."""
        return self.cfg.local_test_fraction > 0

    def evaluates_locally(self) -> bool:
        """Whether a client's evaluation reply is measured on its local test split only, so a
        client without one (a partition of a single sample) has nothing to report. Otherwise
        such a client is asked too and replies ``num-examples`` 0 (no local scores)."""
        return True

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        """What an evaluation message carries besides the config (here: the global model)."""
        return RecordDict({self.arrayrecord_key: arrays})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if not self.evaluates(server_round) or not self.clients_evaluate():
            return []
        config["server-round"] = server_round
        self.bookkeeping(config)
        node_ids = self.sample(grid, server_round, self.fraction_evaluate, stream=1)
        if self.evaluates_locally():
            empty = {n for n in node_ids if self.num_test.get(self.partition_of[n], 1) == 0}
            if empty:
                log.info("evaluate: partitions %s have no local test samples; not asked",
                         sorted(self.partition_of[n] for n in empty))
                node_ids = [n for n in node_ids if n not in empty]
        content = self.eval_content(arrays)
        content[self.configrecord_key] = config
        return self._messages(content, node_ids, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None and "diverged" in metrics:  # how many clients, not a mean of flags
            metrics["diverged"] = float(sum(bool(c.get("evaluate-diverged"))  # (the valid replies')
                                            for c in self.round.clients.values()))
        if self.clients_evaluate():  # else keep what the round recorded (FedFew's local scores)
            self.round.eval_metrics = dict(metrics or {})
        return metrics

    # ------------------------------------------------------------------ reply validation
    def _destinations(self) -> dict[str, int]:
        """The node each message of this round went to, by message id."""
        return {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent}

    def _sender(self, reply: Message, destinations: dict[str, int]) -> tuple[int, int]:
        """(node, partition) a reply answers for: where its message went (``_destinations``)."""
        node = destinations.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        return node, self.partition_of.get(node, -1)

    def _check_and_log_replies(self, replies: Iterable[Message], is_train: bool,
                               validate: bool = True) -> tuple[list[Message], list[Message]]:
        """Keep only usable replies, sorted by partition id; log each rejected one by client."""
        replies = list(replies)
        destinations = self._destinations()
        answered = {r.metadata.reply_to_message_id for r in replies}
        valid: list[tuple[int, Message]] = []
        rejected: list[Message] = []
        phase = "train" if is_train else "evaluate"
        for reply in replies:
            node, pid = self._sender(reply, destinations)
            if not reply.has_error():
                if is_train:
                    self.round.bytes_up += record_bytes(reply.content)
                    self.round.replied += 1
                else:
                    self.round.bytes_up_eval += record_bytes(reply.content)
            problem = self.check_reply(reply, is_train)
            if problem:
                self._fail(pid, node, phase, problem)
                rejected.append(reply)
                continue
            valid.append((pid, reply))
        phase_type = MessageType.TRAIN if is_train else MessageType.EVALUATE
        for msg in self._sent:  # only this phase's messages can be missing from this phase
            if not msg.metadata.message_type.startswith(phase_type):
                continue
            if msg.metadata.message_id not in answered:
                node = msg.metadata.dst_node_id
                self._fail(self.partition_of.get(node, -1), node, phase, "no reply before timeout")
        valid.sort(key=lambda t: t[0])
        mismatched = self._mismatched_metrics([r for _, r in valid])
        for i, problem in mismatched.items():
            pid, r = valid[i]
            self._fail(pid, self._sender(r, destinations)[0], phase, problem)
            rejected.append(r)
        valid = [v for i, v in enumerate(valid) if i not in mismatched]
        for pid, r in valid:  # per client: "<phase>-<metric>" ("train-loss", not "train-train-loss")
            self.round.clients.setdefault(pid, {}).update(
                {k if k.startswith(f"{phase}-") else f"{phase}-{k.removeprefix('num-')}": v
                 for k, v in metric_record(r.content).items()})
        if is_train:
            self.round.ok = [pid for pid, _ in valid]
            if len(valid) < self.cfg.min_clients:
                log.warning("round %s: only %d valid training replies (< min-clients=%d); the "
                            "model is kept unchanged this round", getattr(self, "round_asked", "?"),
                            len(valid), self.cfg.min_clients)
                self.round.skipped = True
                return [], rejected
        return [r for _, r in valid], rejected

    @staticmethod
    def _mismatched_metrics(replies: list[Message]) -> dict[int, str]:
        """Replies (by index) whose metric is a number where most replies have a list, or a list
        of another length: averaging them would fail. Ties go to the lowest partition."""
        kinds: dict[str, list[str]] = {}
        for r in replies:
            for k, v in metric_record(r.content).items():
                kinds.setdefault(k, []).append(metric_kind(v))
        usual = {k: max(dict.fromkeys(v), key=v.count) for k, v in kinds.items()}
        out: dict[int, str] = {}
        for i, r in enumerate(replies):
            for k, v in metric_record(r.content).items():
                if metric_kind(v) != usual[k]:
                    out[i] = (f"metric '{k}' is {metric_kind(v)} where the other replies "
                              f"have {usual[k]}")
                    break
        return out

    def _fail(self, pid: int, node: int, phase: str, problem: str) -> None:
        log.warning("client partition %d (node %d) left out of %s: %s", pid, node, phase, problem)
        self.round.failed.append({"partition": pid, "phase": phase, "reason": problem})

    def check_reply(self, reply: Message, is_train: bool) -> str | None:
        """Why ``reply`` cannot be aggregated, or None when it can."""
        if reply.has_error():
            what = ERROR_NAMES.get(reply.error.code, "client error")
            return f"{what} (Flower error code {reply.error.code}): {short_reason(reply.error.reason)}"
        content = reply.content
        mrs = list(content.metric_records.values())
        if len(mrs) != 1:
            return f"expected exactly one MetricRecord, got {len(mrs)}"
        n = mrs[0].get(self.weighted_by_key)
        if isinstance(n, list):
            return f"metric '{self.weighted_by_key}' has the wrong shape (a list of {len(n)})"
        if isinstance(n, float) and not np.isfinite(n):
            return f"metric '{self.weighted_by_key}' is NaN or inf"
        if not isinstance(n, int | float) or not (n > 0 or (n == 0 and not is_train
                                                          and not self.evaluates_locally())):
            return f"metric '{self.weighted_by_key}' missing or not positive ({n!r})"
        if n > MAX_EXAMPLES:
            return (f"metric '{self.weighted_by_key}' = {n:g} is not a plausible sample count "
                    f"(more than {MAX_EXAMPLES:g}); it would outweigh every other reply")
        for k, v in mrs[0].items():
            vals = v if isinstance(v, list) else [v]
            if not all(np.isfinite(vals)):
                return f"metric '{k}' is not finite ({v})"
        if not is_train:
            return None
        return self.check_arrays(content)

    def check_arrays(self, content: RecordDict) -> str | None:
        """Exactly the expected ArrayRecords, each matching what was sent, all values finite."""
        extra = set(content.array_records) - set(self.reply_arrays)
        if extra:
            return f"unexpected ArrayRecords {sorted(extra)}"
        for key, mode in self.reply_arrays.items():
            if key not in content.array_records:
                return f"missing ArrayRecord '{key}'"
            rec, ref = content.array_records[key], self._reference
            if mode == "subset" and ref is not None:
                keys = self.subset_keys(key, ref) or set(rec)  # unknown: the model's keys it holds
                ref = ArrayRecord({k: v for k, v in ref.items() if k in keys})
            problem = self.check_record(key, rec, ref)
            if problem:
                return problem
        return None

    def subset_keys(self, key: str, reference: ArrayRecord) -> set[str] | None:
        """The keys of the sent model that a "subset" ArrayRecord ``key`` must hold, all of them
        (a reply missing one would average it with too little weight); None: any of them."""
        return None

    @staticmethod
    def check_record(key: str, rec: ArrayRecord, reference: ArrayRecord | None) -> str | None:
        """``rec`` is not empty and has ``reference``'s keys, shapes and dtypes, and only finite
        values."""
        if not len(rec):
            return f"ArrayRecord '{key}' is empty"
        if reference is not None:
            problem = same_shapes(rec, reference)
            if problem:
                return f"ArrayRecord '{key}': {problem}"
        if not is_finite(rec):
            return f"ArrayRecord '{key}' holds NaN or inf values"
        return None

    # ------------------------------------------------------------------ per-round report
    def take_round_log(self) -> RoundLog:
        """The finished round's log (the ServerApp calls this once per round)."""
        out, self.round = self.round, RoundLog()
        return out


def update_gram(reference: ArrayRecord, records: list[ArrayRecord], keys: list[str]) -> np.ndarray:
    """⟨θ − θ_i, θ − θ_j⟩ [M, M] in float64 over ``keys`` (the parameters) of M clients' models
    θ_i against the ``reference`` θ they trained from, one tensor at a time (FedMGDA's weights,
    CFL's norms and similarities)."""
    gram = np.zeros((len(records), len(records)))
    for k in keys:
        ref = reference[k].numpy().astype(np.float64).ravel()
        g = np.stack([ref - r[k].numpy().ravel() for r in records])
        gram += g @ g.T
    return gram


def cast_like(rec: ArrayRecord, ref: ArrayRecord) -> ArrayRecord:
    """``rec`` with each array in the dtype ``ref`` gives it (integers rounded). Flower's
    ``aggregate_arrayrecords`` multiplies by a Python float, so an int64 buffer (BatchNorm's
    ``num_batches_tracked``) comes back float64, and next round's int64 replies would no longer
    match the model they were sent."""
    out = {}
    for k, arr in rec.items():
        v, want = arr.numpy(), np.dtype(ref[k].dtype) if k in ref else None
        if want is not None and v.dtype != want:
            v = np.asarray((np.rint(v) if np.issubdtype(want, np.integer) else v).astype(want))
        out[k] = Array(v)
    return ArrayRecord(out)


def same_shapes(rec: ArrayRecord, ref: ArrayRecord) -> str | None:
    """None when ``rec`` has exactly ``ref``'s keys, shapes and dtypes, else what differs (a
    float64 reply to a float32 model could hold finite values that overflow it)."""
    if set(rec) != set(ref):
        missing, extra = sorted(set(ref) - set(rec)), sorted(set(rec) - set(ref))
        return f"keys differ (missing {missing[:3]}, unexpected {extra[:3]})"
    for k in ref:
        if tuple(rec[k].shape) != tuple(ref[k].shape):
            return f"'{k}' has shape {tuple(rec[k].shape)}, expected {tuple(ref[k].shape)}"
        if rec[k].dtype != ref[k].dtype:
            return f"'{k}' has dtype {rec[k].dtype}, expected {ref[k].dtype}"
    return None
