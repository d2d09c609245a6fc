"""FedCC, server half: per-sample weighting by "not unknown", then drop the unknown class.

For every public sample x and client k with prediction ŷᵏ(x) ∈ Δ^{C+1} (last entry: unknown),

    μᵏ(x) = (1 − ŷᵏ_u(x)) / Σ_j (1 − ŷʲ_u(x)),     ỹ(x) = Σ_k μᵏ(x) ŷᵏ(x)   (Eq. 11)

then the unknown entry is zeroed and the C others renormalised: the next soft targets. The
ensemble used for inference combines the clients' test-set predictions the same way.
"""

from __future__ import annotations

import logging

import numpy as np

from flowerbed.strategies.distill import DistillStrategy

log = logging.getLogger("flowerbed")

EPS = 1e-8


def aggregate_fedcc(preds: np.ndarray) -> np.ndarray:
    """[clients, N, C+1] probabilities -> [N, C] soft targets (FedCC's Eq. 11, unknown dropped).

    When every client says "unknown" for a sample, the weights fall back to equal (an ε in
    each weight) and, if no class mass remains, the target is uniform.
    """
    known_mass = np.clip(1.0 - preds[..., -1], 0.0, 1.0)  # [K, N]; a reply's row may sum to 1 ± 1e-3
    mu = (known_mass + EPS) / (known_mass + EPS).sum(0, keepdims=True)
    agg = (mu[..., None] * preds).sum(0)[:, :-1]                       # [N, C]
    total = agg.sum(1, keepdims=True)
    c = agg.shape[1]
    return np.where(total > EPS, agg / np.maximum(total, EPS), 1.0 / c)


class FedCCStrategy(DistillStrategy):
    extra_outputs = 1

    def combine(self, preds: np.ndarray) -> np.ndarray:
        return aggregate_fedcc(preds)

    def inspect(self, server_round: int, partitions: list[int], metrics: list) -> None:
        """Warn when a client's probe bias covers every class (|C_J| = C, so w_u = 0 and α = 1):
        its pseudo-labels never say "unknown" and μ = 1 − p(unknown) lets it outvote the others
        (the ensemble collapse described in the README)."""
        full = [p for p, m in zip(partitions, metrics, strict=True)
                if m.get("fedcc-majority-classes", 0) >= self.num_classes]
        warned = self.__dict__.setdefault("_warned_full", set())  # partitions named already
        new = sorted(set(full) - warned)
        warned |= set(full)
        if full and not new:  # said before: once per client, then the rounds' info lines
            log.info("[round %d] FedCC: partitions %s still have every class as a majority class",
                     server_round, ", ".join(map(str, full)))
        elif full:
            log.warning("[round %d] FedCC: %d client(s) (partitions %s) have every class as a majority "
                        "class (w_u = 0): their pseudo-labels never say 'unknown'; a different "
                        "featureless probe (fedcc-probe-input) or more third-stage epochs "
                        "(fedcc-ssl-epochs) may help", server_round, len(full),
                        ", ".join(map(str, full)))
