"""FedAMP (Huang et al., AAAI 2021), server half: attentive message passing.

The server keeps every client's latest personal model w_j (its training uploads, by partition,
checkpointed) and sends client i its own cloud model

    u_i = ξ_ii w_i + Σ_{j≠i} ξ_ij w_j,   ξ_ij = α_k A'(||w_i − w_j||²) = α_k e^{−||w_i − w_j||²/σ} / σ,
    ξ_ii = 1 − Σ_{j≠i} ξ_ij,

A(x) = 1 − e^{−x/σ} being the paper's attention function (``fedamp-alpha`` = α_k, constant
over rounds; ``fedamp-sigma`` = σ). Every client whose model the server holds enters, as in the
paper's cross-silo setting (PFLlib takes only the last round's participants). Distances are
over the parameters, not the buffers (BatchNorm's running statistics), as in PFLlib; u_i
mixes buffers with the same weights (in float32, the models' precision; integer buffers
rounded). As A' ≤ 1/σ, ξ_ii ≥ 0 for any models where
α_k (M − 1) ≤ σ (M clients); a run that breaks this bound stops before round 1 (PFLlib lets
ξ_ii go negative). A client the server holds no model of yet (round 1, a late
joiner) is sent the round's model: the initial model, then the mean of the last round's uploads.

The client (``clients/fedamp.py``) computes w_i = argmin F_i(w) + (λ/2α_k)·||w − u_i||² by
``local-epochs`` of SGD from u_i (``proximal-mu`` = λ/α_k in its config; ``fedamp-lambda`` = λ)
and uploads w_i. A client is scored with its personal model w_i, which the evaluation message
carries (the round's model for one the server holds none of). The server's round model is the
sample-weighted mean of the uploads: only a starting point for clients without a w_i, not a
trained global model (no ``model.pt``).

Per round, ``fedamp-self-weight`` is the sampled clients' mean ξ_ii, and ``fedamp-distance``
the median squared distance between the held models (a scale for σ).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from flowerbed.config import ConfigError
from flowerbed.strategies.base import cast_like, with_record
from flowerbed.strategies.personal import PersonalStrategy


def squared_distances(flat: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """||w_i − w_j||² [M, M] of M flattened models [M, P]: a float64 Gram matrix summed over
    column chunks (float64 keeps the digits of near-equal models; the chunks keep copies small)."""
    m = len(flat)
    gram = np.zeros((m, m))
    for c in range(0, flat.shape[1], chunk):
        part = flat[:, c:c + chunk].astype(np.float64)
        gram += part @ part.T
    sq = np.diag(gram)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)
    np.fill_diagonal(dist, 0.0)
    return dist


def attention(dist: np.ndarray, alpha_k: float, sigma: float) -> np.ndarray:
    """ξ [M, M] from the squared distances; each row sums to 1, ξ_ii ≥ 0 where α_k (M − 1) ≤ σ."""
    xi = alpha_k * np.exp(-dist / sigma) / sigma
    np.fill_diagonal(xi, 0.0)
    xi[np.diag_indices(len(xi))] = 1.0 - xi.sum(1)
    return xi


class FedAMPStrategy(PersonalStrategy):
    checkpoint_attrs = ("personal",)
    server_model = False  # the mean of personal models: a start for newcomers only

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.personal: dict[str, ArrayRecord] = {}  # partition id (str) -> its w_i
        self._rows: dict[int, int] = {}  # partition -> its row in this round's ξ and stack
        self._xi = np.zeros((0, 0))
        self._keys: list[str] = []  # the stack's layout: parameters first
        self._stack = np.zeros((0, 0), np.float32)  # the held models, flattened [M, P]
        self._stats: dict[str, float] = {}
        self._serving = "cloud"  # what content_for puts in a message: u_i (train) or w_i (evaluate)

    def check_setup(self, num_partitions: int) -> None:
        a, s = self.cfg.fedamp_alpha, self.cfg.fedamp_sigma
        if a * (num_partitions - 1) > s:
            raise ConfigError("fedamp-alpha", a, f"with fedamp-sigma = {s:g} and {num_partitions} "
                              f"clients it must be <= {s / max(num_partitions - 1, 1):.4g}: a client's "
                              "own weight 1 - alpha_k sum_j exp(-d_ij/sigma)/sigma can go negative")

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        config["proximal-mu"] = self.cfg.fedamp_lambda / self.cfg.fedamp_alpha
        return super().train_content(server_round, arrays, config)

    def configure_train(self, server_round, arrays, config, grid):
        self._serving = "cloud"
        held = sorted(int(p) for p in self.personal)
        self._rows = {pid: row for row, pid in enumerate(held)}
        self._stats = {}
        if held:
            params = set(self.parameter_names(arrays))
            self._keys = sorted(arrays, key=lambda k: (k not in params, k))  # parameters first
            sizes = [int(np.prod(arrays[k].shape)) for k in self._keys]
            n_params = sum(n for k, n in zip(self._keys, sizes, strict=True) if k in params)
            self._stack = np.empty((len(held), sum(sizes)), np.float32)
            for row, p in enumerate(held):
                self._stack[row] = np.concatenate([self.personal[str(p)][k].numpy().ravel()
                                                   for k in self._keys])
            dist = squared_distances(self._stack[:, :n_params])
            self._xi = attention(dist, self.cfg.fedamp_alpha, self.cfg.fedamp_sigma)
            upper = dist[np.triu_indices(len(held), 1)]
            self._stats = {"fedamp-distance": float(np.median(upper)) if upper.size else 0.0}
        msgs = super().configure_train(server_round, arrays, config, grid)  # u_i made per message
        self._stack = np.zeros((0, 0), np.float32)  # (M copies of the model: not kept between rounds)
        return msgs

    def cloud_model(self, pid: int, like: ArrayRecord) -> ArrayRecord | None:
        """u_i of a partition the server holds a model of (None for the others)."""
        row = self._rows.get(pid)
        if row is None:
            return None
        flat = self._xi[row].astype(np.float32) @ self._stack
        out, at = {}, 0
        for k in self._keys:
            size = int(np.prod(like[k].shape))
            out[k] = Array(flat[at:at + size].reshape(like[k].shape))
            at += size
        return cast_like(ArrayRecord({k: out[k] for k in like}), like)  # the model's key order

    def configure_evaluate(self, server_round, arrays, config, grid):
        self._serving = "personal"
        return super().configure_evaluate(server_round, arrays, config, grid)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        pid = self.partition_of.get(node)
        key = self.arrayrecord_key
        own = (self.cloud_model(pid, content.array_records[key]) if self._serving == "cloud"
               else self.personal.get(str(pid)))
        return content if own is None else with_record(content, key, own)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, mean, _ = taken
        for pid, r in zip(self.round.ok, valid, strict=True):  # both in partition order
            self.personal[str(pid)] = r.content["arrays"]
        own = [self._xi[self._rows[p], self._rows[p]] for p in self.round.sampled if p in self._rows]
        extra = {**self._stats, **({"fedamp-self-weight": float(np.mean(own))} if own else {})}
        return cast_like(ArrayRecord(mean), self._reference), self.client_metrics(valid, extra)
