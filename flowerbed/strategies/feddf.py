"""FedDF-style baseline, server half: the mean of the clients' probabilities on the public set.

This is the logit-exchange form used as a baseline in FedCC's setting (clients distil towards
the averaged soft targets; no weights travel), not FedDF's original server-side distillation of
averaged weights.
"""

from __future__ import annotations

from flowerbed.strategies.distill import DistillStrategy


class FedDFStrategy(DistillStrategy):
    """Soft targets = the plain mean of the clients' softmax outputs (see the module doc)."""
