"""FedVLS (Guo et al., AAAI 2024, "Exploring Vacant Classes in Label-Skewed Federated Learning").

A FedAvg client whose local loss, as in the official code (krumpguo/FedVLS, ``clientvls.py``), is

    L = CE(z + log(π + 1e-9), y)                         prior-corrected cross-entropy
      + 0.005 Σ_c π_c [logsumexp_{i: y_i ≠ c} (z_ic − log(π_c + 1e-9) − log C) − log B]
                                                          logit suppression (non-label logits)
      + λ KL(softmax(t_V) ‖ softmax(z_V))                 vacant-class distillation

with π the client's label distribution, z the local logits, B the batch size, t the logits of
the received global model and V the client's vacant classes (π_c = 0), λ = ``fedvls-lambda``
(the code's default 1.0). The teacher is a frozen copy of the received model that runs, as the
official code's does, in train mode (a network with BatchNorm normalises the teacher's batch by
its own statistics; the copy's running statistics are thrown away with it). In the suppression
term the code multiplies the samples of class c by 0 instead of leaving them out, so each adds
exp(0) to that class's logsumexp; flowerbed does the same. Without vacant classes the
distillation term is 0. A client holding one class only (``pathological:1``) hardly trains: its
prior-corrected cross-entropy is about 1e-9 (the absent classes sit at log 1e-9), the
suppression term is 0 (every sample masked) and the distillation starts at 0 (the local model
is the teacher); that is the method (the official loss does the same). The official client also
sets weight decay to 0; flowerbed keeps the run's. The server is FedAvg's; evaluation uses the
plain logits.
"""

from __future__ import annotations

import copy
import math

import torch
from flwr.app import Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.base import Client


def vls_loss(z: torch.Tensor, y: torch.Tensor, teacher: torch.Tensor, prior: torch.Tensor,
             lam: float) -> torch.Tensor:
    """FedVLS's local loss of one batch (see the module docstring)."""
    log_prior = torch.log(prior + 1e-9)
    ce = F.cross_entropy(z + log_prior, y)
    n_cls = z.shape[1]
    others = (y.view(1, -1) != torch.arange(n_cls, device=z.device).view(-1, 1)).float()  # C x B
    spread = (z - log_prior - math.log(n_cls)).T * others
    suppression = 0.005 * (prior * (torch.logsumexp(spread, 1) - math.log(z.shape[0]))).sum()
    vacant = prior == 0
    if not vacant.any():
        return ce + suppression
    kd = F.kl_div(F.log_softmax(z[:, vacant], 1), F.softmax(teacher[:, vacant], 1), reduction="batchmean")
    return ce + suppression + lam * kd


class FedVLSClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        counts = self.class_counts()
        prior = counts / counts.sum()
        teacher = copy.deepcopy(model).train()  # the received global model, frozen; train mode as
        # in the official code (its teacher is a copy of the server's model, kept in train mode)
        teacher.requires_grad_(False)
        batch = {}

        def keep(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.no_grad():
                batch["t"] = teacher(x)

        return super().fit(model, msg, rnd, batch_hook=keep,
                           criterion=lambda z, y: vls_loss(z, y, batch["t"], prior, self.cfg.fedvls_lambda),
                           **hooks)
