"""The classic FedAvg CNN (McMahan et al.): conv32-conv64 (5x5, max-pool) - fc512 - fc classes."""

from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    """conv5x5(32)-pool-conv5x5(64)-pool-fc512-fc(num_classes); works for 28x28 and 32x32 input.

    ``features`` returns the 512-d penultimate representation (used by probes and by methods that
    split shared and personal layers). Flattening is functional, not an ``nn.Flatten`` module, so
    attribution tools that need a rule per module (captum LRP) can walk it; for the same reason
    every activation and pooling is its own module instance.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 width: float = 1.0) -> None:
        super().__init__()
        c1, c2, hidden = int(32 * width), int(64 * width), int(512 * width)
        self.conv1 = nn.Conv2d(in_channels, c1, 5, padding=2)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=2)
        self.pool1, self.pool2 = nn.MaxPool2d(2), nn.MaxPool2d(2)  # one module per use (LRP)
        self.act1, self.act2, self.act3 = nn.ReLU(), nn.ReLU(), nn.ReLU()
        side = image_size // 4
        self.fc1 = nn.Linear(c2 * side * side, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)
        self.feature_dim = hidden

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """The convolutional layers' flattened output (Fed-ADE's shared representation)."""
        x = self.pool1(self.act1(self.conv1(x)))
        return torch.flatten(self.pool2(self.act2(self.conv2(x))), 1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.act3(self.fc1(self.trunk(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))
