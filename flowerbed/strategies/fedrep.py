"""FedRep (Collins et al., 2021), server half: average the shared body, never the head.

Clients keep their personal classifier head in ``context.state`` and upload only the body. The
server's record keeps its initial head only to give clients a starting head: a client gets the
whole model until a training reply shows it holds its own head, and the body alone after that
(Fed-ADE, a subclass, does the same with its personal layers). Kept by partition, as the
clients file their state (:mod:`flowerbed.client_state`), and checkpointed; a partition that
another node serves now, or whose client replied with an error (its state may be gone: a new
machine), gets the whole model again.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message, RecordDict

from flowerbed.models import is_head
from flowerbed.strategies.base import with_record
from flowerbed.strategies.personal import PersonalStrategy


class FedRepStrategy(PersonalStrategy):
    reply_arrays = {"arrays": "subset"}  # the body: a subset of the model's keys
    checkpoint_attrs = ("holding",)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.holding: set[int] = set()  # partitions that have filed their personal layers
        self._holder: dict[int, int] = {}  # partition -> the node that filed them (this run)

    def subset_keys(self, key: str, reference: ArrayRecord) -> set[str] | None:
        return {k for k in reference if not is_head(k)}  # the whole body, never the head

    def holds(self, node: int) -> bool:
        """Whether ``node`` holds its partition's own layers: it filed them, and no other node
        serves that partition now."""
        pid = self.partition_of.get(node)
        return pid in self.holding and self._holder.get(pid, node) == node

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        key = self.arrayrecord_key
        if not self.holds(node) or key not in content.array_records:
            return content
        arrays = content.array_records[key]
        shared = self.subset_keys(key, arrays) or set(arrays)
        return with_record(content, key, ArrayRecord({k: v for k, v in arrays.items() if k in shared}))

    def _check_and_log_replies(self, replies: Iterable[Message], is_train: bool,
                               validate: bool = True) -> tuple[list[Message], list[Message]]:
        replies = list(replies)
        destinations = self._destinations()
        for reply in replies:
            node, pid = self._sender(reply, destinations)
            if reply.has_error():
                self.holding.discard(pid)
            elif is_train:  # the client filed its personal layers before it replied
                self.holding.add(pid)
                self._holder[pid] = node
        valid, rejected = super()._check_and_log_replies(replies, is_train, validate)
        for reply in rejected:  # e.g. NaN layers, which the client does not keep (keep_model): the
            self.holding.discard(self._sender(reply, destinations)[1])  # whole model goes again
        return valid, rejected

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        body, metrics = super().aggregate_train(server_round, replies)
        if body is None or self._reference is None:
            return body, metrics
        merged = dict(self._reference.items())
        merged.update(body.items())
        return ArrayRecord(merged), metrics
