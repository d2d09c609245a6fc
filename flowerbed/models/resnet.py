"""CIFAR-style ResNets: 3x3 stride-1 stem, no max-pool, BasicBlocks, global average pooling."""

from __future__ import annotations

import torch
from torch import nn


class Add(nn.Module):
    """The residual sum as a module (captum's ``Addition_Module``, without importing captum
    here): LRP then splits the relevance between the two branches by their shares of the sum,
    where a functional ``+`` handed the whole relevance to both and doubled it at every block.
    No parameters: state_dicts and checkpoints are as before."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()  # modules, so captum's LRP sees them
        self.add = Add()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(self.add(out, self.shortcut(x)))


class ResNet(nn.Module):
    """``blocks`` BasicBlocks per stage; ``widths`` channels per stage; ``features`` = pooled h."""

    def __init__(self, blocks: list[int], widths: list[int], in_channels: int = 3,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        layers, in_planes = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths, strict=True)):
            strides = [1 if i == 0 else 2] + [1] * (n - 1)
            stage = []
            for s in strides:
                stage.append(BasicBlock(in_planes, w, s))
                in_planes = w
            layers.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*layers)
        self.feature_dim = in_planes
        self.linear = nn.Linear(in_planes, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        return torch.flatten(self.pool(out), 1)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """Everything but the classifier (Fed-ADE's shared representation)."""
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.features(x))


def _scaled(widths: list[int], width: float) -> list[int]:
    return [max(1, round(w * width)) for w in widths]


def resnet8(in_channels: int = 3, num_classes: int = 10, width: float = 1.0) -> ResNet:
    """ResNet-8: stem conv + 3 stages of one BasicBlock (64/128/256 channels × ``width``) + fc
    = 8 layers."""
    return ResNet([1, 1, 1], _scaled([64, 128, 256], width), in_channels, num_classes)


def resnet18(in_channels: int = 3, num_classes: int = 10, width: float = 1.0) -> ResNet:
    """ResNet-18 as in the CIFAR literature: [2, 2, 2, 2] BasicBlocks, widths 64-512 (× ``width``)."""
    return ResNet([2, 2, 2, 2], _scaled([64, 128, 256, 512], width), in_channels, num_classes)
