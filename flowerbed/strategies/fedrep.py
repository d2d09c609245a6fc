"""FedRep (Collins et al., 2021), server half: average the shared body, never the head.

Clients keep their personal classifier head in ``context.state`` and upload only the body;
the server's record keeps its initial head only to give clients a starting head.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message

from flowerbed.models import is_head
from flowerbed.strategies.personal import PersonalStrategy


class FedRepStrategy(PersonalStrategy):
    reply_arrays = {"arrays": "subset"}  # the body: a subset of the model's keys

    def subset_keys(self, key: str, reference: ArrayRecord) -> set[str] | None:
        return {k for k in reference if not is_head(k)}  # the whole body, never the head

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        body, metrics = super().aggregate_train(server_round, replies)
        if body is None or self._reference is None:
            return body, metrics
        merged = dict(self._reference.items())
        merged.update(body.items())
        return ArrayRecord(merged), metrics
