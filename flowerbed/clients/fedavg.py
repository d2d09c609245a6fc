"""FedAvg and FedProx clients."""

from __future__ import annotations

import torch
from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client


class FedAvgClient(Client):
    """Plain local SGD (the base client)."""


class FedProxClient(Client):
    """Local SGD on cross-entropy + (mu/2)·||w − w_global||², mu from the server's config."""

    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        mu = float(msg.content["config"]["proximal-mu"])
        anchor = [p.detach().clone() for p in model.parameters()]

        def proximal(m: nn.Module) -> torch.Tensor:
            return (mu / 2) * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor,
                                                                      strict=True))

        return super().fit(model, msg, rnd, loss_hook=proximal, **hooks)
