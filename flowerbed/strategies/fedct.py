"""FedCT (Abourayya et al., AAAI 2025, "Little is Enough"), server half: the consensus of hard labels.

Clients upload one-hot labels on the public set (:mod:`flowerbed.clients.fedct`); the consensus
is each sample's majority vote over the round's clients (a tie goes to the lowest class), sent
back one-hot as the next round's pseudo-labels. Inference is the clients' majority vote on the
test set. The paper's optional differentially private consensus (randomised response on the
shared labels) and its sharing period (labels every b rounds; here every round) are not
implemented.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from flowerbed.strategies.distill import DistillStrategy


class FedCTStrategy(DistillStrategy):
    def combine(self, preds: np.ndarray) -> np.ndarray:
        """[clients, N, C] one-hot labels -> [N, C] the majority vote, one-hot."""
        votes = preds.sum(0)
        return np.eye(votes.shape[1], dtype=np.float32)[votes.argmax(1)]

    def ensemble_probs(self, preds: np.ndarray) -> np.ndarray:
        return preds.mean(0)  # the vote shares: their argmax is the majority vote

    def _check_matrix(self, rec: ArrayRecord, rows: int) -> str | None:
        problem = super()._check_matrix(rec, rows)
        if problem is None and not np.isin(rec["p"].numpy(), (0, 1)).all():
            return "predictions are not hard labels (one-hot rows of 0 and 1)"
        return problem
