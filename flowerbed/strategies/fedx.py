"""FedX, server half: unchanged FedAvg of the whole model (backbone and both heads) + the probe.

FedX only changes the local objective (``clients/fedx.py``); the server aggregates as FedAvg,
sample-weighted and renormalised over the participants (the official code's weights do not
sum to one under partial participation; papers.md §1.8).
"""

from __future__ import annotations

from flowerbed.strategies.ssl import SSLStrategy


class FedXStrategy(SSLStrategy):
    """FedAvg + linear probe; see the module docstring."""
