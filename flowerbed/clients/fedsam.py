"""FedSAM (Qu et al., ICML 2022): FedAvg with sharpness-aware minimisation (SAM) as the local step.

Each local step takes the gradient g at w, moves to w + ε with ε = ρ·g/‖g‖ (``fedsam-rho``, the
radius; SAM's default 0.05; FedSAM codes use 0.1 (FL-Simulator, plain SGD with gradients clipped
at 10) or 0.5), takes the gradient there and steps from w with it (SGD with the run's momentum
and weight decay, no clipping). Two forward and backward passes per step; the second is plain
cross-entropy; the reported training loss is the loss at w. In a network with BatchNorm the
second pass updates its running statistics too (as FL-Simulator's does; davda54's SAM example
turns that off). The server is FedAvg's.
"""

from __future__ import annotations

import torch
from flwr.app import Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.base import Client


class FedSAMClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        rho, batch = self.cfg.fedsam_rho, {}

        def keep(x: torch.Tensor, y: torch.Tensor) -> None:
            batch["x"], batch["y"] = x, y

        def sharpness_aware(m: nn.Module) -> None:
            """Replace the gradients at w by those at w + ρ g/‖g‖ (the weights end at w)."""
            params = [p for p in m.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            at = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=float(rho / (norm + 1e-12)))
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(batch["x"]), batch["y"]).backward()
            with torch.no_grad():  # back to w exactly (w + ε − ε is not w in floating point)
                for p, w in zip(params, at, strict=True):
                    p.copy_(w)

        return super().fit(model, msg, rnd, batch_hook=keep, grad_hook=sharpness_aware, **hooks)
