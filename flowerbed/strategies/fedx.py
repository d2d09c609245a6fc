"""FedX, server half: unchanged FedAvg of the whole model (backbone and both heads) + the probe.

FedX only changes the local objective (``clients/fedx.py``); the server aggregates as FedAvg
(with ``fedx-global='scaffold'`` as SCAFFOLD),
sample-weighted and renormalised over the participants (the official code's weights do not
sum to one under partial participation; papers.md §1.8).
"""

from __future__ import annotations

from flowerbed.strategies.base import FlowerbedFedAvg
from flowerbed.strategies.scaffold import ScaffoldStrategy
from flowerbed.strategies.ssl import SSLStrategy


class FedXStrategy(SSLStrategy):
    """FedAvg + linear probe; see the module docstring."""


class FedXScaffoldStrategy(ScaffoldStrategy, FedXStrategy):
    """``fedx-global='scaffold'`` (the paper's Table 2): SCAFFOLD's server (the control variate c,
    ``scaffold-server-lr``) with FedX's probe."""


def fedx_strategy(cfg) -> FlowerbedFedAvg:
    """FedX's server for the run's ``fedx-global``."""
    return (FedXScaffoldStrategy if cfg.fedx_global == "scaffold" else FedXStrategy)(cfg)
