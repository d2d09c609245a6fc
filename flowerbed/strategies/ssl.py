"""Server half of the self-supervised methods (FedSimCLR, FedBYOL, FedU, FedMoCo, FedProtoCL, FedX):
FedAvg + probe.

The global encoder is scored by a linear probe: backbone features of the whole (labelled,
non-augmented) training set are extracted once per probe, a linear classifier is trained on
them and its top-1 accuracy on the test set is the round's ``accuracy``. Round 0 probes the
random-init encoder: the floor every method must beat.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from flowerbed.datasets.loading import DataSet
from flowerbed.strategies.base import FlowerbedFedAvg
from flowerbed.training import extract_features, linear_probe, load_record


class SSLStrategy(FlowerbedFedAvg):
    def evaluates(self, server_round: int) -> bool:
        return (server_round % self.cfg.probe_every == 0
                or server_round == self.cfg.num_server_rounds)

    def clients_evaluate(self) -> bool:
        return False  # clients hold no labels; the server's probe is the evaluation

    def evaluate_global(self, server_round: int, arrays: ArrayRecord, train: DataSet,
                        test: DataSet, device: torch.device) -> tuple[float, float]:
        return probe(load_record(self.model, arrays), train, test, device, self.cfg)


def probe(model: torch.nn.Module, train: DataSet, test: DataSet, device: torch.device, cfg
          ) -> tuple[float, float]:
    """(test loss, top-1 test accuracy) of a linear probe on the frozen backbone features."""
    model = model.to(device).eval()
    tr = extract_features(model.features, train, device)
    te = extract_features(model.features, test, device)
    return linear_probe(tr, train.y, te, test.y, train.num_classes, epochs=cfg.probe_epochs,
                        lr=cfg.probe_lr, batch_size=cfg.probe_batch_size, seed=cfg.seed)
