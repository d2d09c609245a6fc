"""Fed-POE (Ghari & Shen, NeurIPS 2024), server half, on Fed-ADE's streams and rounds.

Fed-ADE's server (:class:`FedADEStrategy`: one round per (time step, round within it), the
pre-trained start, online and predict-then-update accuracy) with every layer federated: the
clients' federated models are averaged whole. A client that has not filed its local model yet
(:mod:`flowerbed.clients.fedpoe`) also gets the pre-trained model, to start its local one from
(kept by partition, as FedRep's personal layers are; every message to it carries one).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, RecordDict

from flowerbed.clients.fedpoe import PRETRAINED
from flowerbed.strategies.base import with_record
from flowerbed.strategies.fedade import FedADEStrategy


class FedPOEStrategy(FedADEStrategy):
    corrects = False

    def subset_keys(self, key: str, reference: ArrayRecord) -> set[str] | None:
        return set(reference)  # no personal layers: the local model is a whole model of its own

    def local_only(self) -> bool:
        return False  # (Fed-ADE's fedade-sync: Fed-POE always shares its federated model)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        # (its pre-trained model is also BBSE's fixed classifier: no second copy)
        return content if self.holds(node) else with_record(content, PRETRAINED, self._pretrained)
