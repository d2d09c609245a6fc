"""FedNova (Wang et al., NeurIPS 2020), client half: FedAvg's local update, and the norm
||a_i||₁ of its gradient weights (``nova-norm``) for the server's normalised average.

With heavy-ball momentum ρ (the optimiser's buffer new each round) the k-th of τ steps gives
the gradient of step j the weight (1 − ρ^{k−j+1})/(1 − ρ) by the end, so
||a_i||₁ = Σ_{j=1..τ} (1 − ρ^j)/(1 − ρ) = [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ); plain SGD gives τ.
Weight decay enters the gradient and is not part of a_i, as in the official code; the paper's
proximal-term variant is not implemented.
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client


def gradient_weight(steps: int, momentum: float) -> float:
    """||a||₁ of ``steps`` heavy-ball steps from a zero momentum buffer, summed as the official
    code does (the closed form loses digits as the momentum nears 1)."""
    weight = total = 0.0
    for _ in range(steps):
        weight = momentum * weight + 1.0  # step k's buffer: Σ_{j≤k} ρ^{k−j} g_j, weights summed
        total += weight
    return total


class FedNovaClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        loss, extra = super().fit(model, msg, rnd, **hooks)
        return loss, {**extra, "nova-norm": gradient_weight(self.steps, self.cfg.momentum)}
