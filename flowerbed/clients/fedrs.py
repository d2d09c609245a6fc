"""FedRS (Li & Zhan, KDD 2021): local cross-entropy with a restricted softmax.

The logits of the classes the client holds no training sample of are scaled by α
(``fedrs-alpha``; α = 1 is FedAvg, α = 0 drops them from the local softmax), so a client stops
pushing down the classes it never sees. The paper scales those classes' classifier weights
(its classifier has no bias); here the whole logit is scaled, as fluke's FedRS does, which is the
same for a bias-free classifier. The server is FedAvg's, and evaluation uses the plain logits.
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.clients.fedlc import class_counts


class FedRSClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        scale = (class_counts(self) > 0).float().clamp_min(self.cfg.fedrs_alpha)
        return super().fit(model, msg, rnd, logit_hook=lambda z: z * scale, **hooks)
