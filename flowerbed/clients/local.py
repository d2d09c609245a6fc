"""Local-only client: its own model in ``context.state``, trained on its own data, never shared.

It starts from the same seeded initial model as every other method's global model.
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.training import cpu_seeded, to_record

STATE = "local.model"


class LocalClient(Client):
    keeps_state = True
    state_key = STATE  # where its model is kept (FedSoft's client keeps its own under another name)

    def init_seed(self) -> int:
        return self.cfg.seed  # the ServerApp's initialisation of every method

    def own_model(self) -> nn.Module:
        if (own := self.state_model(self.state_key)) is not None:
            return own
        with cpu_seeded(self.init_seed()):  # the model is built on the CPU
            return self.new_model().to(self.device)

    def train(self, msg: Message) -> Message:
        model = self.own_model()
        loss, _ = self.fit(model, msg, self.round_of(msg))
        self.keep_model(self.state_key, to_record(model))
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss})

    def evaluate(self, msg: Message) -> Message:
        """Scored with its own model; before it has one (not trained yet, or dropped when it
        diverged), with the seeded initial model, and ``personal-model`` 0 says so."""
        own = float(self.state_key in self.context.state.array_records)
        return self.scored(msg, self.own_model(), {"personal-model": own})
