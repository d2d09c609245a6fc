"""Client half shared by the distillation methods: a persistent local model, the public set.

The model never leaves the client: it lives in ``context.state["distill.model"]`` between
rounds (in simulation and deployment alike); only predictions on the public set are uploaded.
With ``hetero-models``, odd partitions use a half-width model (CNN or ResNet), even ones the full one.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.config import Config
from flowerbed.datasets.federated import public_set, test_set
from flowerbed.datasets.loading import DataSet
from flowerbed.models import build_model
from flowerbed.strategies.distill import GLOBAL_ACC, PREDICTIONS, SOFT_TARGETS, TEST_PREDICTIONS
from flowerbed.training import (
    cpu_seeded,
    evaluate,
    fit_targets,
    predict,
    seeded_generator,
    to_record,
    train_epochs,
)

STATE = "distill.model"


class DistillClient(Client):
    keeps_state = True
    extra_outputs = 0      # FedCC: 1 ("unknown")
    probabilities = True   # FedMD uploads logits

    def __init__(self, cfg: Config, context: Context) -> None:
        super().__init__(cfg, context)
        self.public = public_set(cfg)
        self.width = 0.5 if cfg.hetero_models and self.partition_id % 2 else 1.0

    def new_model(self) -> nn.Module:
        c, h, _ = self.train_data.shape
        return build_model(self.cfg.model, c, self.train_data.num_classes + self.extra_outputs, h,
                           width=self.width)

    def local_model(self) -> nn.Module:
        """The client's own model from its state (a fresh, seeded one in its first round)."""
        if (own := self.state_model(STATE)) is not None:
            return own
        with cpu_seeded(self.cfg.seed * 1000 + self.partition_id):  # the model is built on the CPU
            return self.new_model().to(self.device)

    def fit_private(self, model: nn.Module, gen: torch.Generator, epochs: int, data: DataSet | None = None,
                    **hooks) -> float:
        """Supervised fit on the private labelled data (or ``data``) with Adam (``distill-lr``)."""
        cfg = self.cfg
        loss, _ = train_epochs(model, self.train_data if data is None else data, epochs=epochs,
                               batch_size=cfg.batch_size, lr=cfg.distill_lr, momentum=0.0,
                               weight_decay=cfg.weight_decay,
                               device=self.device, generator=gen, optimizer="adam", **hooks)
        return loss

    def distill(self, model: nn.Module, targets: torch.Tensor | None, gen: torch.Generator,
                loss_fn) -> dict[str, float]:
        """The distillation stage (from round 2): fit the public set to the server's targets."""
        if targets is None or not self.cfg.distill_epochs:
            return {}
        cfg = self.cfg
        return {"distill-loss": fit_targets(model, self.public, targets, loss_fn,
                                            epochs=cfg.distill_epochs, batch_size=cfg.batch_size,
                                            lr=cfg.distill_lr, device=self.device, generator=gen)}

    def local_update(self, model: nn.Module, targets: torch.Tensor | None, gen: torch.Generator
                     ) -> dict[str, float]:
        """Distillation stage, then the private fit (FedDF, FedMD); FedCC adds a third stage."""
        out = self.distill(model, targets, gen, self.distill_loss)
        out["train-loss"] = self.fit_private(model, gen, self.cfg.local_epochs)
        return out

    def distill_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def train(self, msg: Message) -> Message:
        rnd = self.round_of(msg)
        gen = seeded_generator(self.cfg.seed, self.partition_id, rnd)
        model = self.local_model()
        rec = msg.content.array_records.get(SOFT_TARGETS)
        targets = torch.as_tensor(rec[SOFT_TARGETS].numpy()) if rec is not None else None
        want = (len(self.public), self.train_data.num_classes)
        if targets is not None and tuple(targets.shape) != want:  # extra rows or one column: silent
            raise ValueError(f"'{SOFT_TARGETS}' has shape {tuple(targets.shape)}, expected {want} "
                             "(public samples x classes)")
        if targets is not None and not torch.isfinite(targets).all():
            raise ValueError(f"'{SOFT_TARGETS}' holds NaN or inf values")
        metrics = self.local_update(model, targets, gen)
        self.keep_model(STATE, to_record(model))  # a diverged model: dropped, started afresh
        preds = self.outputs(model, self.public)
        return self.reply(msg, {"num-examples": len(self.train_data), **metrics},
                          **{PREDICTIONS: ArrayRecord({"p": Array(preds.numpy())})})

    def outputs(self, model: nn.Module, data: DataSet) -> torch.Tensor:
        """What the client shares of its model on ``data`` (the public or the test set): its
        softmax outputs (FedMD: logits; FedCT: hard labels, one-hot)."""
        return predict(model, data, self.device, probabilities=self.probabilities)

    def local_accuracy(self, model: nn.Module) -> dict[str, float]:
        """The local model on its local test split (not the ensemble)."""
        loss, acc = evaluate(model, self.test_data, self.device)
        return {"loss": loss, "accuracy": acc}

    def evaluate(self, msg: Message) -> Message:
        model = self.local_model()
        test = test_set(self.cfg)
        preds = self.outputs(model, test)
        metrics = {"num-examples": len(self.test_data),  # 0: no local test split, no local scores
                   # 0: not trained yet (not sampled, its first round failed, state lost): the
                   # server leaves its seeded initial model out of the ensemble
                   "trained": float(STATE in self.context.state.array_records)}
        if len(self.test_data):
            metrics.update(self.local_accuracy(model))
        metrics[GLOBAL_ACC] = self.global_accuracy(preds, test.y)
        content = RecordDict({TEST_PREDICTIONS: ArrayRecord({"p": Array(preds.numpy())})})
        return self.reply(msg, metrics, **content)

    def global_accuracy(self, preds: torch.Tensor, y: torch.Tensor) -> float:
        """This client's own model on the global test set."""
        return float((preds[:, : self.train_data.num_classes].argmax(1) == y).float().mean())
