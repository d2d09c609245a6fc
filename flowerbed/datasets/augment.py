"""Per-sample, seeded augmentations for self-supervised training.

Two implementations of one recipe (``ssl-augment``):

- ``per-sample``: torchvision transforms v2 on the CPU. v2 transforms draw one set of random
  parameters per call, so a batch is augmented sample by sample (about 0.2 ms per 28x28 image
  and 0.5 ms per 32x32 colour image on one core here). Every CPU figure in the README's tables
  was made this way.
- ``batched``: kornia's augmentations on the whole batch at once, on the training device, with
  its own random parameters for every sample (about 5x faster on one CPU core here, and on a
  GPU the views never wait for the CPU). The same recipe and parameter ranges; the draws differ,
  and kornia resamples with its own interpolation, so a run's figures differ from a per-sample
  run's as another seed's would.
- ``auto`` (the default): batched on a GPU, per-sample on the CPU.

The randomness comes from torch's global CPU generator (kornia 0.9 draws its parameters there,
then moves them to the batch's device), which the client seeds from (seed, partition, round)
before training.
"""

from __future__ import annotations

import torch


def ssl_transform(channels: int, size: int):
    """SimCLR-style views (SimCLR's CIFAR recipe): crop, flip and colour distortion.

    1-channel images get the grey-scale part of the colour distortion, brightness and contrast
    jitter (saturation, hue and grey-scale conversion do not exist for them). Without it two
    crops of one image share their intensity histogram, an easy shortcut: with crop + flip only,
    centralised SimCLR on Fashion-MNIST fell below the random-init encoder's probe for its first
    16 epochs (80.5 % after one, against 84.97 %); with the jitter it passed it after two
    (README, FedX).
    """
    # imported here: torchvision costs ~1.4 s to import, paid by every deployed ClientApp process
    from torchvision.transforms import v2

    crop_flip = [v2.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True),
                 v2.RandomHorizontalFlip()]
    if channels == 1:
        return v2.Compose([*crop_flip,
                           v2.RandomApply([v2.ColorJitter(brightness=0.4, contrast=0.4)], p=0.8)])
    return v2.Compose([*crop_flip, v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
                       v2.RandomGrayscale(p=0.2)])


def batched_ssl_transform(channels: int, size: int) -> torch.nn.Module:
    """:func:`ssl_transform`'s recipe as kornia modules: float images in [0, 1], a batch at once,
    random parameters drawn per sample."""
    import kornia.augmentation as K  # ~1 s to import: only where the batched views are used

    crop_flip = [K.RandomResizedCrop((size, size), scale=(0.2, 1.0)), K.RandomHorizontalFlip()]
    if channels == 1:
        return K.AugmentationSequential(*crop_flip, K.ColorJitter(brightness=0.4, contrast=0.4, p=0.8))
    return K.AugmentationSequential(*crop_flip, K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8),
                                    K.RandomGrayscale(p=0.2))


class Augmenter:
    """uint8 batch [B, C, H, W] -> an augmented batch of pixel values in 0-255, one random draw
    per sample: uint8 on the CPU (``per-sample``), float on ``device`` (``batched``); either is
    what :meth:`DataSet.normalise` takes."""

    def __init__(self, channels: int, size: int, mode: str = "per-sample",
                 device: torch.device | None = None) -> None:
        self.device = torch.device("cpu") if device is None else device
        self.batched = mode == "batched" or (mode == "auto" and self.device.type != "cpu")
        self.transform = (batched_ssl_transform if self.batched else ssl_transform)(channels, size)

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        if self.batched:
            x = xb.to(self.device, non_blocking=True).float().div_(255.0)
            return self.transform(x).mul_(255.0)
        return torch.stack([self.transform(x) for x in xb])
