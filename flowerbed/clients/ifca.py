"""IFCA client: pick the cluster model with the lowest training loss, train it, return it."""

from __future__ import annotations

from flwr.app import Message

from flowerbed.clients.fedfew import MultiModelClient
from flowerbed.training import to_record


class IFCAClient(MultiModelClient):
    def train(self, msg: Message) -> Message:
        models = self.models_from(msg)
        k, _ = self.best_model(models)
        model = models[k]
        loss, _ = self.fit(model, msg, self.round_of(msg))
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss,
                                "cluster": k}, arrays=to_record(model))
