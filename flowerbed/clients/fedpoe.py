"""Fed-POE (Ghari & Shen, NeurIPS 2024), client half, on Fed-ADE's unlabelled streams.

One of the Fed-ADE paper's baselines (71.3 % against Fed-ADE's 73.8 % on CIFAR-10, label shift
``lin``). Each client holds a *local* model (its own, never uploaded) beside the *federated* one
the server averages, and predicts with their Hedge mixture

    p(x) = (a·p_local(x) + b·p_fed(x)) / (a + b),   a ← a·exp(−η_c·U_local),  b ← b·exp(−η_c·U_fed),

η_c = 1/√T (T time steps; the official code's ``eta_c``), U a model's loss on the step's batch.
Both models adapt to the step's batch with a fixed learning rate (``fedade-fixed-lr``), by the
same steps as Fed-ADE (:meth:`FedADEClient.adapt`). Fed-POE was written for labelled streams; the
Fed-ADE authors did not publish how they ran it without labels, so this port's choices, each a
substitution where the official code (pouyamghari/Fed-POE) reads a label, are ours:

- U is the run's unsupervised risk (``fedade-risk``: mean prediction entropy, as Fed-ADE's code,
  or BBSE), for the Hedge weights as for the training steps (the code: cross-entropy);
- a client updates its weights once per time step, at its first training round of the step, with
  the models as they meet the step's batch (prequential, as the code's one update per sample);
  a client not sampled in a step neither adapts its local model nor moves its weights;
- the federated model is the whole model averaged over the round's clients (FedAvg: the paper
  and the code's regression variant; its classification script steps one global model client
  after client), its local model starts as the pre-trained one (the server sends it to a client
  until it has filed its own);
- left out: the code's pool of stored model snapshots (one each 20 of its ~500 steps, 8 drawn a
  step, for non-convex losses): over the 20 steps of our benchmark it would hold one.

Scored as Fed-ADE (online accuracy of the mixture after the step's rounds, predict-then-update on
the next step's batch). The local model and the log-weights live in ``context.state``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.fedade import FedADEClient
from flowerbed.datasets.streams import num_steps
from flowerbed.training import to_record

LOCAL, HEDGE = "fedpoe.local", "fedpoe.hedge"
PRETRAINED = "fedpoe.pretrained"  # the server's record for a client without a local model yet


def hedge_step(log_w: np.ndarray, losses: np.ndarray, eta: float) -> np.ndarray:
    """Hedge in log space: log w_j − η·loss_j, shifted so that the largest is 0."""
    out = np.asarray(log_w, np.float64) - eta * np.asarray(losses, np.float64)
    return out - out.max()


def mixture(log_w: np.ndarray, logits: list[torch.Tensor]) -> torch.Tensor:
    """log Σ_j softmax(log_w)_j · softmax(logits_j): the mixture's log-probabilities."""
    lw = torch.log_softmax(torch.as_tensor(log_w, dtype=logits[0].dtype, device=logits[0].device), 0)
    return torch.logsumexp(torch.stack([w + torch.log_softmax(z, 1) for w, z in zip(lw, logits,
                                                                                  strict=True)]), 0)


class FedPOEClient(FedADEClient):
    def data_line(self) -> str:
        return super().data_line() + "; a local and the federated model, mixed by Hedge"

    def model_for(self, msg: Message) -> nn.Module:
        """The federated model: every layer is averaged (no personal layers)."""
        return self.model_with(msg.content["arrays"])

    def local_for(self, msg: Message) -> nn.Module:
        """This client's local model (the pre-trained one the server sends, before it has one)."""
        own = self.context.state.array_records.get(LOCAL)
        return self.model_with(own if own is not None else msg.content[PRETRAINED])

    def log_weights(self) -> tuple[np.ndarray, int]:
        """(log a, log b) and the time step they were last moved at (−1: never)."""
        rec = self.context.state.array_records.get(HEDGE)
        if rec is None:
            return np.zeros(2), -1
        return rec["log_w"].numpy().copy(), int(rec["t"].numpy()[0])

    def predict(self, models: list[nn.Module], x: torch.Tensor, log_w: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            return mixture(log_w, [m.eval()(x) for m in models])

    def train(self, msg: Message) -> Message:
        cfg = self.cfg
        fed, local = self.model_for(msg), self.local_for(msg)
        x, y, t = self.batch(msg)
        log_w, moved = self.log_weights()
        pre = {}
        if t == 0 and int(msg.content["config"]["fedade-round-in-step"]) == 0:
            pred = self.predict([local, fed], x, log_w).argmax(1)
            pre = {"pre-correct": int((pred == y).sum()), "pre-n": len(y)}
        if moved < t:  # the step's Hedge update, with the models as they meet its batch
            with torch.no_grad():
                risks = [float(self.risk(m.eval(), x, msg)) for m in (local, fed)]
            log_w = hedge_step(log_w, np.array(risks), 1 / math.sqrt(num_steps(cfg)))
            moved = t
        lr = cfg.fedade_fixed_lr
        loss = self.adapt(fed, x, msg, lr)
        self.adapt(local, x, msg, lr)
        self.context.state[LOCAL] = to_record(local)
        self.context.state[HEDGE] = ArrayRecord({"log_w": Array(log_w),
                                                 "t": Array(np.array([moved], np.int64))})
        weight = float(np.exp(log_w[1]) / np.exp(log_w).sum())
        metrics = {"num-examples": len(y), "lr": lr, "fed-weight": weight, "time-step": t,
                   "risk": loss if np.isfinite(loss) else 0.0, **pre}
        return self.reply(msg, metrics, arrays=to_record(fed))

    def evaluate(self, msg: Message) -> Message:
        """Online accuracy of the mixture on this step's batch, and (``next-correct``) on the
        next step's, before adapting to it; Fed-ADE's :meth:`FedADEClient.evaluate` otherwise."""
        models = [self.local_for(msg), self.model_for(msg)]
        x, y, t = self.batch(msg)
        log_w, _ = self.log_weights()
        logp = self.predict(models, x, log_w)
        metrics = {"num-examples": len(y), "accuracy": float((logp.argmax(1) == y).float().mean()),
                   "loss": float(F.nll_loss(logp, y)), "time-step": t}
        if t + 1 < num_steps(self.cfg):
            xn, yn = self.step_batch(t + 1)
            metrics.update({"next-correct": int((self.predict(models, xn, log_w).argmax(1) == yn).sum()),
                            "next-n": len(yn)})
        return self.reply(msg, metrics)
