"""FedFed (Yang et al., NeurIPS 2023), client half: feature distillation, one share, FedXDS's main phase.

In the feature-distillation rounds (``fedxds-warmup-rounds`` but the last) the client trains what
the server sends, :class:`~flowerbed.models.fedfed_vae.FedFedNet` (a VAE and its own classifier),
for ``local-epochs`` with Adam at ``fedfed-lr`` on the official code's loss

    re·‖s ⊙ (x_r − x)‖² + ce·CE(f(x̃_s), y) + kl·KL(q(z|x) ‖ N(0, I))/3 + x-ce·CE(f(x), y),

x_r the VAE's output, x_s = x − x_r and x̃_s = clip(x_s, C) + N(0, σ²): the classifier learns
the labels from noised x_s while the reconstruction term keeps x_s small (the paper's
information bottleneck). As in the code, the reconstruction error is a mean over [0, 1] pixels
(s: the data set's per-channel std, undoing the standardisation) and the KL term a sum over
the batch and latent divided by B·3·z. In the last of these rounds (the share round) the client
does not train: it uploads, once, x_s of the VAE it received (the federation's average, eval
mode, z = μ; the code's clients all share through the global VAE) for ``fedxds-share-fraction``
of its samples, clipped to ``fedxds-clip`` and noised with FedXDS's σ
(:func:`flowerbed.privacy.privatise`, no mask), with their labels, and returns that VAE
unchanged. The main rounds are FedXDSClient's: CE(local) + λ·CE(D_g) on the FL model. The VAE
rounds report their loss as ``vae-loss``.

Differences from the official code, on purpose: x_s is clipped before its noise and the noise is
drawn per sample and pixel (the code neither clips nor draws more than one noise image per
batch, so its stated (ε, δ) does not hold), with the σ FedXDS uses, so both share at the same
(ε, δ); one noised copy of x_s (the paper's; the code adds a second at σ = 0.25 "for better
performance"); the code's mixup and mosaic pre-steps and its per-client adaptive loss weights
(engineering, not in the paper) are left out; the main-phase loss is FedXDS's λ-weighted sum
(the code draws equal-sized local and shared batches into one cross-entropy).
"""

from __future__ import annotations

import logging

import torch
from flwr.app import Message
from torch import nn
from torch.nn import functional as F

from flowerbed.client_state import run_key_of
from flowerbed.clients.fedxds import FedXDSClient
from flowerbed.config import Config
from flowerbed.datasets.loading import IMAGE_SHAPES, NUM_CLASSES, STATS
from flowerbed.models import build_model
from flowerbed.models.fedfed_vae import FedFedNet, FedFedVAE
from flowerbed.privacy import add_noise, clip_l2, privatise
from flowerbed.strategies.fedxds import SHARED
from flowerbed.training import generator_of, load_record, seeded_generator, to_record, train_epochs

log = logging.getLogger("flowerbed")


def make_fedfed_net(cfg: Config) -> FedFedNet:
    """The network of the feature-distillation rounds for the run's data set and model."""
    c, h, _ = IMAGE_SHAPES[cfg.dataset]
    return FedFedNet(FedFedVAE(c, h), build_model(cfg.model, c, NUM_CLASSES[cfg.dataset], h))


def fedfed_loss(net: FedFedNet, cfg: Config, sigma: float, gen: torch.Generator):
    """criterion(net(x), y) for :func:`~flowerbed.training.train_epochs`: the module docstring's loss."""
    std = torch.tensor(STATS[cfg.dataset][1]).view(1, -1, 1, 1)

    def criterion(out: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        x, x_r, mu, logvar = out
        noised = add_noise(clip_l2(x - x_r, cfg.fedxds_clip), sigma, gen)
        logits = net.classifier(torch.cat([noised, x]))
        rec = ((x_r - x) * std.to(x.device)).pow(2).mean()  # in [0, 1] pixels, as the code's
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp()) / 3  # the code: sum / (B·3·z)
        return (cfg.fedfed_re * rec + cfg.fedfed_ce * F.cross_entropy(logits[:len(y)], y)
                + cfg.fedfed_kl * kl + cfg.fedfed_x_ce * F.cross_entropy(logits[len(y):], y))

    return criterion


class FedFedClient(FedXDSClient):

    def train(self, msg: Message) -> Message:
        phase = str(msg.content["config"].get("fedxds-phase", "warmup"))
        if phase == "main":
            return super().train(msg)
        cfg, rnd = self.cfg, self.round_of(msg)
        net = load_record(make_fedfed_net(cfg), msg.content["arrays"]).to(self.device)
        metrics = {"num-examples": len(self.train_data), "has-pool": 0}
        if phase == "share":  # x_s of the federation's VAE, as received; no training
            released = self.release(net, rnd, run_key_of(msg))
            return self.reply(msg, metrics, arrays=msg.content["arrays"], **{SHARED: released})
        gen = seeded_generator(cfg.seed, self.partition_id, rnd)
        net.vae.generator = generator_of(cfg.seed, self.partition_id, rnd, 1)
        metrics["vae-loss"], _ = train_epochs(
            net, self.train_data, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.fedfed_lr,
            momentum=0.0, weight_decay=cfg.weight_decay, device=self.device, generator=gen,
            optimizer="adam", criterion=fedfed_loss(net, cfg, self.sigma(),
                                                    generator_of(cfg.seed, self.partition_id, rnd, 2)))
        net.vae.generator = None
        return self.reply(msg, metrics, arrays=to_record(net))

    def privatised(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   gen: torch.Generator) -> torch.Tensor:
        """x_s = x − x_r of the received (the federation's) VAE, clipped and noised, unmasked."""
        x_s = model.shared_part(x).cpu()
        norms = x_s.flatten(1).norm(dim=1)
        log.info("partition %d: FedFed's x_s, mean L2 norm %.3f (x's: %.3f), %.1f %% clipped to %g",
                 self.partition_id, float(norms.mean()), float(x.flatten(1).norm(dim=1).mean()),
                 100 * float((norms > self.cfg.fedxds_clip).float().mean()), self.cfg.fedxds_clip)
        return privatise(x_s, None, sparsity=0.0, mask_kind="none", clip=self.cfg.fedxds_clip,
                         sigma=self.sigma(), generator=gen)
