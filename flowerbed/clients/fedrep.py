"""FedRep client: train the personal head (body frozen), then the body (head frozen).

The head lives in ``context.state["fedrep.head"]``; only the body is uploaded.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.models import is_head
from flowerbed.training import to_record

HEAD = "fedrep.head"


def set_trainable(model: nn.Module, head: bool) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(is_head(name) == head)


class FedRepClient(Client):
    keeps_state = True

    def personal_model(self, msg: Message) -> nn.Module:
        return self.model_with(msg.content["arrays"], self.context.state.array_records.get(HEAD))

    def train(self, msg: Message) -> Message:
        model, rnd = self.personal_model(msg), self.round_of(msg)
        set_trainable(model, head=True)
        cfg = self.cfg
        if cfg.fedrep_head_epochs:
            self.fit(model, msg, rnd * 2, epochs=cfg.fedrep_head_epochs)
        set_trainable(model, head=False)
        loss, _ = self.fit(model, msg, rnd * 2 + 1)
        set_trainable(model, head=True)
        record = to_record(model)
        self.keep_model(HEAD, ArrayRecord({k: v for k, v in record.items() if is_head(k)}))
        body = ArrayRecord({k: v for k, v in record.items() if not is_head(k)})
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss},
                          arrays=body)

    def evaluate(self, msg: Message) -> Message:
        """Scored with its own head; before it has one, with the head the server sends (the
        initial one, never trained), and ``personal-model`` 0 says so."""
        own = float(HEAD in self.context.state.array_records)
        return self.scored(msg, self.personal_model(msg), {"personal-model": own})
