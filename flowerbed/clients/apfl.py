"""APFL (Deng, Kamani & Mahdavi, 2020), client half: FedAvg's local update of the global model w,
and on the same batches a personal model v whose mixture with w is what the client serves:

    v̄ = α v + (1 − α) w,   v ← v − η ∇_v f(v̄) = v − η α ∇f(v̄),   α ← Π_[0,1](α − η_α ⟨v − w, ∇f(v̄)⟩)

each step with w as it is before its own step (``apfl-alpha`` is α's start, ``apfl-adaptive``
whether it is learnt, ``apfl-alpha-lr`` its step size; v's optimiser is w's: SGD with the run's
momentum and weight decay, new each round). A non-finite gradient makes α NaN, so the reply is
refused and names it, rather than clipped to 0, and v and α are dropped (``Client.keep_model``):
the next round starts them afresh instead of refusing every later reply. v and α are kept in
``context.state``; only w is uploaded, so the server's model is FedAvg's to the bit. A client is
scored with α v + (1 − α) w, w the received global model; one without v (not trained yet, or its
state lost) is scored with w and says so (``personal-model`` 0). v starts as the model the client
first trains from (w⁰ when every client trains every round).
"""

from __future__ import annotations

import math

import torch
from flwr.app import Message, MetricRecord
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from flowerbed.clients.base import Client
from flowerbed.training import make_optimizer, to_record

PERSONAL, ALPHA = "apfl.personal", "apfl.alpha"


def mixture(v: nn.Module, w: nn.Module, alpha: float | torch.Tensor) -> dict[str, torch.Tensor]:
    """α v + (1 − α) w over the parameters (w detached: v̄'s gradient goes to v and α only)."""
    wp = dict(w.named_parameters())
    return {k: alpha * p + (1 - alpha) * wp[k].detach() for k, p in v.named_parameters()}


class APFLClient(Client):
    keeps_state = True

    def held(self) -> tuple[nn.Module | None, float]:
        """This client's v (None before its first training round) and α."""
        alpha = self.context.state.metric_records.get(ALPHA)
        return self.state_model(PERSONAL), float(alpha["alpha"]) if alpha is not None else self.cfg.apfl_alpha

    def train(self, msg: Message) -> Message:
        cfg, rnd = self.cfg, self.round_of(msg)
        w = self.model_from(msg.content["arrays"])
        v, alpha = self.held()
        v = v if v is not None else self.model_from(msg.content["arrays"])
        v.train()
        opt = make_optimizer(v, cfg.lr, cfg.momentum, cfg.weight_decay)
        state = {"alpha": alpha, "loss": 0.0, "n": 0}

        def personal_step(x: torch.Tensor, y: torch.Tensor) -> None:  # before w's step on (x, y)
            a = torch.tensor(state["alpha"], device=x.device, requires_grad=cfg.apfl_adaptive)
            loss = F.cross_entropy(functional_call(v, mixture(v, w, a), (x,)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if cfg.apfl_adaptive:
                step = state["alpha"] - cfg.apfl_alpha_lr * float(a.grad)
                state["alpha"] = min(1.0, max(0.0, step)) if math.isfinite(step) else math.nan
            state["loss"] += float(loss.detach()) * len(y)
            state["n"] += len(y)

        loss, _ = self.fit(w, msg, rnd, batch_hook=personal_step)
        if self.keep_model(PERSONAL, to_record(v), ALPHA, finite=math.isfinite(state["alpha"])):
            self.context.state[ALPHA] = MetricRecord({"alpha": state["alpha"]})
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss,
                                "personal-train-loss": state["loss"] / max(state["n"], 1),
                                "alpha": state["alpha"]}, arrays=to_record(w))

    def evaluate(self, msg: Message) -> Message:
        w = self.model_from(msg.content["arrays"])
        v, alpha = self.held()
        if v is not None:  # v̄: the mixed parameters, v's buffers (BatchNorm's statistics of v̄)
            with torch.no_grad():
                for k, p in mixture(v, w, alpha).items():
                    v.get_parameter(k).copy_(p)
        return self.scored(msg, w if v is None else v, {"personal-model": float(v is not None)})
