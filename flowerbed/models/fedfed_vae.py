"""FedFed's feature-distillation network: a VAE that splits x into x_r + x_s, and its classifier.

The shape follows the official code's ``FL_CVAE_cifar`` (visitworld123/FedFed, model/FL_VAE.py):
two stride-2 4×4 convolutions (16, 32 channels) and two residual blocks down to 32 × H/4 × W/4,
fully connected μ and log σ² of the same size (the code's ``VAE_z`` = 2048 on 32×32 input),
and the mirror image up, with the code's tanh before the last transposed convolution and a
BatchNorm after it. The code ends in a sigmoid for [0, 1] pixels; flowerbed's models see
standardised input, so nothing follows the BatchNorm here. The decoder's output is x_r, the
performance-robust part that is not sent; x_s = x − x_r is the part that is shared (the server
also holds the VAE that made it, so it can try to rebuild x = x_s + VAE(x):
``benchmarks/fedxds_privacy.py`` measures that attack). 28×28 input works as well as 32×32
(7×7 and 8×8 in the middle).
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + [LeakyReLU, conv3×3, BN, LeakyReLU, conv1×1](x), the code's ResBlock."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LeakyReLU(), nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c),
                                 nn.LeakyReLU(), nn.Conv2d(c, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class FedFedVAE(nn.Module):
    """x [N, C, H, W] -> (x_r, μ, log σ²); z = μ in eval mode, μ + σ·ε in training."""

    def __init__(self, channels: int, image_size: int, width: int = 32) -> None:
        super().__init__()
        half, self.side = width // 2, image_size // 4
        self.width = width
        self.encoder = nn.Sequential(
            nn.Conv2d(channels, half, 4, 2, 1, bias=False), nn.BatchNorm2d(half), nn.ReLU(),
            nn.Conv2d(half, width, 4, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            ResBlock(width), nn.BatchNorm2d(width), ResBlock(width))
        flat = width * self.side * self.side
        self.fc_mu, self.fc_logvar, self.fc_dec = (nn.Linear(flat, flat), nn.Linear(flat, flat),
                                                   nn.Linear(flat, flat))
        self.decoder = nn.Sequential(
            ResBlock(width), nn.BatchNorm2d(width), ResBlock(width), nn.BatchNorm2d(width),
            nn.ConvTranspose2d(width, half, 4, 2, 1, bias=False), nn.BatchNorm2d(half), nn.LeakyReLU(),
            nn.Tanh(), nn.ConvTranspose2d(half, channels, 4, 2, 1, bias=False), nn.BatchNorm2d(channels))
        #: draws ε in training (the client seeds it per round); None: torch's global RNG
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.flatten(self.encoder(x), 1)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        z = mu
        if self.training:
            eps = torch.randn(mu.shape, generator=self.generator, dtype=mu.dtype).to(mu.device)
            z = mu + eps * torch.exp(0.5 * logvar)
        x_r = self.decoder(self.fc_dec(z).view(len(x), self.width, self.side, self.side))
        return x_r, mu, logvar


class FedFedNet(nn.Module):
    """What FedFed federates in its feature-distillation rounds: the VAE and its own classifier
    (a network of the run's model architecture, separate from the FL model; the code's is a
    ResNet-18)."""

    def __init__(self, vae: FedFedVAE, classifier: nn.Module) -> None:
        super().__init__()
        self.vae, self.classifier = vae, classifier

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x, x_r, μ, log σ²): the input too, for a loss of the form criterion(output, y)."""
        return (x, *self.vae(x))

    @torch.no_grad()
    def shared_part(self, x: torch.Tensor) -> torch.Tensor:
        """x_s = x − x_r, what a client shares (eval mode: z = μ), in batches of 256."""
        self.eval()
        return torch.cat([b - self.vae(b)[0] for b in x.split(256)])
