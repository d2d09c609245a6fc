"""Local-only client: its own model in ``context.state``, trained on its own data, never shared.

It starts from the same seeded initial model as every other method's global model.
"""

from __future__ import annotations

import torch
from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.training import evaluate, load_record, to_record

STATE = "local.model"


class LocalClient(Client):
    keeps_state = True

    def own_model(self) -> nn.Module:
        saved = self.context.state.array_records.get(STATE)
        if saved is not None:
            return load_record(self.new_model(), saved).to(self.device)
        with torch.random.fork_rng():
            torch.manual_seed(self.cfg.seed)  # the ServerApp's initialisation of every method
            return self.new_model().to(self.device)

    def train(self, msg: Message) -> Message:
        model = self.own_model()
        loss, _ = self.fit(model, msg, self.round_of(msg))
        self.context.state[STATE] = to_record(model)
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss})

    def evaluate(self, msg: Message) -> Message:
        loss, acc = evaluate(self.own_model(), self.test_data, self.device)
        return self.reply(msg, {"num-examples": max(len(self.test_data), 1), "loss": loss,
                                "accuracy": acc})
