"""FedFTG (Zhang et al., CVPR 2022), client half: FedAvg's local update, and the count of each
class in the client's training split (``label-counts``), from which the server draws the labels
it generates and weighs each client model as a teacher of each class (:mod:`flowerbed.strategies.fedftg`)."""

from __future__ import annotations

from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client

COUNTS = "label-counts"


class FedFTGClient(Client):
    """FedAvg's local update, and the label counts."""

    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        loss, extra = super().fit(model, msg, rnd, **hooks)
        return loss, {**extra, COUNTS: [int(v) for v in self.class_counts()]}
