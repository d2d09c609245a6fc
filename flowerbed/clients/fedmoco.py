"""FedMoCo: MoCo v2 locally (query network vs a momentum key encoder, a queue of negatives).

The online network (backbone + projector; the predictor serves only FedX's global terms) is
FedAvg-aggregated. The key encoder is an EMA of it (``moco-momentum`` per step), started from
the first global model the client receives; it and the queue of the client's past keys
(``moco-queue`` rows) never leave the client: they live in ``context.state`` ("moco.key",
"moco.queue"), as FedBYOL's target does. The loss is the symmetrised InfoNCE of MoCo's CIFAR
demo, q1 against k2 and q2 against k1 with the queue as negatives, at NT-Xent's temperature
``ssl-tau``; both views' keys are then enqueued. The queue starts as random unit vectors, seeded
per (seed, partition). With fewer local samples than queue rows, older keys of an image serve
as its negatives, as in MoCo on a small data set.

Shuffle BN: in a network with BatchNorm (the ResNets, ``ssl-head-bn=true``), a positive key
computed in the same batch as its query shares that batch's statistics, which the queue's keys
(from earlier batches) lack, and the network can find its positive by them. As MoCo's CIFAR demo
does on one GPU (SplitBatchNorm), keys are computed on a shuffled batch in ``BN_SPLITS`` groups,
each normalised by its own statistics, and put back in order. The CNN has no BatchNorm and
takes one pass.

Other differences from MoCo v2: the loss is symmetrised (the demo's), τ is ``ssl-tau`` (0.1, the
demo's; MoCo v2's 0.2), the heads are flowerbed's SSL heads (``ssl-dim`` 256; MoCo v2's 128) and
the views are flowerbed's SimCLR-style ones (no blur); the key encoder moves after each step (as
FedBYOL's target), where MoCo moves it before computing the step's keys.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.fedbyol import MomentumClient
from flowerbed.losses import moco_loss
from flowerbed.models.ssl import SSLNet

KEY_ENCODER = "moco.key"
QUEUE = "moco.queue"
BN_SPLITS = 8  # MoCo's CIFAR demo: SplitBatchNorm over 8 groups on one GPU


class MoCoClient(MomentumClient):
    target_key = KEY_ENCODER
    kept_with_target = (QUEUE,)  # keys of a diverged key encoder

    def ema_rate(self) -> float:
        return self.cfg.moco_momentum

    def prepare(self, model: SSLNet, msg: Message) -> None:
        super().prepare(model, msg)
        size, dim = self.cfg.moco_queue, self.cfg.ssl_dim
        record = self.context.state.array_records.get(QUEUE)
        if record is None:
            rng = np.random.default_rng([self.cfg.seed, self.partition_id])  # not torch's global RNG
            self.queue = F.normalize(torch.as_tensor(rng.standard_normal((size, dim)), dtype=torch.float32),
                                     dim=1)
            self.ptr = 0
        else:
            self.queue = torch.as_tensor(record["queue"].numpy()).clone()
            self.ptr = int(record["ptr"].numpy()[0])
            if self.queue.shape != (size, dim):
                raise ValueError(f"partition {self.partition_id}: the kept MoCo queue has shape "
                                 f"{tuple(self.queue.shape)}, this run's moco-queue x ssl-dim is "
                                 f"{(size, dim)}")
        self.queue = self.queue.to(self.device)
        self.keys: torch.Tensor | None = None
        # shuffle BN (below) where the network normalises by batch statistics; looked up once a round
        self.shuffle_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.target.modules())

    def target_projections(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.shuffle_bn:
            return super().target_projections(x1, x2)
        x = torch.cat([x1, x2])
        # torch's CPU RNG, seeded per client and round (on the CPU whatever the device, so that a
        # GPU run draws the same groups as a CPU run, and, with ssl-augment='per-sample', the same
        # augmentations after them)
        perm = torch.randperm(len(x)).to(x.device)
        # near-equal groups of at least 2 (train-mode BatchNorm needs two values per channel)
        groups = x[perm].tensor_split(max(1, min(BN_SPLITS, len(x) // 2)))
        with torch.no_grad():
            z = torch.cat([self.target(g)[1] for g in groups])[torch.argsort(perm)]
        return z.split([len(x1), len(x2)])

    def loss(self, model, v, x1, x2, xr):
        k1, k2 = self.target_projections(x1, x2)
        self.keys = torch.cat([k1, k2])
        tau = self.cfg.ssl_tau
        return moco_loss(v["z1"], k2, self.queue, tau) + moco_loss(v["z2"], k1, self.queue, tau)

    def after_step(self, model: SSLNet) -> None:
        super().after_step(model)
        self.enqueue(self.keys)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """FIFO: the newest keys overwrite the oldest rows (wrapping round the end)."""
        keys = F.normalize(keys, dim=1)[-len(self.queue):]
        idx = (self.ptr + torch.arange(len(keys))) % len(self.queue)
        self.queue[idx.to(self.queue.device)] = keys
        self.ptr = int((self.ptr + len(keys)) % len(self.queue))

    def finish(self, model: SSLNet) -> dict[str, float]:
        # a queue gone NaN is dropped (it restarts as seeded random keys), not kept for good
        self.keep_model(QUEUE, ArrayRecord({"queue": self.queue.cpu(), "ptr": torch.tensor([self.ptr])}))
        return super().finish(model)
