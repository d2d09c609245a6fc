"""ATLAS (Bai et al., NeurIPS 2022), client half, on Fed-ADE's unlabelled streams.

One of the Fed-ADE paper's localised online label-shift baselines (36.5 % on CIFAR-10, label shift
``lin``; the slowest there, 1959 s against Fed-ADE's 109 s). Each client runs ATLAS on its own
stream, with no federation: N base learners, copies of the model, each adapting by online gradient
descent at its own step size from a geometric pool, and a Hedge meta-learner whose weights over them
follow their risks. As the official code (``online/models/atlas.py``, ``online/utils``):

- the pool (:meth:`Config.atlas_pool`): η_min, η_min·g, η_min·g², ... while ≤ η_max, and one more
  (the first above η_max), g = ``atlas-grid`` (2), η_min and η_max = ``fedade-lr-min`` and
  ``fedade-lr-max``: 8 bases, 1e-5 to 1.28e-3, at the defaults;
- Hedge over the bases, uniform prior, multiplicative weights exp(−ε_n·risk) with the self-tuning
  rate ε_n = min(1, ``atlas-meta-lr``/√n) at the client's n-th update (the code: scale 1/(G·D));
- the model used, ``atlas-combine``: ``weight`` (the code's default) averages the bases'
  parameters with the Hedge weights; ``output`` mixes their softmax outputs.

Where the port departs from the code, by our choice (the Fed-ADE authors published no baseline
code): each base takes Fed-ADE's steps (:meth:`FedADEClient.adapt`: 2 × ``fedade-steps``
full-batch steps on the step's 50-sample batch, dense layers then all) on the run's unsupervised
risk (``fedade-risk``: entropy, or BBSE, the paper's unbiased risk on a labelled reference set);
the code takes one pass of SGD over its offline labelled data, reweighted by the BBSE estimate. The
Hedge weights move once per time step, at the client's first training round of the step, by each
base's risk on the step's batch before it adapts (the code: the risks its bases met at the previous
step, the same order of information); a client not sampled in a step does neither.

Scored as Fed-ADE (online accuracy of the combined model after the step's rounds, predict-then-update
on the next step's batch). The bases and the Hedge weights live in ``context.state``; a base starts
as the pre-trained model, which the server keeps sending. Replies carry metrics only: nothing is
aggregated.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from torch import nn

from flowerbed.clients.fedade import FedADEClient, correct
from flowerbed.clients.fedpoe import Mixture, hedge_step, without_diverged
from flowerbed.training import to_record

BASE, HEDGE = "atlas.base.", "atlas.hedge"


def weight_average(models: list[nn.Module], log_w: np.ndarray, into: nn.Module) -> nn.Module:
    """``into`` loaded with the softmax(log_w)-weighted mean of the models' floating-point
    parameters and buffers (an integer buffer, such as BatchNorm's batch count, is the first kept one's).
    A model of weight 0 (log-weight −inf) is left out: 0 · NaN would spoil the mean."""
    p = torch.softmax(torch.as_tensor(log_w, dtype=torch.float64), 0)
    states = [(float(w), m.state_dict()) for w, m in zip(p, models, strict=True) if w > 0]
    first = states[0][1]
    into.load_state_dict({**first, **{k: sum(w * s[k].double() for w, s in states).to(v.dtype)
                                      for k, v in first.items() if v.is_floating_point()}})
    return into


class ATLASClient(FedADEClient):
    def data_line(self) -> str:
        return super().data_line() + f"; {len(self.cfg.atlas_pool())} base learners, mixed by Hedge"

    def fth_weights(self, model: nn.Module, msg: Message, t: int) -> None:
        return None  # (fedade-correction is Fed-ADE's: ATLAS does not read it)

    def bases(self, msg: Message) -> list[nn.Module]:
        """This client's base learners; each starts as the model the server sends (pre-trained)
        until the client holds its own."""
        state = self.context.state.array_records
        keys = [f"{BASE}{i}" for i in range(len(self.cfg.atlas_pool()))]
        if any(k not in state for k in keys) and "arrays" not in msg.content.array_records:
            raise RuntimeError(f"partition {self.partition_id}: this client holds no base learners of "
                               "its own (its context.state was lost?) and the message has no pre-trained "
                               "model; the server sends it next time")
        return [self.model_with(state[k] if k in state else msg.content["arrays"]) for k in keys]

    def hedge(self) -> tuple[np.ndarray, int, int]:
        """(log-weights, the time step they last moved at (−1: never), how many times they moved)."""
        rec = self.context.state.array_records.get(HEDGE)
        if rec is None:
            return np.zeros(len(self.cfg.atlas_pool())), -1, 0
        t, n = (int(v) for v in rec["t_n"].numpy())
        return rec["log_w"].numpy().copy(), t, n

    def combined(self, bases: list[nn.Module], log_w: np.ndarray) -> nn.Module:
        """The bases combined by their weights; a base whose parameters are no longer finite (it
        diverged at its step size) is left out before Hedge has seen its risk."""
        log_w = without_diverged(log_w, bases)
        if self.cfg.atlas_combine == "output":
            return Mixture(bases, log_w)
        return weight_average(bases, log_w, self.new_model().to(self.device))

    def model_for(self, msg: Message) -> nn.Module:
        """The model this client predicts with: its bases, combined by their Hedge weights."""
        return self.combined(self.bases(msg), self.hedge()[0])

    def train(self, msg: Message) -> Message:
        bases = self.bases(msg)
        x, y, t = self.batch(msg)
        log_w, moved, n = self.hedge()
        metrics = {}
        if t == 0 and int(msg.content["config"]["fedade-round-in-step"]) == 0:
            metrics = {"pre-correct": correct(self.combined(bases, log_w).eval(), x, y), "pre-n": len(y)}
        risk = self.risk_on(x, msg)
        if moved < t:  # the step's Hedge update, by the bases' risks as they meet its batch
            with torch.no_grad():
                risks = np.array([float(risk(b.eval())) for b in bases])
            n += 1
            log_w, moved = hedge_step(log_w, risks, min(1.0, self.cfg.atlas_meta_lr / math.sqrt(n))), t
        pool = self.cfg.atlas_pool()
        losses = np.array([self.adapt(b, risk, eta) for b, eta in zip(bases, pool, strict=True)])
        for i, b in enumerate(bases):
            self.context.state[f"{BASE}{i}"] = to_record(b)
        self.context.state[HEDGE] = ArrayRecord({"log_w": Array(log_w),
                                                 "t_n": Array(np.array([moved, n], np.int64))})
        p = np.exp(log_w) / np.exp(log_w).sum()
        ok = np.isfinite(losses) & (p > 0)  # a diverged base's NaN risk left out, the others reweighted
        risk = (float(p @ losses) if ok.all() else
                float(p[ok] @ losses[ok] / p[ok].sum()) if ok.any() else float("nan"))
        metrics.update({"num-examples": len(y), "lr": float(p @ pool), "top-weight": float(p.max()),
                        "time-step": t, "risk": risk})
        return self.reply(msg, metrics)  # metrics only: nothing is aggregated
