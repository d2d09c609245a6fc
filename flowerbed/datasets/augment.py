"""Per-sample, seeded augmentations for self-supervised training (torchvision transforms v2).

v2 transforms draw one set of random parameters per call, so a batch is augmented sample by
sample; the randomness comes from torch's global generator, which the client seeds from
(seed, partition, round) before training.
"""

from __future__ import annotations

import torch


def ssl_transform(channels: int, size: int):
    """SimCLR-style views: 1-channel 28x28 (crop + flip) or 3-channel 32x32 (+ colour)."""
    # imported here: torchvision costs ~1.4 s to import, paid by every deployed ClientApp process
    from torchvision.transforms import v2

    if channels == 1:
        return v2.Compose([
            v2.RandomResizedCrop(size, scale=(0.4, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
        ])
    return v2.Compose([
        v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
    ])


class Augmenter:
    """uint8 batch [B, C, H, W] -> an augmented uint8 batch, one random draw per sample."""

    def __init__(self, channels: int, size: int) -> None:
        self.transform = ssl_transform(channels, size)

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.transform(x) for x in xb])
