"""Method name -> (strategy, client, model). The launcher and both apps use this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import Context
from torch import nn

from flowerbed.clients.base import Client, make_model
from flowerbed.clients.fedavg import FedAvgClient, FedProxClient
from flowerbed.clients.fedbyol import BYOLClient
from flowerbed.clients.fedsimclr import SimCLRClient, make_ssl_model
from flowerbed.clients.fedu import FedUClient
from flowerbed.clients.fedx import fedx_client
from flowerbed.clients.scaffold import ScaffoldClient
from flowerbed.config import Config
from flowerbed.datasets.loading import DataSet
from flowerbed.strategies.base import FlowerbedFedAvg
from flowerbed.strategies.fedavg import FedAvgStrategy, FedProxStrategy
from flowerbed.strategies.fedx import FedXStrategy
from flowerbed.strategies.scaffold import ScaffoldStrategy
from flowerbed.strategies.ssl import SSLStrategy


@dataclass(frozen=True)
class Method:
    name: str
    strategy: Callable[[Config], FlowerbedFedAvg]
    client: Callable[[Config, Context], Client]
    model: Callable[[Config, DataSet], nn.Module]
    summary: str


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("fedavg", FedAvgStrategy, FedAvgClient, make_model, "FedAvg (McMahan et al., 2017)"),
        Method("fedprox", FedProxStrategy, FedProxClient, make_model, "FedProx (Li et al., 2020)"),
        Method("scaffold", ScaffoldStrategy, ScaffoldClient, make_model,
               "SCAFFOLD (Karimireddy et al., 2020), option II control variates"),
        Method("fedsimclr", SSLStrategy, SimCLRClient, make_ssl_model,
               "FedSimCLR: SimCLR (NT-Xent) locally, FedAvg; linear probe"),
        Method("fedbyol", SSLStrategy, BYOLClient, make_ssl_model,
               "FedBYOL: BYOL locally (EMA target kept on the client), FedAvg; linear probe"),
        Method("fedu", SSLStrategy, FedUClient, make_ssl_model,
               "FedU (Zhuang et al., 2021): FedBYOL + divergence-aware predictor update"),
        Method("fedx", FedXStrategy, fedx_client, make_ssl_model,
               "FedX (Han et al., 2022) on the base chosen by fedx-base; linear probe"),
    )
}
