"""FedAvg and FedProx: Flower's own strategies with flowerbed's sampling/validation/accounting.

FedAvg's is also the server half of FedAvg-FT, FedLC, FedRS, FedSAM and FedVLS, which change
only the client's local step or evaluation."""

from __future__ import annotations

from flwr.serverapp.strategy import FedProx

from flowerbed.config import Config
from flowerbed.strategies.base import FlowerbedFedAvg, aggregate_metrics
from flowerbed.strategies.personal import PersonalStrategy


class FedAvgStrategy(FlowerbedFedAvg):
    """FedAvg (McMahan et al., 2017): the sample-weighted mean of the clients' models."""


class FedAvgFTStrategy(PersonalStrategy):
    """FedAvg-FT: FedAvg's aggregation, scored like the other personalised methods: the round's
    accuracy is the clients' (sample-weighted) accuracy on their local test splits after local
    fine-tuning, not the global model's on the server test set."""


class FedProxStrategy(FedProx, FlowerbedFedAvg):
    """FedProx (Li et al., 2020): Flower's FedProx, which adds ``proximal-mu`` to the config.

    The MRO is FedProx -> FlowerbedFedAvg -> FedAvg, so Flower's FedProx.configure_train puts mu
    in the config and then calls our deterministic, accounted configure_train.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        FedProx.__init__(self, proximal_mu=cfg.proximal_mu,
                         fraction_train=cfg.fraction_train,
                         fraction_evaluate=cfg.fraction_evaluate,
                         min_train_nodes=cfg.min_clients, min_evaluate_nodes=1,
                         min_available_nodes=cfg.min_clients,
                         # FedProx passes None for these, which would replace ours with Flower's
                         # (a metric some replies lack would be pulled towards 0)
                         train_metrics_aggr_fn=aggregate_metrics,
                         evaluate_metrics_aggr_fn=aggregate_metrics)
