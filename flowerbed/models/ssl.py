"""Self-supervised network: backbone f, projection head g and prediction head q.

h = f(x) (the backbone's pooled features, used by the linear probe), z = g(h), p = q(z).
Following FedX's code, g is Linear(d, 256)-ReLU-Linear(256, 256) and q is Linear(256, 256)-
ReLU-Linear(256, 256); all three parts are aggregated by the server. With ``head_bn`` (run-config
``ssl-head-bn``) both heads put a BatchNorm1d before their ReLU, as BYOL's heads do (Grill et
al., 2020); FedX's code has none.
"""

from __future__ import annotations

import torch
from torch import nn

from flowerbed.models import build_model


def mlp(d_in: int, hidden: int, d_out: int, bn: bool = False) -> nn.Sequential:
    norm = [nn.BatchNorm1d(hidden)] if bn else []
    return nn.Sequential(nn.Linear(d_in, hidden), *norm, nn.ReLU(), nn.Linear(hidden, d_out))


class SSLNet(nn.Module):
    def __init__(self, backbone: nn.Module, dim: int = 256, head_bn: bool = False,
                 kd_head: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.projector = mlp(backbone.feature_dim, dim, dim, head_bn)
        self.predictor = mlp(dim, dim, dim, head_bn)
        # FedX over BYOL with fedx-head='separate': FedX's own prediction head for its global
        # terms, next to BYOL's predictor (aggregated like the rest; not part of forward)
        self.kd_head = mlp(dim, dim, dim, head_bn) if kd_head else None

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.features(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.features(x)
        z = self.projector(h)
        return h, z, self.predictor(z)


def ssl_model(name: str, channels: int, num_classes: int, image_size: int, dim: int = 256,
              head_bn: bool = False, kd_head: bool = False) -> SSLNet:
    """An SSLNet on the named backbone (its classifier layer is unused)."""
    return SSLNet(build_model(name, channels, num_classes, image_size), dim, head_bn, kd_head)
