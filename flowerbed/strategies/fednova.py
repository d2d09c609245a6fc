"""FedNova (Wang et al., NeurIPS 2020), server half: normalised averaging.

Clients that take different numbers of local steps pull FedAvg's mean towards the objectives of
those that take more (the objective inconsistency). FedNova divides each client's update by
its ||a_i||₁, the total weight its local optimiser put on its gradients (``nova-norm``, reported
by the client: τ_i steps of plain SGD, [τ_i − ρ(1 − ρ^τ_i)/(1 − ρ)]/(1 − ρ) with heavy-ball
momentum ρ), and rescales the mean of the normalised updates by τ_eff = Σ_i p_i ||a_i||₁:

    x ← x − τ_eff Σ_i p_i (x − y_i) / ||a_i||₁,      p_i = n_i / Σ_j n_j

(the paper's update with the server learning rate 1 and no server momentum). Clients with
equal ||a_i||₁ give FedAvg's mean exactly. The update covers the parameters; the buffers
(BatchNorm's running statistics) take FedAvg's mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from flowerbed.strategies.base import FlowerbedFedAvg, cast_like, metric_record

NORM = "nova-norm"


class FedNovaStrategy(FlowerbedFedAvg):
    def check_arrays(self, content: RecordDict) -> str | None:
        """``nova-norm`` between 1 (one step) and τ/(1 − ρ), τ the steps ``num-examples`` samples
        give in ``local-epochs`` (each step's weight is below 1/(1 − ρ)): a tiny norm would scale
        the client's update without bound. (``num-examples`` is checked before this.)"""
        mr = metric_record(content)
        norm, n = mr.get(NORM), mr[self.weighted_by_key]
        if not isinstance(norm, int | float):
            return f"metric '{NORM}' must be a number, got {norm!r}"
        most = self.cfg.local_epochs * math.ceil(n / self.cfg.batch_size) / (1 - self.cfg.momentum)
        if not 1 <= norm <= most * (1 + 1e-9):
            return (f"metric '{NORM}' must be in [1, {most:.6g}] (one step; local-epochs of {n:g} "
                    f"samples in batches of {self.cfg.batch_size}), got {norm!r}")
        return super().check_arrays(content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, new, params = taken  # new: the mean, kept for the buffers
        n = self.sample_counts(valid)
        p = n / n.sum()
        norms = np.array([metric_record(r.content)[NORM] for r in valid], np.float64)
        tau_eff = float(p @ norms)
        for k in params:
            x = self._reference[k].numpy().astype(np.float64)
            step = np.zeros_like(x)
            for pi, a, r in zip(p, norms, valid, strict=True):
                step += pi / a * (x - r.content["arrays"][k].numpy())
            new[k] = Array(np.asarray(x - tau_eff * step))
        metrics = self.client_metrics(valid, {"tau-eff": tau_eff}, drop=(NORM,))  # NORM's mean: τ_eff
        return cast_like(ArrayRecord(new), self._reference), metrics
