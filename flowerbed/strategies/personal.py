"""Shared server half of the personalised methods (FedFew, IFCA, FedRep, Ditto, APFL, FedAMP,
Local, FedAvg-FT; Fed-ADE through FedRep).

Their score is personalised accuracy: each client evaluates the model it would be served on its
local test split; the round's ``accuracy`` is the sample-weighted mean over clients (and the
ServerApp adds min, max, std and Jain's index across clients for every method).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flowerbed.datasets.loading import DataSet
from flowerbed.strategies.base import FlowerbedFedAvg
from flowerbed.training import cpu_seeded, to_record

log = logging.getLogger("flowerbed")


class PersonalStrategy(FlowerbedFedAvg):
    def initial_models(self, model: torch.nn.Module, distinct: bool = False) -> list[ArrayRecord]:
        """``num-models`` copies of the initial model, or distinct seeded initialisations."""
        if not distinct:
            return [to_record(model)] * self.cfg.num_models
        out = []
        for k in range(self.cfg.num_models):
            with cpu_seeded(self.cfg.seed * 100 + k):
                for m in model.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
                out.append(to_record(model))
        return out

    def clients_evaluate(self) -> bool:
        return True  # personalised accuracy is measured on the clients

    def evaluate_global(self, server_round: int, arrays: ArrayRecord, train: DataSet,
                        test: DataSet, device: torch.device) -> tuple[float, float] | None:
        """Personalised (loss, accuracy): the clients' sample-weighted means this round."""
        m = self.round.eval_metrics
        if server_round == 0 or "accuracy" not in m:
            return None
        return float(m.get("loss", float("nan"))), float(m["accuracy"])


def pack(models: list[ArrayRecord]) -> ArrayRecord:
    """K models -> one ArrayRecord (keys ``<k>.<param>``), what Strategy.start carries."""
    return ArrayRecord({f"{k}.{name}": arr for k, rec in enumerate(models) for name, arr in rec.items()})


def unpack(packed: ArrayRecord, k: int) -> list[ArrayRecord]:
    out: list[dict] = [{} for _ in range(k)]
    for key, arr in packed.items():
        idx, name = key.split(".", 1)
        out[int(idx)][name] = arr
    return [ArrayRecord(d) for d in out]


class KModelStrategy(PersonalStrategy):
    """K server models (FedFew, IFCA): sent as named records ``model.0`` ... ``model.K-1``."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.k = cfg.num_models

    def check_setup(self, num_partitions: int) -> None:
        if self.k > num_partitions:
            log.warning("num-models=%d is more than the %d clients: at least %d models can serve "
                        "no client, and each round sends all %d to every client", self.k,
                        num_partitions, self.k - num_partitions, self.k)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """As every method's, with the clients' choices counted per model (``model-<k>-chosen``)
        instead of an average of model indices (IFCA's clients choose as FedFew's do)."""
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None and "chosen-model" in metrics:
            chosen = [c.get("evaluate-chosen-model") for c in self.round.clients.values()]
            metrics = MetricRecord({**{k: v for k, v in metrics.items() if k != "chosen-model"},
                                    **{f"model-{k}-chosen": chosen.count(k) for k in range(self.k)}})
            self.round.eval_metrics = dict(metrics)
        return metrics

    def models_content(self, arrays: ArrayRecord) -> RecordDict:
        return RecordDict({f"model.{k}": rec for k, rec in enumerate(unpack(arrays, self.k))})

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        content = self.models_content(arrays)
        content[self.configrecord_key] = config
        return content

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        return self.models_content(arrays)

    def configure_train(self, server_round, arrays, config, grid):
        self._models = unpack(arrays, self.k)
        msgs = super().configure_train(server_round, arrays, config, grid)
        self._reference = self._models[0]  # every returned model must match a server model
        return msgs
