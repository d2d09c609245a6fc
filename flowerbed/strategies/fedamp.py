"""FedAMP (Huang et al., AAAI 2021), server half: attentive message passing.

The server keeps every client's latest personal model w_j (its training uploads, by partition,
checkpointed) and sends client i its own cloud model

    u_i = ξ_ii w_i + Σ_{j≠i} ξ_ij w_j,   ξ_ij = α_k A'(||w_i − w_j||²) = α_k e^{−||w_i − w_j||²/σ} / σ,
    ξ_ii = 1 − Σ_{j≠i} ξ_ij,

A(x) = 1 − e^{−x/σ} being the paper's attention function (``fedamp-alpha`` = α_k, constant
over rounds; ``fedamp-sigma`` = σ). Every client whose model the server holds enters, as in the
paper's cross-silo setting (PFLlib takes only the last round's participants). Distances are
over the parameters, not the buffers (BatchNorm's running statistics), as in PFLlib; u_i
mixes buffers with the same weights. As A' ≤ 1/σ, ξ_ii ≥ 0 for any models where
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
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerbed.config import ConfigError
from flowerbed.strategies.base import cast_like, metric_record, with_record
from flowerbed.strategies.personal import PersonalStrategy


def squared_distances(flat: np.ndarray) -> np.ndarray:
    """||w_i − w_j||² [M, M] of M flattened models [M, P] (by differences, not a Gram matrix:
    near-equal models lose no digits)."""
    m = len(flat)
    dist = np.zeros((m, m))
    for i in range(m):
        for j in range(i + 1, m):
            dist[i, j] = dist[j, i] = float(np.sum((flat[i] - flat[j]) ** 2))
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
        self.personal: dict[str, dict[str, np.ndarray]] = {}  # partition id (str) -> w_i
        self._cloud: dict[int, ArrayRecord] = {}  # this round's u_i, by partition
        self._xi: dict[int, float] = {}  # partition -> its ξ_ii this round
        self._stats: dict[str, float] = {}
        self._serving = "cloud"  # what content_for puts in a message: u_i (train) or w_i (evaluate)

    def check_setup(self, num_partitions: int) -> None:
        a, s = self.cfg.fedamp_alpha, self.cfg.fedamp_sigma
        if a * (num_partitions - 1) > s:
            raise ConfigError("fedamp-alpha", a, f"with fedamp-sigma = {s:g} and {num_partitions} "
                              f"clients it must be <= {s / max(num_partitions - 1, 1):.4g}: a client's "
                              "own weight 1 - alpha_k sum_j exp(-d_ij/sigma)/sigma can go negative")

    def _held(self, pid: int) -> ArrayRecord | None:
        w = self.personal.get(str(pid))
        return ArrayRecord({k: Array(v) for k, v in w.items()}) if w is not None else None

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        config["proximal-mu"] = self.cfg.fedamp_lambda / self.cfg.fedamp_alpha
        return super().train_content(server_round, arrays, config)

    def configure_train(self, server_round, arrays, config, grid):
        self._serving = "cloud"
        self._cloud, self._xi, self._stats = {}, {}, {}
        held = sorted(int(p) for p in self.personal)
        if held:
            params = [k for k, _ in self.model.named_parameters()] if self.model is not None else None
            keys = params or sorted(self.personal[str(held[0])])
            flat = np.stack([np.concatenate([self.personal[str(p)][k].ravel().astype(np.float64)
                                             for k in keys]) for p in held])
            dist = squared_distances(flat)
            xi = attention(dist, self.cfg.fedamp_alpha, self.cfg.fedamp_sigma)
            models = [self.personal[str(p)] for p in held]
            for row, pid in enumerate(held):
                u = {k: sum(xi[row, j] * m[k].astype(np.float64) for j, m in enumerate(models))
                     for k in models[row]}
                self._cloud[pid] = cast_like(ArrayRecord({k: Array(np.asarray(v)) for k, v in u.items()}),
                                             arrays)
            self._xi = {pid: float(xi[row, row]) for row, pid in enumerate(held)}
            upper = dist[np.triu_indices(len(held), 1)]
            self._stats = {"fedamp-distance": float(np.median(upper)) if upper.size else 0.0}
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round, arrays, config, grid):
        self._serving = "personal"
        return super().configure_evaluate(server_round, arrays, config, grid)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        pid = self.partition_of.get(node)
        own = self._cloud.get(pid) if self._serving == "cloud" else self._held(pid)
        return content if own is None else with_record(content, self.arrayrecord_key, own)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        for pid, r in zip(self.round.ok, valid, strict=True):  # both in partition order
            self.personal[str(pid)] = {k: a.numpy() for k, a in r.content["arrays"].items()}
        mean = aggregate_arrayrecords([RecordDict({"arrays": r.content["arrays"],
                                                   "m": metric_record(r.content)}) for r in valid],
                                      self.weighted_by_key)
        metrics = self.train_metrics_aggr_fn([RecordDict({"m": metric_record(r.content)})
                                              for r in valid], self.weighted_by_key)
        sampled = [self._xi[p] for p in self.round.sampled if p in self._xi]
        extra = {**self._stats, **({"fedamp-self-weight": float(np.mean(sampled))} if sampled else {})}
        metrics = MetricRecord({**metrics, **extra})
        self.round.train_metrics = dict(metrics)
        return cast_like(mean, self._reference) if self._reference is not None else mean, metrics
