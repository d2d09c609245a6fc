"""FedMR (Hu et al., KDD 2024: "Is aggregation the only choice? Federated learning via layer-wise
model recombination"), server half; one of the FedCC paper's parameter-based baselines.

The server keeps a pool of m local models (m = the clients sampled in a round; all of them start
as the initial model) instead of one global model. Each round, the sampled clients train one
pool model each (plain local training: FedAvg's client), assigned by a seeded shuffle, and
their trained models replace those slots. Then, as the official code (``Training_FedMR.py``)
does:

- the global model is the **unweighted** mean of the m pool models (what is evaluated and saved);
- after round ``fedmr-first-stage`` (default 0, the official code's: recombine from the first
  round on), the pool is **recombined**: for every tensor of the state dict (a layer's weight and
  its bias are shuffled apart, as in the official code; BatchNorm's buffers likewise), a seeded
  random permutation of the m models gives each slot that tensor from another model;
- in the first stage (rounds ≤ ``fedmr-first-stage``), every slot becomes the global model
  instead: uniform FedAvg, the paper's two-stage scheme.

A slot whose client failed keeps its model (untrained this round) and is recombined with the
rest. A round that samples more clients than the pool holds (a node joined) adds slots holding
the global model; the pool never shrinks. The pool is the server's state (checkpointed).
Per round, ``fedmr-recombined`` is 1 when the pool was recombined, 0 in the first stage.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from flowerbed.strategies.base import FlowerbedFedAvg, cast_like, with_record


def uniform_mean(models: list[ArrayRecord]) -> dict[str, np.ndarray]:
    """The unweighted mean of the models, tensor by tensor (float64 sums)."""
    # (np.asarray: the mean of 0-d arrays, BatchNorm's num_batches_tracked, is a numpy scalar)
    return {k: np.asarray(np.mean([m[k].numpy().astype(np.float64) for m in models], axis=0))
            for k in models[0]}


def recombine(models: list[ArrayRecord], rng: np.random.Generator) -> list[ArrayRecord]:
    """Slot i takes each tensor k from model perm_k[i], one permutation per tensor."""
    out: list[dict[str, Array]] = [{} for _ in models]
    for k in models[0]:
        for i, j in enumerate(rng.permutation(len(models))):
            out[i][k] = models[j][k]
    return [ArrayRecord(o) for o in out]


class FedMRStrategy(FlowerbedFedAvg):
    checkpoint_attrs = ("pool",)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.pool: list[ArrayRecord] = []
        self._slot: dict[int, int] = {}  # node -> its pool slot, from training's messages to its replies

    def train_content(self, server_round, arrays, config) -> RecordDict:
        sampled = [self.node_of[p] for p in self.round.sampled]
        while len(self.pool) < len(sampled):  # round 1, or more clients than ever before
            self.pool.append(arrays)
        order = np.random.default_rng([self.cfg.seed, server_round, 2]).permutation(len(self.pool))
        self._slot = {n: int(s) for n, s in zip(sampled, order, strict=False)}
        return super().train_content(server_round, arrays, config)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        slot = self._slot.get(node)
        if slot is None or self.arrayrecord_key not in content.array_records:
            return content
        return with_record(content, self.arrayrecord_key, self.pool[slot])

    def configure_evaluate(self, server_round, arrays, config, grid):
        self._slot = {}  # evaluation messages carry the global model
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        destinations = self._destinations()
        for r in valid:
            node, _ = self._sender(r, destinations)
            self.pool[self._slot[node]] = r.content["arrays"]
        mean = cast_like(ArrayRecord({k: Array(v) for k, v in uniform_mean(self.pool).items()}),
                         self._reference)
        recombined = server_round > self.cfg.fedmr_first_stage
        if recombined:
            self.pool = recombine(self.pool, np.random.default_rng([self.cfg.seed, server_round, 3]))
        else:
            self.pool = [mean] * len(self.pool)
        return mean, self.client_metrics(valid, {"fedmr-recombined": int(recombined)})
