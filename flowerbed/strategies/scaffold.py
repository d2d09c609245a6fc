"""SCAFFOLD (Karimireddy et al., 2020), server half: global model and server control variate.

Each client keeps its control variate c_i in ``context.state`` and returns its model y_i and
Δc_i = c_i⁺ − c_i (option II). The server updates

    x ← x + η_g · Σ_i w_i (y_i − x)      (w_i ∝ n_i, as FedAvg; η_g = ``scaffold-server-lr``)
    c ← c + (1/N) Σ_{i∈S} Δc_i           (N = all clients, S = this round's participants)

η_g steps the parameters only: buffers (BatchNorm's running statistics and step counter) take
the weighted mean, as in FedAvg (an extrapolated running variance can turn negative).

c starts empty, meaning zero for every parameter; it gains a key the first time a client
reports one (control variates cover trainable parameters, not buffers).

c must stay the mean of the clients' c_i, so a client adopts its c_i⁺ only once the server has
taken its Δc_i (``strategies/synced.py``); a client whose last reply was refused (timeout,
failed validation, a skipped round) keeps its old c_i. A client that lost its c_i (its state
folder gone, or another node now serving its partition) restarts from zero while c keeps its
earlier Δc_i, so c no longer is that mean; the client warns when it sees this.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from flowerbed.strategies.base import cast_like
from flowerbed.strategies.synced import ACCEPTED, SyncedStateStrategy
from flowerbed.training import is_finite

SERVER_CV = "server_cv"
CV_DELTA = "cv_delta"
__all__ = ["ACCEPTED", "CV_DELTA", "SERVER_CV", "ScaffoldStrategy"]


class ScaffoldStrategy(SyncedStateStrategy):
    reply_arrays = {"arrays": "exact", CV_DELTA: "subset"}  # c_i covers parameters only
    checkpoint_attrs = ("c", "accepted")  # the server control variate; whose Δc_i it holds

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.c: dict[str, np.ndarray] = {}

    def subset_keys(self, key: str, reference: ArrayRecord) -> set[str] | None:
        if key != CV_DELTA or self.model is None:
            return None
        return {k for k, _ in self.model.named_parameters()}  # Δc_i: every parameter, no buffer

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        content = super().train_content(server_round, arrays, config)
        content[SERVER_CV] = ArrayRecord({k: Array(v) for k, v in self.c.items()})
        return content

    def aggregate_train(self, server_round: int, replies):
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, mean, params = taken
        eta, ref = self.cfg.scaffold_server_lr, self._reference
        if eta != 1.0:
            mean |= {k: Array(ref[k].numpy() + eta * (mean[k].numpy() - ref[k].numpy())) for k in params}
        avg = cast_like(ArrayRecord(mean), ref)
        if not is_finite(avg):  # refused by the round loop: c and the clients' c_i stay as they are
            return avg, self.client_metrics(valid)
        n_total = self.all_clients(len(valid))
        for r in valid:
            for k, arr in r.content[CV_DELTA].items():
                d = arr.numpy().astype(np.float32) / n_total
                self.c[k] = self.c[k] + d if k in self.c else d
        self.took(server_round, self.round.ok)
        return avg, self.client_metrics(valid)
