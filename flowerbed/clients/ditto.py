"""Ditto (Li et al., ICML 2021), client half: FedAvg's local update of the global model w, and a
personal model v kept in ``context.state`` and trained on F_i(v) + (λ/2)·||v − w||², w the
received global model (``ditto-lambda``, ``ditto-personal-epochs``).

Only the global update is uploaded, so the server's model is FedAvg's to the bit; the client is
scored with v. v starts as the model the client first trains from: the initial global model w⁰
when every client trains every round (as in Ditto's code), the global model of its first sampled
round otherwise. A client without v (not trained yet, or its state lost) is scored with the
received global model and says so: its evaluation reply's ``personal-model`` is 0, and the
round's mean of it (``client-personal-model`` in metrics.jsonl) is the share of clients, by test
samples, scored with their own v.
``personal-train-loss`` is v's training objective (cross-entropy plus the proximal term). A v
that diverges (not finite after training) is dropped, not kept: that round's reply is refused
(its loss is NaN), and the next round starts v afresh from the received global model.
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.clients.fedavg import proximal
from flowerbed.training import to_record

STATE = "ditto.personal"


class DittoClient(Client):
    keeps_state = True

    def personal_model(self, msg: Message) -> nn.Module:
        own = self.state_model(STATE)
        return own if own is not None else self.model_from(msg.content["arrays"])

    def train(self, msg: Message) -> Message:
        cfg, rnd = self.cfg, self.round_of(msg)
        model = self.model_from(msg.content["arrays"])
        personal = self.personal_model(msg)
        # v first, pulled towards w as received; its own batch order (stream 1), so that w's
        # update below draws FedAvg's
        personal_loss, _ = self.fit(personal, msg, rnd, epochs=cfg.ditto_personal_epochs, stream=1,
                                    loss_hook=proximal(model, cfg.ditto_lambda))
        self.keep_model(STATE, to_record(personal))
        loss, _ = self.fit(model, msg, rnd)
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss,
                                "personal-train-loss": personal_loss}, arrays=to_record(model))

    def evaluate(self, msg: Message) -> Message:
        own = float(STATE in self.context.state.array_records)
        return self.scored(msg, self.personal_model(msg), {"personal-model": own})
