"""Ditto (Li et al., ICML 2021), server half: FedAvg of the clients' global updates.

The clients keep their personal models in ``context.state`` and upload only their update of the
global model, so aggregation is FedAvg's; the score is personalised accuracy (each client's
personal model on its local test split), as for the other personalised methods.
"""

from __future__ import annotations

from flowerbed.strategies.personal import PersonalStrategy


class DittoStrategy(PersonalStrategy):
    """FedAvg's aggregation, scored by the clients' personal models."""
