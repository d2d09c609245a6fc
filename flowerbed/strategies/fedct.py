"""FedCT (Abourayya et al., AAAI 2025, "Little is Enough"), server half: the consensus of hard labels.

Clients upload one-hot labels on the public set (:mod:`flowerbed.clients.fedct`); the consensus is
each sample's majority vote over the round's clients (a tie drawn uniformly among the tied classes,
seeded by the round), sent back one-hot as the next round's pseudo-labels. Inference is the clients'
majority vote on the test set, ties drawn the same way. The paper's optional differentially private
consensus (randomised response on the shared labels) and its sharing period (labels every b rounds;
here every round) are not implemented.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from flowerbed.strategies.distill import DistillStrategy


def majority(votes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each row's most voted class [N], a tie drawn uniformly among the tied classes (always the
    lowest class would label every sample on which all clients disagree as class 0: with one
    class per client, the whole public set)."""
    top = votes == votes.max(1, keepdims=True)
    return (top * rng.random(votes.shape)).argmax(1)


class FedCTStrategy(DistillStrategy):
    def combine(self, preds: np.ndarray) -> np.ndarray:
        """[clients, N, C] one-hot labels -> [N, C] the majority vote, one-hot."""
        votes = preds.sum(0)
        return np.eye(votes.shape[1], dtype=np.float32)[majority(votes, self._rng(0))]

    def ensemble_probs(self, preds: np.ndarray) -> np.ndarray:
        """The vote shares, the majority (ties drawn) ahead of a tied class by a hair, so that
        their argmax is the majority vote."""
        votes = preds.sum(0)
        win = np.eye(votes.shape[1], dtype=np.float32)[majority(votes, self._rng(1))]
        return preds.mean(0) + 1e-6 * win

    def _rng(self, stream: int) -> np.random.Generator:
        """Seeded by the run's seed and the round (the same draws after a resume)."""
        return np.random.default_rng([self.cfg.seed, self.round_asked, 44, stream])

    def _check_matrix(self, rec: ArrayRecord, rows: int) -> str | None:
        problem = super()._check_matrix(rec, rows)
        if problem is None and not np.isin(rec["p"].numpy(), (0, 1)).all():
            return "predictions are not hard labels (one-hot rows of 0 and 1)"
        return problem
