"""Data: loading (IDX / torchvision formats), partitioning (flwr-datasets), per-client splits."""

from flowerbed.datasets.loading import DataSet, load_dataset
from flowerbed.datasets.partition import client_split, partition_indices

__all__ = ["DataSet", "load_dataset", "partition_indices", "client_split"]
