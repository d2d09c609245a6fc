"""FedFed (Yang et al., NeurIPS 2023), server half: FedXDS's phases with feature distillation.

One of the FedXDS paper's data-sharing baselines (its closest competitor there: 82.58 against
83.46 % on CIFAR-10 with 100 clients). The warm-up rounds (``fedxds-warmup-rounds``) send and
FedAvg a VAE with its own classifier (:class:`~flowerbed.models.fedfed_vae.FedFedNet`) instead of
the FL model, which stays at its initial weights meanwhile (the code trains the FL model from
scratch after its 15 VAE rounds). Clients train the VAE in all of them but the last, the share
round, in which every client uploads its performance-sensitive features x_s = x − VAE(x) under
the VAE it received (the federation's), clipped and noised as FedXDS's samples; so
``fedxds-warmup-rounds`` = the code's VAE rounds + 1. The server pools them into D_g and the main
rounds are FedXDS's: FedAvg on CE(local) + λ·CE(D_g). The VAE is in the checkpoint until D_g
exists; evaluation during the VAE rounds scores the untrained FL model, which is what FedFed has
then.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from flowerbed.clients.fedfed import make_fedfed_net
from flowerbed.strategies.base import log
from flowerbed.strategies.fedxds import FedXDSStrategy
from flowerbed.training import cpu_seeded, is_finite, to_record


class FedFedStrategy(FedXDSStrategy):
    checkpoint_attrs = (*FedXDSStrategy.checkpoint_attrs, "vae")

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.vae: ArrayRecord | None = None  # the VAE and its classifier, FedAvg'd
        self._model: ArrayRecord | None = None  # the FL model, kept aside in a VAE round

    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        with cpu_seeded(self.cfg.seed):  # the FL model's initialisation is every method's
            self.vae = to_record(make_fedfed_net(self.cfg))
        return super().initial_arrays(model)

    def check_setup(self, num_partitions: int) -> None:
        super().check_setup(num_partitions)
        if self.cfg.fedxds_warmup_rounds < 2:  # (tests run it so, for the plumbing)
            log.warning("fedxds-warmup-rounds=%d trains no VAE (its last warm-up round is the share "
                        "round): x_s = x - VAE(x) of an untrained VAE is close to the whole image, "
                        "so this run shares clipped, noised images, not FedFed's features; use >= 2 "
                        "(the code's VAE rounds + 1)", self.cfg.fedxds_warmup_rounds)

    def describe(self) -> dict:
        out = super().describe()
        if out["fedxds-epsilon-per-unit-l2"] is not None:
            out["fedxds-epsilon-note"] = (
                "Gaussian mechanism, one release, per unit L2 distance between clipped features "
                "x_s (not between images: x -> x - VAE(x) is not 1-Lipschitz); any two clipped "
                "x_s are at most 2 x fedxds-clip apart (opacus RDP)")
        return out

    def _restarts(self, server_round: int) -> bool:
        return False  # the FL model has not moved during the VAE rounds

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.phase(server_round) != "main":  # the VAE goes out and comes back in its place
            self._model, arrays = arrays, self.vae
        else:  # D_g is made: neither the VAE nor the initial weights are needed any more
            self._model = self.vae = self._initial = None
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if self.phase(server_round) == "main":  # the FL model came back
            return arrays, metrics
        if arrays is not None and not is_finite(arrays):  # valid replies, too big a step
            log.warning("round %d: FedFed's averaged VAE holds NaN or inf; it is kept unchanged",
                        server_round)
            self.round.skipped = self.round.diverged = True
            arrays = None
        if arrays is not None:
            self.vae = arrays
        return (None if arrays is None else self._model), metrics
