"""FedMGDA+ (Hu et al., IEEE TNSE 2022), server half: a common descent direction of the clients'
objectives, found by the multiple-gradient descent algorithm (MGDA).

One of the FedFew paper's discussed baselines. Clients run FedAvg's local update; the server
normalises each client's update d_i = (θ − θ_i)/||θ − θ_i|| and finds the weights

    λ* = argmin_λ ||Σ_i λ_i d_i||²   subject to  Σ_i λ_i = 1,  λ_i ≥ 0,  |λ_i − λ0_i| ≤ ε,

λ0_i = n_i / Σ_j n_j (``fedmgda-epsilon`` = ε; ε = 0 keeps λ0, ε = 1 is plain MGDA, the
min-norm point of the hull), then steps θ ← θ − η Σ_i λ_i d_i (``fedmgda-lr`` = η). The step's
length is at most η whatever the clients' update sizes. The quadratic programme over M clients
is solved by scipy's SLSQP on the M×M Gram matrix of the normalised updates. BatchNorm buffers
take FedAvg's mean. Defaults ε = 0.1, η = 1 as in FLGo's implementation (we found none by the
paper's authors). A client that returns the model unchanged has d_i = 0, the min-norm point
itself: the programme moves up to ε of weight onto it and the step shrinks (with ε = 1 it stops).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from flowerbed.strategies.base import FlowerbedFedAvg, cast_like, update_gram

log = logging.getLogger("flowerbed")


def min_norm_weights(gram: np.ndarray, lambda0: np.ndarray, epsilon: float) -> np.ndarray:
    """argmin_λ λᵀ G λ over the simplex, within ``epsilon`` of ``lambda0`` in each coordinate."""
    from scipy.optimize import minimize  # here, not at import: every ClientApp imports this module

    lo, hi = np.maximum(lambda0 - epsilon, 0.0), np.minimum(lambda0 + epsilon, 1.0)
    if epsilon == 0 or len(lambda0) == 1:
        return lambda0
    simplex = {"type": "eq", "fun": lambda x: x.sum() - 1, "jac": lambda x: np.ones_like(x)}
    res = minimize(lambda x: x @ gram @ x, lambda0, jac=lambda x: 2 * gram @ x, method="SLSQP",
                   bounds=list(zip(lo, hi, strict=True)), constraints=[simplex],
                   options={"ftol": 1e-12, "maxiter": 500})
    if not res.success:
        log.warning("FedMGDA: the min-norm weights were not found (%s); this round uses the "
                    "clients' sample shares", res.message)
        return lambda0
    lam = np.clip(res.x, lo, hi)
    return lam / lam.sum()


class FedMGDAStrategy(FlowerbedFedAvg):
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, new, params = taken  # new: the mean, kept for the buffers
        n = self.sample_counts(valid)
        ref = {k: self._reference[k].numpy().astype(np.float64) for k in params}
        gram = update_gram(self._reference, [r.content["arrays"] for r in valid], params)
        norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
        # 1/||θ − θ_i||, and 0 for a client that did not move (its d_i is 0, not NaN)
        scale = np.where(norms > 0, 1 / np.maximum(norms, np.finfo(float).tiny), 0.0)
        unit = gram * np.outer(scale, scale)  # the Gram matrix of the d_i
        lambda0 = n / n.sum()
        lam = min_norm_weights(unit, lambda0, self.cfg.fedmgda_epsilon)
        coef = self.cfg.fedmgda_lr * lam * scale
        for k in params:
            step = sum(c * (ref[k] - r.content["arrays"][k].numpy())
                       for c, r in zip(coef, valid, strict=True))
            new[k] = Array(np.asarray(ref[k] - step))
        metrics = self.client_metrics(valid, {
            "mgda-direction-norm": float(np.sqrt(max(lam @ unit @ lam, 0.0))),  # ||Σ λ_i d_i||
            "mgda-weight-shift": float(np.abs(lam - lambda0).max())})
        return cast_like(ArrayRecord(new), self._reference), metrics
