"""FedLC (Zhang et al., ICML 2022): local cross-entropy on logits calibrated by the client's labels.

Training uses z_c − τ·n_c^(−1/4) for class c (n_c: the client's training samples of class c;
τ = ``fedlc-tau``), so classes the client holds many of are pushed less; a class it holds none
of has n_c = 1e-8 (FL-bench's FedLC), a shift of 100τ that takes it out of the softmax. So a
client holding one class only (``pathological:1``) has a loss and gradient of exactly 0 and does
not train: that is the method (fluke and Flower's FedLC baseline shift by −∞, the same). The
softmax is over every class; the paper's formula sums over j ≠ y in the denominator, which
FL-bench, fluke and Flower's baseline all replace by the full softmax. The reported
``train-loss`` is the calibrated loss. The server is FedAvg's, and evaluation uses the plain
logits.
"""

from __future__ import annotations

from flwr.app import Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.base import Client


class FedLCClient(Client):
    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        shift = self.cfg.fedlc_tau * self.class_counts().clamp_min(1e-8).pow(-0.25)
        return super().fit(model, msg, rnd, criterion=lambda z, y: F.cross_entropy(z - shift, y), **hooks)
