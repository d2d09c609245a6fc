"""FedFTG (Zhang et al., CVPR 2022), client half: FedAvg's local update, and the count of each
class in the client's training split (``label-counts``), from which the server draws the labels
it generates and weighs each client model as a teacher of each class (:mod:`flowerbed.strategies.fedftg`)."""

from __future__ import annotations

import torch
from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.datasets.loading import NUM_CLASSES

COUNTS = "label-counts"


class FedFTGClient(Client):
    """FedAvg's local update, and the label counts (FedConcat's client in its first stage too)."""

    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        loss, extra = super().fit(model, msg, rnd, **hooks)
        counts = torch.bincount(self.train_data.y, minlength=NUM_CLASSES[self.cfg.dataset])
        return loss, {**extra, COUNTS: [int(v) for v in counts]}
