"""FedNova (Wang et al., NeurIPS 2020), client half: FedAvg's local update, and the norm
||a_i||₁ of its gradient weights (``nova-norm``) for the server's normalised average.

With heavy-ball momentum ρ (the optimiser's buffer new each round) the k-th of τ steps gives
the gradient of step j the weight (1 − ρ^{k−j+1})/(1 − ρ) by the end, so
||a_i||₁ = Σ_{j=1..τ} (1 − ρ^j)/(1 − ρ) = [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ); plain SGD gives τ.
Weight decay and proximal terms are not part of a_i here (the paper treats them apart; both are
0 by default).
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client


def gradient_weight(steps: int, momentum: float) -> float:
    """||a||₁ of ``steps`` heavy-ball steps from a zero momentum buffer."""
    if momentum == 0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)


class FedNovaClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        loss, extra = super().fit(model, msg, rnd, **hooks)
        return loss, {**extra, "nova-norm": gradient_weight(self.steps, self.cfg.momentum)}
