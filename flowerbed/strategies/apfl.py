"""APFL (Deng, Kamani & Mahdavi, 2020), server half: FedAvg of the clients' global updates.

The clients keep their personal models and mixing weights α in ``context.state`` and upload only
their update of the global model, so aggregation is FedAvg's; the score is personalised accuracy
(each client's α v + (1 − α) w on its local test split), as for the other personalised methods.
"""

from __future__ import annotations

from flowerbed.strategies.personal import PersonalStrategy


class APFLStrategy(PersonalStrategy):
    """FedAvg's aggregation, scored by the clients' mixtures of their personal and the global model."""
