"""Method name -> (strategy factory, client class). The launcher and both apps use this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flowerbed.clients.base import Client
from flowerbed.clients.fedavg import FedAvgClient, FedProxClient
from flowerbed.clients.scaffold import ScaffoldClient
from flowerbed.strategies.base import FlowerbedFedAvg
from flowerbed.strategies.fedavg import FedAvgStrategy, FedProxStrategy
from flowerbed.strategies.scaffold import ScaffoldStrategy


@dataclass(frozen=True)
class Method:
    name: str
    strategy: Callable[..., FlowerbedFedAvg]
    client: type[Client]
    summary: str


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("fedavg", FedAvgStrategy, FedAvgClient, "FedAvg (McMahan et al., 2017)"),
        Method("fedprox", FedProxStrategy, FedProxClient, "FedProx (Li et al., 2020)"),
        Method("scaffold", ScaffoldStrategy, ScaffoldClient,
               "SCAFFOLD (Karimireddy et al., 2020), option II control variates"),
    )
}
