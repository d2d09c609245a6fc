"""FedAvg and FedProx clients."""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client


def proximal(anchor: nn.Module, mu: float) -> Callable[[nn.Module], torch.Tensor]:
    """A loss hook (mu/2)·||w − a||² that pulls a model towards ``anchor``'s parameters as they
    are now (FedProx: the received global model; Ditto: the same, for the personal model)."""
    fixed = [p.detach().clone() for p in anchor.parameters()]

    def term(m: nn.Module) -> torch.Tensor:
        return (mu / 2) * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), fixed, strict=True))

    return term


class FedAvgClient(Client):
    """Plain local SGD (the base client)."""


class FedProxClient(Client):
    """Local SGD on cross-entropy + (mu/2)·||w − w_global||², mu from the server's config."""

    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        mu = float(msg.content["config"]["proximal-mu"])
        return super().fit(model, msg, rnd, loss_hook=proximal(model, mu), **hooks)


class FedAvgFTClient(FedAvgClient):
    """FedAvg, evaluated after fine-tuning the global model locally (``finetune-epochs``)."""

    def evaluate(self, msg: Message) -> Message:
        from flowerbed.training import seeded_generator, train_epochs

        model = self.model_from(msg.content["arrays"])
        cfg = self.cfg
        train_epochs(model, self.train_data, epochs=cfg.finetune_epochs, batch_size=cfg.batch_size,
                     lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                     device=self.device,
                     generator=seeded_generator(cfg.seed, self.partition_id, self.round_of(msg), 99))
        return self.scored(msg, model)
