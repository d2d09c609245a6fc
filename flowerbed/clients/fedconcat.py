"""FedConcat (Diao, Li & He, AAAI 2024), client half: a cluster's model, then a classifier over the
concatenated encoders.

One of the FedCC paper's parameter-based baselines. A client tells the server its label counts in
its whoami reply, before round 1 (the server clusters the clients by them). In the encoder stage it
trains the model of its cluster as FedAvg's client does. In the classifier stage the message carries
the K cluster models (``model.0`` ...) and the classifier; the client trains the classifier alone on
the K encoders' concatenated features (each model's penultimate layer, ``features``; the encoders
frozen, in eval mode) for ``fedconcat-classifier-steps`` mini-batches of a seeded shuffle of its
training split (the official code: 3), with the run's SGD (at ``fedconcat-classifier-lr`` if set),
and replies with the classifier only.
"""

from __future__ import annotations

import torch
from flwr.app import Message
from torch import nn

from flowerbed.clients.base import Client
from flowerbed.clients.fedfew import MultiModelClient
from flowerbed.clients.fedftg import COUNTS
from flowerbed.training import seeded_generator, to_record, train_epochs

CLASSIFIER = "classifier"


class ConcatModel(nn.Module):
    """K frozen encoders (each model's ``features``), their features concatenated, one linear
    classifier over them."""

    def __init__(self, encoders: list[nn.Module], classifier: nn.Linear) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(encoders).requires_grad_(False)
        self.classifier = classifier

    def train(self, mode: bool = True) -> ConcatModel:
        super().train(mode)
        self.encoders.eval()  # frozen: their BatchNorm statistics stay the cluster models'
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.cat([e.features(x) for e in self.encoders], 1))


def classifier_for(encoders: list[nn.Module], num_classes: int) -> nn.Linear:
    return nn.Linear(sum(e.feature_dim for e in encoders), num_classes)


class FedConcatClient(MultiModelClient):
    def whoami_extra(self) -> dict[str, list[int]]:
        return {COUNTS: [int(v) for v in self.class_counts()]}

    def concat_model(self, msg: Message) -> ConcatModel:
        encoders = self.models_from(msg)
        clf = classifier_for(encoders, self.train_data.num_classes)
        clf.load_state_dict(msg.content[CLASSIFIER].to_torch_state_dict())
        return ConcatModel(encoders, clf).to(self.device)

    def train(self, msg: Message) -> Message:
        if CLASSIFIER not in msg.content.array_records:
            return super().train(msg)  # the encoder stage: FedAvg's update of its cluster's model
        cfg, rnd = self.cfg, self.round_of(msg)
        model = self.concat_model(msg)
        gen = seeded_generator(cfg.seed, self.partition_id, rnd)
        order = torch.randperm(len(self.train_data), generator=gen)
        steps = self.train_data.subset(order[: cfg.fedconcat_classifier_steps * cfg.batch_size])
        lr = cfg.fedconcat_classifier_lr or cfg.lr
        loss, _ = train_epochs(model, steps, epochs=1, batch_size=cfg.batch_size, lr=lr,
                               momentum=cfg.momentum, weight_decay=cfg.weight_decay, device=self.device,
                               generator=gen)
        return self.reply(msg, {"num-examples": len(self.train_data), "train-loss": loss},
                          **{CLASSIFIER: to_record(model.classifier)})

    def evaluate(self, msg: Message) -> Message:
        if CLASSIFIER not in msg.content.array_records:
            return Client.evaluate(self, msg)  # the encoder stage: its cluster's model (not a best-of-K)
        return self.scored(msg, self.concat_model(msg))
