"""IFCA (Ghosh et al., 2020), server half: K cluster models, hard assignment by the clients.

Each client evaluates the K models on its training split, trains the one with the lowest loss
and returns it with its cluster index; each cluster model becomes the sample-weighted mean of
its members' models (a cluster nobody chose keeps its model). The K models start from distinct
seeded initialisations, which IFCA needs to break symmetry.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerbed.strategies.base import cast_like, metric_record
from flowerbed.strategies.personal import KModelStrategy, pack


class IFCAStrategy(KModelStrategy):
    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        return pack(self.initial_models(model, distinct=True))

    def check_arrays(self, content: RecordDict) -> str | None:
        cluster = metric_record(content).get("cluster")
        if not isinstance(cluster, int) or not 0 <= cluster < self.k:
            return f"metric 'cluster' must be an integer in [0, {self.k}), got {cluster!r}"
        return super().check_arrays(content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        new, sizes = [], []
        for k, old in enumerate(self._models):
            members = [r.content for r in valid
                       if metric_record(r.content)["cluster"] == k]
            sizes.append(len(members))
            new.append(cast_like(aggregate_arrayrecords(members, self.weighted_by_key), old)
                       if members else old)
        metrics = self.client_metrics(valid, {f"cluster-{k}-clients": n for k, n in enumerate(sizes)},
                                      drop=("cluster",))
        return pack(new), metrics
