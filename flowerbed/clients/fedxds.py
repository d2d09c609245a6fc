"""FedXDS client: FedAvg training; once, privatised shared samples; then local + λ·shared loss.

In the sharing round the client trains as usual, then takes ``fedxds-share-fraction`` of its
training samples (seeded), computes attributions with its own locally trained model for their
true labels (:mod:`flowerbed.attribution`), masks, clips and noises them
(:mod:`flowerbed.privacy`) and uploads them with their labels. Nothing unmasked or noise-free
leaves the client (``fedxds-mask='none'`` is the "unmasked, noised" baseline; noise is always
added, drawn from the OS's randomness unless ``fedxds-noise='seeded'``). The pooled D_g
arrives once and is kept in ``context.state["fedxds.shared"]``.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from torch import nn
from torch.nn import functional as F

from flowerbed import client_state
from flowerbed.attribution import attribute
from flowerbed.clients.base import Client
from flowerbed.privacy import privatise
from flowerbed.strategies.fedxds import SHARED
from flowerbed.training import cycled_batches, seeded_generator, to_record

STATE = "fedxds.shared"
RELEASED = client_state.RELEASED + "fedxds.shared"  # this client's own upload to D_g


class FedXDSClient(Client):
    def sigma(self) -> float:
        return self.cfg.resolved_sigma()

    def shared_samples(self, model: nn.Module, rnd: int) -> ArrayRecord:
        """Privatised (masked, clipped, noised) samples of this client, with their labels."""
        cfg, data = self.cfg, self.train_data
        if not len(data):
            raise ValueError(f"partition {self.partition_id} has no training samples to share "
                             "(min-partition-size allowed an empty partition)")
        rng = np.random.default_rng([cfg.seed, self.partition_id, 17])
        n = max(1, int(round(len(data) * cfg.fedxds_share_fraction)))
        idx = np.sort(rng.permutation(len(data))[:n])
        x = data.normalise(data.x[idx].to(self.device))
        y = data.y[idx].to(self.device)
        if cfg.fedxds_mask == "none":  # the unmasked baseline: no attribution
            heat = torch.zeros(len(idx), *x.shape[2:])
        else:
            heat = attribute(model, x, y, cfg.fedxds_attribution,
                             lrp_first=cfg.fedxds_lrp_first).cpu()
        # noise the server could regenerate from the run config would protect nothing: by
        # default it comes from the OS's randomness, never from the run's seed
        gen = (seeded_generator(cfg.seed, self.partition_id, rnd, 31337) if cfg.fedxds_noise == "seeded"
               else torch.Generator().manual_seed(secrets.randbits(63)))
        out = privatise(x.detach().cpu(), heat, sparsity=cfg.fedxds_sparsity,
                        mask_kind=cfg.fedxds_mask, clip=cfg.fedxds_clip, sigma=self.sigma(),
                        generator=gen)
        return ArrayRecord({"x": Array(out.numpy().astype(np.float16)),
                            "y": Array(y.cpu().numpy().astype(np.int64))})

    def train(self, msg: Message) -> Message:
        cfg, rnd = self.cfg, self.round_of(msg)
        phase = str(msg.content["config"].get("fedxds-phase", "warmup"))
        if SHARED in msg.content.array_records:
            self.context.state[STATE] = msg.content[SHARED]
        model = self.model_from(msg.content["arrays"])
        pool = self.context.state.array_records.get(STATE)
        hooks = {}
        if phase == "main" and pool is not None and cfg.fedxds_lambda > 0:
            hooks["loss_hook"] = self._shared_term(pool, seeded_generator(cfg.seed, self.partition_id,
                                                                         rnd, 7))
        loss, _ = self.fit(model, msg, rnd, **hooks)
        metrics = {"num-examples": len(self.train_data), "train-loss": loss,
                   "has-pool": int(pool is not None)}
        extra = {SHARED: self.release(model, rnd)} if phase == "share" else {}
        return self.reply(msg, metrics, arrays=to_record(model), **extra)

    def release(self, model: nn.Module, rnd: int) -> ArrayRecord:
        """The client's shared samples, drawn once: a repeated share round (a retry, or a resumed
        run whose server died before that round's checkpoint) re-sends the same release; a fresh
        draw of noise on the same images would add up to less noise than the recorded ε."""
        released = self.context.state.array_records.get(RELEASED)
        if released is None:
            released = self.context.state[RELEASED] = self.shared_samples(model, rnd)
        return released

    def _shared_term(self, pool: ArrayRecord, gen: torch.Generator):
        """λ·CE on the next batch of D_g (cycled, shuffled), added to every local batch's loss."""
        x = torch.as_tensor(pool["x"].numpy()).float()
        y = torch.as_tensor(pool["y"].numpy()).long()
        lam = self.cfg.fedxds_lambda
        it = cycled_batches(len(y), self.cfg.batch_size, gen)

        def hook(m: nn.Module) -> torch.Tensor:
            idx = next(it)
            return lam * F.cross_entropy(m(x[idx].to(self.device)), y[idx].to(self.device))

        return hook
