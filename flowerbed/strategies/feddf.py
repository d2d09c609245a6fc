"""FedDF-style baseline, server half: the clients' predictions on the public set averaged.

This is the prediction-exchange form used as a baseline in FedCC's setting (clients distil
towards the averaged soft targets; no weights travel), not FedDF's original server-side
distillation of averaged weights. ``feddf-average``: the mean of the clients' softmax outputs
(``probabilities``, the default), or the softmax of the mean of their logits (``logits``,
FedDF's AVGLOGITS: the clients then upload logits).
"""

from __future__ import annotations

import numpy as np
from scipy.special import softmax

from flowerbed.strategies.distill import DistillStrategy


class FedDFStrategy(DistillStrategy):
    """Soft targets (and the ensemble): see the module doc."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.probabilities = cfg.feddf_average == "probabilities"

    def combine(self, preds: np.ndarray) -> np.ndarray:
        if self.probabilities:
            return preds.mean(0)
        return softmax(preds.astype(np.float64).mean(0), axis=1)
