"""The supervised client every method starts from (it is FedAvg's client as it stands)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from flowerbed.config import Config
from flowerbed.datasets.federated import EXPORT_KEYS, client_data, folder_meta, train_set
from flowerbed.datasets.loading import DataSet
from flowerbed.datasets.partition import labels_digest
from flowerbed.models import build_model
from flowerbed.training import (
    configure_threads,
    evaluate,
    is_finite,
    load_record,
    pick_device,
    seeded_generator,
    to_record,
    train_epochs,
)

log = logging.getLogger("flowerbed")


def make_model(cfg: Config, data: DataSet) -> nn.Module:
    """The supervised network for ``data``'s image shape and classes."""
    c, h, _ = data.shape
    return build_model(cfg.model, c, data.num_classes, h)


class Client:
    """Loads its partition (cached per process), trains and evaluates the received model.

    Subclasses override :meth:`fit` (the local update) or :meth:`train` (the whole exchange).
    """

    #: whether it keeps records in ``context.state`` between rounds (filed per round; a resumed
    #: run says where a client of such a method finds none)
    keeps_state = False

    def __init__(self, cfg: Config, context: Context) -> None:
        self.cfg, self.context = cfg, context
        self.partition_id = int(context.node_config["partition-id"])
        self.num_partitions = int(context.node_config["num-partitions"])
        self.data_dir = str(context.node_config.get("data-dir", ""))  # its own data folder, if any
        self.train_data, self.test_data = client_data(cfg, self.partition_id, self.num_partitions,
                                                      self.data_dir)
        self.device = pick_device()
        configure_threads()

    # ------------------------------------------------------------------ helpers
    def new_model(self) -> nn.Module:
        return make_model(self.cfg, self.train_data)

    def model_from(self, record: ArrayRecord) -> nn.Module:
        return load_record(self.new_model(), record).to(self.device)

    def model_with(self, record: ArrayRecord, *own: ArrayRecord | None) -> nn.Module:
        """The received arrays with this client's own layers (records of its ``context.state``;
        later ones win) in their place. FedRep and Fed-ADE servers send the personal layers only
        to a client that has not filed its own yet."""
        merged = dict(record.items())
        for rec in own:
            merged.update(rec.items() if rec is not None else {})
        model = self.new_model()
        missing = [k for k in model.state_dict() if k not in merged]
        if missing:
            raise RuntimeError(
                f"partition {self.partition_id}: the message has no {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''} and this client holds none of its own "
                "(its context.state was lost?); the server sends the whole model next time")
        return load_record(model, ArrayRecord(merged)).to(self.device)

    def class_counts(self) -> torch.Tensor:
        """The training split's samples per class (float, on the client's device): the label
        distribution FedLC, FedRS and FedVLS train with."""
        d = self.train_data
        return torch.bincount(d.y, minlength=d.num_classes).float().to(self.device)

    def state_model(self, key: str) -> nn.Module | None:
        """The model this client keeps in ``context.state`` under ``key`` (None before it filed one)."""
        saved = self.context.state.array_records.get(key)
        return self.model_from(saved) if saved is not None else None

    def keep_model(self, key: str, record: ArrayRecord, *also: str, finite: bool = True) -> bool:
        """File a model this client keeps (``record``) in ``context.state`` under ``key``; one
        that is no longer finite (it diverged in this round's training; ``finite`` False: some
        other state of it did) is not filed, and what was filed under ``key`` and the keys
        ``also`` is dropped, with a warning, so that the client starts it afresh, as before it
        first filed one, instead of keeping a NaN model for good. This round's reply still shows
        the divergence. Whether it was filed."""
        if finite and is_finite(record):
            self.context.state[key] = record
            return True
        for k in (key, *also):
            self.context.state.pop(k, None)
        log.warning("partition %d: its %s diverged (not finite after training): dropped, so it "
                    "starts afresh next round", self.partition_id, key)
        return False

    def reply(self, msg: Message, metrics: dict[str, Any], **arrays: ArrayRecord) -> Message:
        content = RecordDict({**arrays, "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    def round_of(self, msg: Message) -> int:
        return int(msg.content["config"]["server-round"])  # seeds and files the round: required

    def data_line(self) -> str:
        """What it trains and tests on, for its first log line."""
        return f"{len(self.train_data)} train, {len(self.test_data)} local test samples"

    # ------------------------------------------------------------------ message handlers
    def whoami(self, msg: Message) -> Message:
        # with its own data folder: how the folder's split was made, for the run's config.json
        meta = folder_meta(Path(self.data_dir)) if self.data_dir else {}
        info = ConfigRecord({"partition-id": self.partition_id,
                             "num-partitions": self.num_partitions,
                             "num-train": len(self.train_data), "num-test": len(self.test_data),
                             "device": str(self.device), "data-dir": self.data_dir,
                             "exported-with": json.dumps({k: meta[k] for k in EXPORT_KEYS if k in meta}),
                             # the training set it split (the seeded split): the server's must match
                             "train-labels": "" if self.data_dir else labels_digest(train_set(self.cfg).y),
                             **self.whoami_extra()})
        log.info("client partition %d/%d on %s: %s", self.partition_id, self.num_partitions,
                 self.device, self.data_line())
        return Message(content=RecordDict({"info": info}), reply_to=msg)

    def whoami_extra(self) -> dict[str, Any]:
        """What the method's server needs to know before round 1 (FedConcat: the label counts)."""
        return {}

    def train(self, msg: Message) -> Message:
        model = self.model_from(msg.content["arrays"])
        rnd = self.round_of(msg)
        loss, extra = self.fit(model, msg, rnd)
        metrics = {"num-examples": len(self.train_data), "train-loss": loss, **extra}
        return self.reply(msg, metrics, arrays=to_record(model), **self.extra_arrays(model, msg))

    def fit(self, model: nn.Module, msg: Message, rnd: int, epochs: int | None = None,
            stream: int = 0, **hooks: Any) -> tuple[float, dict]:
        """The local update: ``local-epochs`` (or ``epochs``) of SGD on the training split;
        ``stream`` > 0 draws another seeded batch order, for a second model trained in the same
        round (Ditto's personal model)."""
        cfg = self.cfg
        loss, steps = train_epochs(
            model, self.train_data, epochs=cfg.local_epochs if epochs is None else epochs,
            batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
            weight_decay=cfg.weight_decay, device=self.device,
            generator=seeded_generator(cfg.seed, self.partition_id, rnd, *((stream,) if stream else ())),
            **hooks)
        self.steps = steps
        return loss, {}

    def extra_arrays(self, model: nn.Module, msg: Message) -> dict[str, ArrayRecord]:
        """Records sent back besides the model (SCAFFOLD's Δc)."""
        return {}

    def evaluate(self, msg: Message) -> Message:
        return self.scored(msg, self.model_from(msg.content["arrays"]))

    def scored(self, msg: Message, model: nn.Module, extra: dict[str, Any] | None = None) -> Message:
        """The evaluation reply: ``model``'s loss and accuracy on the local test split, and the
        method's own metrics (``extra``)."""
        loss, acc = evaluate(model, self.test_data, self.device)
        scores = {"loss": loss, "accuracy": acc}
        if len(self.test_data) and not math.isfinite(acc):
            # a diverged model (NaN or overflowing outputs) classifies nothing: scored 0, not
            # refused (a NaN reply is), so that the mean, min and Jain's index over the clients
            # count it instead of leaving it out; no loss to report
            log.warning("partition %d: the model it is scored with has non-finite outputs "
                        "(diverged): accuracy 0", self.partition_id)
            scores = {"accuracy": 0.0, "diverged": 1.0}
        return self.reply(msg, {"num-examples": max(len(self.test_data), 1), **scores, **(extra or {})})
