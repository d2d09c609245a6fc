"""Networks: the classic 28x28 CNN and CIFAR-style ResNets."""

from flowerbed.models.cnn import CNN
from flowerbed.models.resnet import ResNet, resnet8, resnet18

__all__ = ["CNN", "ResNet", "resnet8", "resnet18", "build_model", "is_head"]

#: state_dict key prefixes of the classifier layer ("head") of each network; the rest is the body.
HEAD_PREFIXES = ("fc2.", "linear.")


#: Fed-ADE's personal layers: the CNN's two dense layers, the ResNet's classifier.
PERSONAL_PREFIXES = ("fc1.", "fc2.", "linear.")


def is_personal(key: str) -> bool:
    """Whether a state_dict key is one of Fed-ADE's personal (never aggregated) layers."""
    return key.startswith(PERSONAL_PREFIXES)


def is_head(key: str) -> bool:
    """Whether a state_dict key belongs to the classifier head (FedRep keeps it personal)."""
    return key.startswith(HEAD_PREFIXES)


def build_model(name: str, in_channels: int, num_classes: int, image_size: int = 28,
                width: float = 1.0):
    """Build the network called ``name`` (``cnn``, ``resnet8``, ``resnet18``).

    ``width`` scales the channels (and the CNN's hidden units); heterogeneous clients use 0.5.
    """
    if name == "cnn":
        return CNN(in_channels=in_channels, num_classes=num_classes, image_size=image_size,
                   width=width)
    if name == "resnet8":
        return resnet8(in_channels=in_channels, num_classes=num_classes, width=width)
    if name == "resnet18":
        return resnet18(in_channels=in_channels, num_classes=num_classes, width=width)
    raise ValueError(f"unknown model '{name}'; known: cnn, resnet8, resnet18")
