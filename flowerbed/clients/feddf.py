"""FedDF-style client: distil towards the averaged soft targets (KL), then fit the private data."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from flowerbed.clients.distill import DistillClient


class FedDFClient(DistillClient):
    @property
    def probabilities(self) -> bool:
        """Softmax outputs up, or logits (``feddf-average='logits'``)."""
        return self.cfg.feddf_average == "probabilities"

    def distill_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """KL(targets ‖ softmax(logits)), batch mean."""
        return F.kl_div(F.log_softmax(logits, 1), targets, reduction="batchmean")
