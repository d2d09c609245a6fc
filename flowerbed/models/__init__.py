"""Networks: the classic 28x28 CNN and CIFAR-style ResNets."""

from flowerbed.models.cnn import CNN
from flowerbed.models.resnet import ResNet, resnet8, resnet18

__all__ = ["CNN", "ResNet", "resnet8", "resnet18", "build_model"]


def build_model(name: str, in_channels: int, num_classes: int, image_size: int = 28):
    """Build the network called ``name`` (``cnn``, ``resnet8``, ``resnet18``)."""
    if name == "cnn":
        return CNN(in_channels=in_channels, num_classes=num_classes, image_size=image_size)
    if name == "resnet8":
        return resnet8(in_channels=in_channels, num_classes=num_classes)
    if name == "resnet18":
        return resnet18(in_channels=in_channels, num_classes=num_classes)
    raise ValueError(f"unknown model '{name}'; known: cnn, resnet8, resnet18")
