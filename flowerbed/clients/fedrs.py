"""FedRS (Li & Zhan, KDD 2021): local cross-entropy with a restricted softmax.

The logits of the classes the client holds no training sample of are scaled by α
(``fedrs-alpha``; α = 1 is FedAvg; at α = 0 they are 0 and still count in the softmax's sum), so
a client pushes the classes it never sees down less. The paper scales those classes' classifier
weights, and its code has a bias-free classifier; here the whole logit is scaled, bias included
(the CNN's and ResNets' classifiers have one), as fluke's FedRS and Flower's FedRS baseline do.
The authors' code (FedRepo) scales every class by α + (1 − α)·n_c / max_c n_c instead, so rare
but present classes are scaled too; that equals this rule on the even pathological splits, not on
Dirichlet ones: ``fedrs-scaling='proportional'`` takes it (the default ``'absent'`` is the
paper's and fluke's rule). The reported ``train-loss`` is the restricted loss. The server is FedAvg's, and
evaluation uses the plain logits.
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.base import Client


class FedRSClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        counts, alpha = self.class_counts(), self.cfg.fedrs_alpha
        if self.cfg.fedrs_scaling == "proportional":
            scale = alpha + (1 - alpha) * counts / counts.max()
        else:
            scale = (counts > 0).float().clamp_min(alpha)
        return super().fit(model, msg, rnd, criterion=lambda z, y: F.cross_entropy(z * scale, y), **hooks)
