"""FedCT (Abourayya et al., AAAI 2025, "Little is Enough"), client half: federated co-training.

One of the FedCC paper's distillation baselines. The client shares only hard labels: its model's
argmax on the public set, one-hot. From round 2 it trains on its private data together with the
public set labelled by the server's consensus (the majority vote of the clients' labels), for
``local-epochs`` epochs with Adam at ``distill-lr`` (the private fit of FedDF and FedMD); in round 1,
on its private data alone. Its evaluation shares hard labels on the test set too, so that the
ensemble is the clients' majority vote.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.distill import DistillClient
from flowerbed.datasets.loading import DataSet
from flowerbed.training import predict


def one_hot_argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the lowest class on a tie), one-hot, float32."""
    return F.one_hot(scores.argmax(1), scores.shape[1]).float()


class FedCTClient(DistillClient):
    def outputs(self, model: nn.Module, data: DataSet) -> torch.Tensor:
        logits = predict(model, data, self.device, probabilities=False)
        if not torch.isfinite(logits).all():  # (a one-hot argmax of NaN would pass as a vote)
            raise FloatingPointError(f"partition {self.partition_id}: the model's outputs are not "
                                     "finite (it diverged); it casts no votes")
        return one_hot_argmax(logits)

    def local_update(self, model: nn.Module, targets: torch.Tensor | None, gen: torch.Generator
                     ) -> dict[str, float]:
        data = self.train_data
        if targets is not None:  # the public set, labelled by the consensus, beside the private data
            data = dataclasses.replace(data, x=torch.cat([data.x, self.public.x]),
                                       y=torch.cat([data.y, targets.argmax(1)]))
        return {"train-loss": self.fit_private(model, gen, self.cfg.local_epochs, data)}
