"""FedSoft client: its own local model w in ``context.state``, pulled towards every centre.

Every ``fedsoft-tau`` rounds (counted from round 1, and whenever it has no estimate for the
current interval: a client not sampled at the interval's start, or one whose state was lost) the
client re-estimates its importance weights: u_s = the share of its training samples on which
centre s has the lowest cross-entropy, ``fedsoft-sigma`` for a centre no sample prefers (the
official code's count smoother). It then trains w on cross-entropy + Σ_s (λ/2) u_s ||w − c_s||²
(λ = ``fedsoft-lambda``, parameters only), which has the gradient of (λU/2)||w − c̄||² with
U = Σ_s u_s and c̄ = Σ_s u_s c_s / U: one proximal term towards c̄ (the reported training loss
lacks the constant between the two). w starts from one more seeded initialisation, shared by all
clients and distinct from the centres' (the official code: one fresh model shared by all
clients, apart from the centres), and is scored on the local test split, as Local's is.

Departures from the official code (ycruan/FedSoft): the run's optimiser (SGD at ``lr``, fresh
each round, as every method here) instead of Adam kept across rounds; the server aggregates all
sampled clients weighted by u_is·n_i (see :mod:`flowerbed.strategies.fedsoft`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import Message, MetricRecord
from torch import nn

from flowerbed.clients.fedavg import proximal
from flowerbed.clients.fedfew import MultiModelClient
from flowerbed.clients.local import LocalClient
from flowerbed.training import predict, to_record

IMPORTANCE = "fedsoft.importance"


def importance(centres: list[nn.Module], data, device: torch.device, sigma: float) -> list[float]:
    """u_s: the share of ``data``'s samples whose lowest cross-entropy is centre s's (``sigma``
    where no sample's is)."""
    losses = torch.stack([F.cross_entropy(predict(c, data, device, probabilities=False), data.y,
                                          reduction="none") for c in centres])  # [S, n]
    # a NaN loss (a diverged centre) is no sample's lowest (argmin takes NaN for the minimum)
    counts = torch.bincount(losses.nan_to_num(nan=torch.inf).argmin(0), minlength=len(centres)).tolist()
    return [c / len(data) if c else sigma for c in counts]


def pull(centres: list[nn.Module], u: list[float], lam: float):
    """The loss hook Σ_s (λ/2) u_s ||w − c_s||², as (λU/2)||w − c̄||² (the same gradient; it
    overwrites ``centres[0]`` with c̄, the u-weighted mean of the centres' parameters)."""
    anchor, total = centres[0], sum(u)
    with torch.no_grad():
        for p, *ps in zip(anchor.parameters(), *(c.parameters() for c in centres), strict=True):
            p.copy_(sum(w * q for w, q in zip(u, ps, strict=True)) / total)
    return proximal(anchor, lam * total)


class FedSoftClient(LocalClient, MultiModelClient):
    state_key = "fedsoft.model"

    def init_seed(self) -> int:
        """One more fresh initialisation after the S centres' (seed·100 + s): the official code
        makes S + 1 models, the centres and one every client starts from."""
        return self.cfg.seed * 100 + self.cfg.num_models

    def weights(self, centres: list[nn.Module], rnd: int) -> list[float]:
        """This interval's importance weights: estimated once per ``fedsoft-tau`` rounds, kept."""
        interval = (rnd - 1) // self.cfg.fedsoft_tau
        kept = self.context.state.metric_records.get(IMPORTANCE)
        if kept is not None and kept["interval"] == interval:
            return list(kept["u"])
        u = importance(centres, self.train_data, self.device, self.cfg.fedsoft_sigma)
        self.context.state[IMPORTANCE] = MetricRecord({"u": u, "interval": interval})
        return u

    def train(self, msg: Message) -> Message:
        rnd = self.round_of(msg)
        centres = self.models_from(msg)
        u = self.weights(centres, rnd)
        model = self.own_model()
        loss, _ = self.fit(model, msg, rnd, loss_hook=pull(centres, u, self.cfg.fedsoft_lambda))
        self.keep_model(self.state_key, to_record(model))
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss,
                                "importance": u}, arrays=to_record(model))
