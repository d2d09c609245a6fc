"""FedFew (Guo et al., CVPR 2026), server half: K server models, smooth Tchebycheff weights.

Every round all K models travel to each sampled client as named ArrayRecords ``model.0`` ...
``model.K-1``; the client trains each for ``local-epochs`` and returns the K updated models and
their K training losses. With L̃_ik = n̄_i L_ik (n̄_i = n_i / Σ_j n_j over the participants),

    w_ik = softmax_k(−L̃_ik / μ),   α_i = S_i⁻¹ / Σ_j S_j⁻¹,  S_i = Σ_k exp(−L̃_ik / μ),
    θ_k ← θ_k + η_s Σ_i α_i w_ik (θ_ik − θ_k),

all in log space (torch's logsumexp, in float64). The server step η_s (``fedfew-server-lr``) is 1 in the
paper and the official code; as Σ_k Σ_i α_i w_ik = 1, each model then moves about 1/K of a FedAvg
step per round, and η_s = K restores FedAvg's step on average (an opt-in, not the paper's), but
extrapolates when one model takes most of the weight. ``fedfew-step='normalised'`` (opt-in, not
the paper's) divides model k's weights by m_k = Σ_i α_i w_ik instead, so that with η_s = 1 each
model becomes the α_i w_ik-weighted average of its clients' models (a convex combination).
With K = 1 and η_s = 1 this is FedAvg's update up to the α weights (α_i ∝ exp(L̃_i / μ)); see
the tests. η_s steps the parameters only: buffers (BatchNorm's running statistics) move by
η_s = 1, a convex combination, where a larger step could turn a running variance negative.
Between rounds the K models are carried packed in one ArrayRecord (keys
``<k>.<param>``), which is what Flower's Strategy.start carries.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from flowerbed.strategies.base import metric_record
from flowerbed.strategies.personal import KModelStrategy, pack


def fedfew_weights(losses: np.ndarray, n: np.ndarray, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """(w [M, K], α [M]) from the clients' losses [M, K] and sample counts [M]."""
    scaled = (n / n.sum())[:, None] * np.asarray(losses, np.float64)
    logits = -scaled / mu
    log_s = torch.logsumexp(torch.from_numpy(logits), dim=1).numpy()  # [M]
    w = np.exp(logits - log_s[:, None])
    # (torch's, not scipy's: scipy.special added a quarter second to every ClientApp process,
    # which imports the registry and so this module)
    alpha = np.exp(-log_s - torch.logsumexp(torch.from_numpy(-log_s), dim=0).item())
    return w, alpha


class FedFewStrategy(KModelStrategy):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.reply_arrays = {f"model.{k}": "exact" for k in range(self.k)}

    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        return pack(self.initial_models(model, distinct=self.cfg.fedfew_distinct_init))

    def check_arrays(self, content: RecordDict) -> str | None:
        mr = metric_record(content)
        losses = mr.get("losses")
        if not isinstance(losses, list) or len(losses) != self.k:
            return f"metric 'losses' must be a list of {self.k} values, got {losses!r}"
        if "personal-accuracy" in mr:  # fedfew-eval = local: scored on the local test split
            n = mr.get("eval-examples")
            if not isinstance(n, int | float) or n <= 0 or "personal-loss" not in mr:
                return (f"metric 'personal-accuracy' needs a positive 'eval-examples' (got {n!r}) "
                        "and 'personal-loss'")
        return super().check_arrays(content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        mrs = [metric_record(r.content) for r in valid]
        losses = np.array([m["losses"] for m in mrs], dtype=np.float64)
        n = self.sample_counts(valid)
        w, alpha = fedfew_weights(losses, n, self.cfg.fedfew_mu)
        coef = alpha[:, None] * w                           # [M, K]: the paper's delta weights
        mass = coef.sum(0)                                  # [K]: Σ_i α_i w_ik, sums to 1
        if self.cfg.fedfew_step == "normalised":
            coef = coef / np.maximum(mass, np.finfo(float).tiny)
        params = set(self.parameter_names(self._models[0]))
        new = []
        for k, ref in enumerate(self._models):
            upd = {}
            for name in ref:
                base = ref[name].numpy()
                delta = sum(coef[i, k] * (r.content[f"model.{k}"][name].numpy() - base)
                            for i, r in enumerate(valid))
                eta = self.cfg.fedfew_server_lr if name in params else 1.0
                upd[name] = Array(np.asarray(base + eta * delta).astype(base.dtype))
            new.append(ArrayRecord(upd))
        metrics = MetricRecord({
            "train-loss": float((n * losses.min(1)).sum() / n.sum()),
            "assignment-entropy": float(-(w * np.log(np.maximum(w, 1e-12))).sum(1).mean()),
            **{f"model-{k}-weight": float(mass[k]) for k in range(self.k)},
        })
        self.round.train_metrics = dict(metrics)
        if self.cfg.fedfew_eval == "local":
            self._local_evaluation(valid, mrs)
        return pack(new), metrics

    def _local_evaluation(self, valid: list[Message], mrs: list[MetricRecord]) -> None:
        """The official code's timing: clients scored their locally trained copies (clients
        without a local test split report no score)."""
        scored = [(r, m) for r, m in zip(valid, mrs, strict=True) if "personal-accuracy" in m]
        if not scored:
            return
        valid, mrs = [r for r, _ in scored], [m for _, m in scored]
        n = np.array([m["eval-examples"] for m in mrs], dtype=np.float64)
        acc = np.array([m["personal-accuracy"] for m in mrs])
        loss = np.array([m["personal-loss"] for m in mrs])
        destinations = self._destinations()
        for r, a in zip(valid, acc, strict=True):
            pid = self._sender(r, destinations)[1]
            self.round.clients.setdefault(pid, {})["evaluate-accuracy"] = float(a)
        self.round.eval_metrics = {"accuracy": float((n * acc).sum() / n.sum()),
                                   "loss": float((n * loss).sum() / n.sum())}

    def clients_evaluate(self) -> bool:
        return self.cfg.fedfew_eval != "local"  # "local": evaluated inside the training round
