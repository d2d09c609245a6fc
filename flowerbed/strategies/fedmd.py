"""FedMD (Li & Wang, 2019), server half: the consensus is the mean of the clients' class scores.

Clients upload logits (class scores) on the public set; the consensus is their mean; inference
averages the clients' softmax outputs. FedMD's initial transfer learning on a *labelled* public
set does not apply here (the public set has no labels) and is left out.
"""

from __future__ import annotations

import numpy as np

from flowerbed.strategies.distill import DistillStrategy


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class FedMDStrategy(DistillStrategy):
    probabilities = False

    def combine(self, preds: np.ndarray) -> np.ndarray:
        return preds.mean(0)  # consensus logits

    def ensemble_probs(self, preds: np.ndarray) -> np.ndarray:
        return softmax(preds).mean(0)
