"""Fed-POE (Ghari & Shen, NeurIPS 2024), client half, on Fed-ADE's unlabelled streams.

One of the Fed-ADE paper's baselines (71.3 % against Fed-ADE's 73.8 % on CIFAR-10, label shift
``lin``). Each client holds a *local* model (its own, never uploaded) beside the *federated* one
the server averages, and the frozen pre-trained model, and predicts with two levels of Hedge
mixtures, as the official code (pouyamghari/Fed-POE) does:

    p_f = (a·p_local + b·p_fed) / (a + b),   p = (c·p_f + d·p_pool) / (c + d),

each weight multiplied by exp(−η_c·U) of its own prediction's loss U, η_c = 1/√T (T time steps;
the code's ``eta_c``). The code's pool holds the pre-trained model and a snapshot every 20 of its
~500 steps (the first after step 19, never drawn on a 20-step stream), so p_pool is the
pre-trained model's prediction here. Both adapting models take Fed-ADE's steps on the step's batch
(:meth:`FedADEClient.adapt`) at the fixed rate ``fedade-fixed-lr``. Where the port departs from the
code, by our choice (Fed-POE was written for labelled streams, and the Fed-ADE authors did not
publish how they ran it without labels):

- U is the run's unsupervised risk (``fedade-risk``: mean prediction entropy, as Fed-ADE's code,
  or BBSE), for the weights as for training (the code: cross-entropy with the label);
- a client moves its weights once per time step, at its first training round of the step, with
  the models as they meet the step's batch (prequential, as the code's one update per sample); a
  client not sampled in a step neither adapts its local model nor moves its weights (the code:
  every client at every step);
- training: Fed-ADE's 2 × ``fedade-steps`` full-batch steps on the 50-sample batch, on every layer
  (the code: one SGD step on the last layer at 0.01/√T, on a window of the last 10 samples);
- the federated model is the whole model averaged over the round's clients (the paper and the
  code's regression script; its classification script steps one global model client after
  client); a local model starts as the pre-trained one, which the server sends to a client until
  it has filed its own.

Scored as Fed-ADE (online accuracy of the mixture after the step's rounds, predict-then-update on
the next step's batch). The local and pre-trained models and the log-weights live in
``context.state``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.fedade import FedADEClient, correct
from flowerbed.datasets.streams import num_steps
from flowerbed.training import to_record

LOCAL, HEDGE = "fedpoe.local", "fedpoe.hedge"
PRETRAINED = "fedpoe.pretrained"  # the pool's model; the server sends it until a client holds it


def hedge_step(log_w: np.ndarray, losses: np.ndarray, eta: float) -> np.ndarray:
    """Hedge in log space: log w_j − η·loss_j, shifted so that the largest is 0. A non-finite
    loss (a diverged model) takes the model's weight to 0; if every loss is, nothing moves."""
    log_w = np.asarray(log_w, np.float64)
    out = log_w - eta * np.where(np.isfinite(losses), losses, np.inf)
    if not np.isfinite(out).any():
        out = log_w
    return out - out.max()


def finite(model: nn.Module) -> bool:
    """Whether every floating-point parameter and buffer of ``model`` is finite."""
    return all(bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point())


def without_diverged(log_w: np.ndarray, models: list[nn.Module]) -> np.ndarray:
    """``log_w`` with −inf for each model whose parameters are no longer finite (it diverged),
    before Hedge has seen its loss: its NaN outputs would otherwise make the loss of every mixture
    holding it NaN, and Hedge would drop that mixture, sound models and all, for good. Unchanged
    when every model diverged."""
    ok = np.array([finite(m) for m in models])
    return np.where(ok, log_w, -np.inf) if ok.any() else np.asarray(log_w)


def mixture(log_w: np.ndarray, logits: list[torch.Tensor]) -> torch.Tensor:
    """log Σ_j softmax(log_w)_j · softmax(logits_j): the mixture's log-probabilities (which are
    its own logits: a mixture can be mixed again). A model of weight 0 (log-weight −inf: Hedge
    dropped it) is left out, so that its outputs, NaN if it diverged, do not reach the mixture."""
    keep = [j for j, w in enumerate(log_w) if np.isfinite(w)] or list(range(len(logits)))
    lw = torch.log_softmax(torch.as_tensor(np.asarray(log_w)[keep], dtype=logits[0].dtype,
                                           device=logits[0].device), 0)
    return torch.logsumexp(torch.stack([w + torch.log_softmax(logits[j], 1) for w, j in zip(lw, keep,
                                                                                          strict=True)]), 0)


class Mixture(nn.Module):
    """Models mixed by Hedge weights, as a model (its output: log-probabilities), so that the
    unsupervised risk of a mixture is computed as a model's."""

    def __init__(self, models: list[nn.Module], log_w: np.ndarray) -> None:
        super().__init__()
        self.parts, self.log_w = models, log_w  # (a plain list: nothing to train or save)

    def train(self, mode: bool = True) -> Mixture:
        """Train or eval mode for the mixed models too (their BatchNorm and dropout)."""
        super().train(mode)
        for m in self.parts:
            m.train(mode)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixture(self.log_w, [m(x) for m in self.parts])


class FedPOEClient(FedADEClient):
    def data_line(self) -> str:
        return super().data_line() + "; local, federated and pre-trained models, mixed by Hedge"

    def model_for(self, msg: Message) -> nn.Module:
        """The federated model: every layer is averaged (no personal layers)."""
        return self.model_with(msg.content["arrays"])

    def pretrained_for(self, msg: Message) -> ArrayRecord:
        """The pre-trained model: this client's copy, or the one the server sends until it has one."""
        own = self.context.state.array_records.get(PRETRAINED)
        if own is None and PRETRAINED not in msg.content.array_records:
            raise RuntimeError(f"partition {self.partition_id}: this client holds no local model of "
                               "its own (its context.state was lost?) and the message has no pre-trained "
                               "one; the server sends it next time")
        return own if own is not None else msg.content[PRETRAINED]

    def black_box_record(self, msg: Message) -> ArrayRecord:
        """BBSE's fixed classifier: the pre-trained model, which this client keeps anyway."""
        return self.pretrained_for(msg)

    def models(self, msg: Message) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(local, federated, pre-trained); a local model starts as the pre-trained one."""
        pre = self.pretrained_for(msg)
        own = self.context.state.array_records.get(LOCAL)
        return (self.model_with(own if own is not None else pre), self.model_for(msg),
                self.model_with(pre).eval())

    def log_weights(self) -> tuple[np.ndarray, int]:
        """(log a, log b, log c, log d) and the time step they last moved at (−1: never)."""
        rec = self.context.state.array_records.get(HEDGE)
        if rec is None:
            return np.zeros(4), -1
        return rec["log_w"].numpy().copy(), int(rec["t"].numpy()[0])

    @staticmethod
    def ensemble(local: nn.Module, fed: nn.Module, pre: nn.Module, log_w: np.ndarray) -> Mixture:
        return Mixture([Mixture([local, fed], log_w[:2]), pre], log_w[2:])

    def train(self, msg: Message) -> Message:
        cfg = self.cfg
        local, fed, pre = self.models(msg)
        x, y, t = self.batch(msg)
        log_w, moved = self.log_weights()
        log_w[:2] = without_diverged(log_w[:2], [local, fed])
        metrics = {}
        if t == 0 and int(msg.content["config"]["fedade-round-in-step"]) == 0:
            metrics = {"pre-correct": correct(self.ensemble(local, fed, pre, log_w).eval(), x, y),
                       "pre-n": len(y)}
        risk = self.risk_on(x, msg)
        if moved < t:  # the step's Hedge update, with the models as they meet its batch
            first = Mixture([local, fed], log_w[:2])
            with torch.no_grad():
                u = [float(risk(m.eval())) for m in (local, fed, first, pre)]
            eta = 1 / math.sqrt(num_steps(cfg))
            log_w = np.concatenate([hedge_step(log_w[:2], np.array(u[:2]), eta),
                                    hedge_step(log_w[2:], np.array(u[2:]), eta)])
            moved = t
        lr = cfg.fedade_fixed_lr
        loss = self.adapt(fed, risk, lr)
        self.adapt(local, risk, lr)
        self.context.state[LOCAL] = to_record(local)
        if PRETRAINED not in self.context.state.array_records:
            self.context.state[PRETRAINED] = self.pretrained_for(msg)
        self.context.state[HEDGE] = ArrayRecord({"log_w": Array(log_w),
                                                 "t": Array(np.array([moved], np.int64))})
        w = np.exp(log_w)  # (each pair's largest is 1)
        metrics.update({"num-examples": len(y), "lr": lr, "time-step": t,
                        "fed-weight": float(w[1] / w[:2].sum()), "pool-weight": float(w[3] / w[2:].sum())})
        if np.isfinite(loss):  # (none at learning rate 0: no step was taken)
            metrics["risk"] = loss
        return self.reply(msg, metrics, arrays=to_record(fed))

    def evaluate(self, msg: Message) -> Message:
        """Online accuracy of the mixture on this step's batch, and (``next-correct``) on the
        next step's, before adapting to it; Fed-ADE's :meth:`FedADEClient.evaluate` otherwise."""
        local, fed, pre = self.models(msg)
        log_w = self.log_weights()[0]
        log_w[:2] = without_diverged(log_w[:2], [local, fed])
        ensemble = self.ensemble(local, fed, pre, log_w).eval()
        x, y, t = self.batch(msg)
        with torch.no_grad():
            logp = ensemble(x)
        metrics = {"num-examples": len(y), "accuracy": float((logp.argmax(1) == y).float().mean()),
                   "loss": float(F.nll_loss(logp, y)), "time-step": t}
        if t + 1 < num_steps(self.cfg):
            xn, yn = self.step_batch(t + 1)
            metrics.update({"next-correct": correct(ensemble, xn, yn), "next-n": len(yn)})
        return self.reply(msg, metrics)
