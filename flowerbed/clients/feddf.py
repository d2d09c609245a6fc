"""FedDF-style client: distil towards the averaged soft targets (KL), then fit the private data."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from flowerbed.clients.distill import DistillClient
from flowerbed.training import fit_targets


class FedDFClient(DistillClient):
    def local_update(self, model, targets, gen):
        cfg, out = self.cfg, {}
        if targets is not None and cfg.distill_epochs:
            out["distill-loss"] = fit_targets(
                model, self.public, targets, kl_to_targets, epochs=cfg.distill_epochs,
                batch_size=cfg.batch_size, lr=cfg.distill_lr, device=self.device, generator=gen)
        out["train-loss"] = self.fit_private(model, gen, cfg.local_epochs)
        return out


def kl_to_targets(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """KL(targets ‖ softmax(logits)), batch mean."""
    return F.kl_div(F.log_softmax(logits, 1), targets, reduction="batchmean")
