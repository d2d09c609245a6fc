"""Self-supervised clients: the shared SSL client and FedSimCLR (NT-Xent on two views).

Clients never read labels: their training split has its labels replaced by -1 before any
training code sees it, and there is no client-side evaluation (the server's linear probe
scores the global encoder).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Context, Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.config import Config
from flowerbed.datasets.augment import Augmenter
from flowerbed.datasets.loading import DataSet
from flowerbed.losses import nt_xent
from flowerbed.models.ssl import SSLNet, ssl_model
from flowerbed.training import seeded_generator, ssl_epochs, to_record


def make_ssl_model(cfg: Config, data: DataSet) -> SSLNet:
    c, h, _ = data.shape
    return ssl_model(cfg.model, c, data.num_classes, h, cfg.ssl_dim, cfg.ssl_head_bn,
                     kd_head=cfg.method == "fedx" and cfg.fedx_head == "separate")


class SSLClient(Client):
    """Two augmented views per batch, a method-specific ``loss``, the model sent back whole."""

    random_batch = False  # FedX also draws an independent random batch (its anchor set)

    def __init__(self, cfg: Config, context: Context) -> None:
        super().__init__(cfg, context)
        self.train_data = self.train_data.without_labels()
        c, h, _ = self.train_data.shape
        self.augment = Augmenter(c, h, cfg.ssl_augment, self.device)

    def new_model(self) -> nn.Module:
        return make_ssl_model(self.cfg, self.train_data)

    def prepare(self, model: SSLNet, msg: Message) -> None:
        """Per-round set-up before training (targets, frozen copies...)."""

    def before_epoch(self, model: SSLNet) -> None:
        """Called at the start of every local epoch (FedProtoCL's clustering)."""

    def after_step(self, model: SSLNet) -> None:
        """Called after every optimiser step (BYOL's EMA)."""

    def grad_hook(self, model: SSLNet, msg: Message) -> Callable[[nn.Module], None] | None:
        """The round's gradient hook, if any (FedX's SCAFFOLD-style regulariser)."""
        return None

    def finish(self, model: SSLNet) -> dict[str, float]:
        """Per-round wrap-up after training (state to keep); returns extra metrics."""
        return {}

    def views(self, model: SSLNet, x1: torch.Tensor, x2: torch.Tensor, xr: torch.Tensor | None
              ) -> dict[str, torch.Tensor]:
        """One forward pass over all views: z1, z2, p1, p2 (and zr, pr for the random batch)."""
        xs = [x1, x2] + ([xr] if xr is not None else [])
        _, z, p = model(torch.cat(xs))
        zs, ps = z.split([len(x) for x in xs]), p.split([len(x) for x in xs])
        out = {"z1": zs[0], "z2": zs[1], "p1": ps[0], "p2": ps[1]}
        if xr is not None:
            out.update(zr=zs[2], pr=ps[2])
        return out

    def loss(self, model: SSLNet, v: dict[str, torch.Tensor], x1: torch.Tensor,
             x2: torch.Tensor, xr: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def train(self, msg: Message) -> Message:
        model = self.model_from(msg.content["arrays"])
        rnd = self.round_of(msg)
        cfg = self.cfg
        gen = seeded_generator(cfg.seed, self.partition_id, rnd)  # also seeds the augmentations
        self.prepare(model, msg)

        def step(x1, x2, xr, idx):
            self.batch_idx = idx  # the batch's sample indices (FedProtoCL's cluster lookup)
            return self.loss(model, self.views(model, x1, x2, xr), x1, x2, xr)

        loss, self.steps = ssl_epochs(
            model, self.train_data, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
            momentum=cfg.momentum, weight_decay=cfg.weight_decay, device=self.device,
            generator=gen, augment=self.augment, random_batch=self.random_batch, step=step,
            after_step=lambda: self.after_step(model), before_epoch=lambda: self.before_epoch(model),
            grad_hook=self.grad_hook(model, msg))
        extra = self.finish(model)
        # no batch of 2 samples, no step: no loss to report (0.0 would pull the round's mean down)
        measured = {"train-loss": loss} if self.steps else {}
        return self.reply(msg, {"num-examples": len(self.train_data), **measured, **extra},
                          arrays=to_record(model), **self.extra_arrays(model, msg))


class SimCLRClient(SSLClient):
    """FedSimCLR: NT-Xent between the projections of the two views."""

    def loss(self, model, v, x1, x2, xr):
        return nt_xent(v["z1"], v["z2"], self.cfg.ssl_tau)
