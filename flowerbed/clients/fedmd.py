"""FedMD client: "digest" (regress the class scores to the consensus, L1) then "revisit"
(fit the private data); uploads class scores (logits) on the public set."""

from __future__ import annotations

from torch.nn import functional as F

from flowerbed.clients.distill import DistillClient
from flowerbed.training import fit_targets


class FedMDClient(DistillClient):
    probabilities = False

    def local_update(self, model, targets, gen):
        cfg, out = self.cfg, {}
        if targets is not None and cfg.distill_epochs:
            out["digest-loss"] = fit_targets(
                model, self.public, targets, F.l1_loss, epochs=cfg.distill_epochs,
                batch_size=cfg.batch_size, lr=cfg.distill_lr, device=self.device, generator=gen)
        out["train-loss"] = self.fit_private(model, gen, cfg.local_epochs)
        return out
