"""FedMD client: "digest" (regress the class scores to the consensus, L1) then "revisit"
(fit the private data); uploads class scores (logits) on the public set."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from flowerbed.clients.distill import DistillClient


class FedMDClient(DistillClient):
    probabilities = False

    def distill_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(logits, targets)
