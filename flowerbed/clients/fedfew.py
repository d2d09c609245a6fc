"""FedFew client: train each of the K server models on the local data; pick the best to serve.

Training (plain local SGD on each model, independently seeded) returns the K updated models
and their K training losses (the mean mini-batch loss of the last local epoch, as the official
code reports). Evaluation picks k* = argmin_k of the mean cross-entropy of the received model k on
the client's training split, and scores model k* on its local test split.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.training import evaluate, seeded_generator, to_record, train_epochs


class MultiModelClient(Client):
    """Helpers for clients that receive several named models (``model.0`` ...)."""

    def models_from(self, msg: Message) -> list[nn.Module]:
        keys = sorted((k for k in msg.content.array_records if k.startswith("model.")),
                      key=lambda k: int(k.split(".")[1]))
        return [self.model_from(msg.content[k]) for k in keys]

    def best_model(self, models: list[nn.Module]) -> tuple[int, list[float]]:
        """k* = the model with the lowest mean training-split loss (eval mode), and all losses; a
        NaN loss (a diverged model) ranks last (Python's min kept a NaN in first place)."""
        losses = [evaluate(m, self.train_data, self.device)[0] for m in models]
        return int(np.argmin(np.nan_to_num(losses, nan=np.inf))), losses

    def evaluate(self, msg: Message) -> Message:
        models = self.models_from(msg)
        k, _ = self.best_model(models)
        return self.scored(msg, models[k], {"chosen-model": k})


class FedFewClient(MultiModelClient):
    def train(self, msg: Message) -> Message:
        cfg, rnd = self.cfg, self.round_of(msg)
        out: dict[str, ArrayRecord] = {}
        losses = []
        models = self.models_from(msg)
        for k, model in enumerate(models):
            loss, _ = train_epochs(
                model, self.train_data, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, device=self.device,
                generator=seeded_generator(cfg.seed, self.partition_id, rnd, k), last_epoch=True)
            out[f"model.{k}"] = to_record(model)
            losses.append(float(loss))
        metrics = {"num-examples": len(self.train_data), "losses": losses, "train-loss": min(losses)}
        if cfg.fedfew_eval == "local" and len(self.test_data):  # the official code: score the
            # locally trained copies (a single-sample partition has no local test split)
            best, _ = self.best_model(models)
            loss, acc = evaluate(models[best], self.test_data, self.device)
            metrics.update({"personal-accuracy": acc, "personal-loss": loss, "chosen-model": best,
                            "eval-examples": len(self.test_data)})
        return self.reply(msg, metrics, **out)
