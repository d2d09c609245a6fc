"""ATLAS (Bai et al., NeurIPS 2022), server half, on Fed-ADE's streams and rounds.

A localised method: each client adapts its own base learners (:mod:`flowerbed.clients.atlas`) and
replies with metrics only. The server is Fed-ADE's (:class:`FedADEStrategy`: one round per (time
step, round within it), online and predict-then-update accuracy) with nothing to aggregate. It sends
the pre-trained model, from which a client starts its bases, to a client until its first training
reply (as FedRep's head, kept by partition); after that a client's messages carry no model.
"""

from __future__ import annotations

from flwr.app import RecordDict

from flowerbed.strategies.fedade import FedADEStrategy


class ATLASStrategy(FedADEStrategy):
    reply_arrays: dict[str, str] = {}  # clients reply with metrics only
    corrects = False
    server_model = False  # its arrays stay the pre-trained model, which no client predicts with

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        if not self.holds(node):
            return self.with_black_box(node, content)  # the pre-trained model, whole
        return RecordDict({k: v for k, v in content.items() if k != self.arrayrecord_key})

    def local_only(self) -> bool:
        return True
