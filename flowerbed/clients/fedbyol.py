"""FedBYOL: BYOL locally (online network + predictor vs an EMA target), online network averaged.

The target network never leaves the client: it lives in ``context.state["byol.target"]`` and
is initialised from the first global model the client receives. :class:`MomentumClient` is that
machinery (a per-step EMA copy of the online network kept on the client), which FedMoCo's key
encoder shares.
"""

from __future__ import annotations

import torch
from flwr.app import Message

from flowerbed.clients.fedsimclr import SSLClient
from flowerbed.losses import byol_loss
from flowerbed.models.ssl import SSLNet
from flowerbed.training import load_record, to_record

TARGET = "byol.target"


@torch.no_grad()
def ema_update(target: torch.nn.Module, online: torch.nn.Module, rate: float) -> None:
    """target ← rate·target + (1 − rate)·online, parameter by parameter."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.mul_(rate).add_(o.detach(), alpha=1 - rate)


class MomentumClient(SSLClient):
    """An EMA copy of the online network (``self.target``), kept in ``context.state[target_key]``,
    started from the first global model the client receives and moved after every step."""

    keeps_state = True
    target_key = TARGET
    kept_with_target: tuple[str, ...] = ()  # state dropped with a diverged target (MoCo's queue)

    def ema_rate(self) -> float:
        return self.cfg.byol_ema

    def prepare(self, model: SSLNet, msg: Message) -> None:
        super().prepare(model, msg)
        record = self.context.state.array_records.get(self.target_key) or msg.content["arrays"]
        self.target = load_record(self.new_model(), record).to(self.device)
        self.target.requires_grad_(False)

    def after_step(self, model: SSLNet) -> None:
        ema_update(self.target, model, self.ema_rate())

    def finish(self, model: SSLNet) -> dict[str, float]:
        # a target gone NaN would make every later round's loss NaN: dropped, not kept
        self.keep_model(self.target_key, to_record(self.target), *self.kept_with_target)
        return super().finish(model)

    def target_projections(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            _, z, _ = self.target(torch.cat([x1, x2]))
        return z.split([len(x1), len(x2)])


class BYOLClient(MomentumClient):
    def loss(self, model, v, x1, x2, xr):
        t1, t2 = self.target_projections(x1, x2)
        return byol_loss(v["p1"], t2) + byol_loss(v["p2"], t1)
