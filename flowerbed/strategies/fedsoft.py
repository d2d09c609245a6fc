"""FedSoft (Ruan & Joe-Wong, AAAI 2022), server half: S cluster centres, soft clustering.

The FedFew paper's discussed baseline. Every round the S centres travel to each sampled client
as ``model.0`` ... ``model.S-1`` (S = ``num-models``, distinct seeded initialisations, as in the
official code, where each centre is a fresh model). A client returns its own local model w_i
(kept in ``context.state``, trained with a proximal pull towards every centre) and its
importance weights u_is, the share of its training samples on which centre s has the lowest
cross-entropy (at least ``fedsoft-sigma``). Each centre becomes the average of the clients'
models weighted by u_is·n_i:

    c_s ← Σ_i u_is n_i w_i / Σ_j u_js n_j,

which is the official code's aggregation without client selection (its ``do_selection=False``
path), and the expectation of its selection path (S·K clients drawn ∝ u_is n_i, each centre the
plain mean of its K): every method here trains the same sampled clients each round, and FedSoft
aggregates the models of all of them. BatchNorm buffers are averaged the same way. A centre that
no sampled client's sample prefers (every u_is the floor σ) becomes the plain sample-weighted
mean of the round's models, as in the official code when no client at all prefers it; with
``fraction-train`` < 1 that can happen while clients left out of the round do prefer it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerbed.strategies.base import cast_like, metric_record
from flowerbed.strategies.personal import KModelStrategy, pack


class FedSoftStrategy(KModelStrategy):
    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        return pack(self.initial_models(model, distinct=True))

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        return RecordDict()  # each client scores its own local model: no centre needed

    def check_arrays(self, content: RecordDict) -> str | None:
        u = metric_record(content).get("importance")
        if (not isinstance(u, list) or len(u) != self.k
                or not all(math.isfinite(v) and 0 < v <= 1 for v in u)):
            return f"metric 'importance' must be a list of {self.k} values in (0, 1], got {u!r}"
        return super().check_arrays(content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        # u_is n_i [M, S]: client i's weight in centre s
        weight = (np.array([metric_record(r.content)["importance"] for r in valid])
                  * self.sample_counts(valid)[:, None])
        new = [cast_like(aggregate_arrayrecords(
            [RecordDict({"arrays": r.content["arrays"], "w": MetricRecord({"w": float(w)})})
             for r, w in zip(valid, weight[:, s], strict=True)], "w"), old)
            for s, old in enumerate(self._models)]
        mass = weight.sum(0) / weight.sum()
        metrics = self.client_metrics(valid, {f"model-{s}-importance": float(v) for s, v in enumerate(mass)},
                                      drop=("importance",))
        return pack(new), metrics
