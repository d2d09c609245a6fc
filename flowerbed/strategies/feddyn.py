"""FedDyn (Acar et al., ICLR 2021), server half: dynamic regularisation.

Each client k keeps the linear term of its regulariser, ∇L_k (``clients/feddyn.py``), and
returns its model θ_k. With P this round's participants, m all clients and θ the model the round
started from, the server updates

    h ← h − α (1/m) Σ_{k∈P} (θ_k − θ),      θ ← (1/|P|) Σ_{k∈P} θ_k − h/α

(α = ``feddyn-alpha``; an unweighted mean, as the paper and the official code). h starts at
zero and covers the parameters; the buffers (BatchNorm's running statistics) take the
sample-weighted mean, as FedAvg's. h must stay −α/m times the sum of the client updates it
took, so a client adopts its new ∇L_k only once the server took its reply
(``strategies/synced.py``).

Which model is scored (``feddyn-eval``): ``served``, θ above, the model the server sends (and
keeps in model.pt); or ``average``, the plain mean of the round's uploads (1/|P|) Σ θ_k, which
the official code scores (its ``avg_model``; it sends θ, its ``cld_model``). Both the server's
test-set score and the clients' local scores use it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from flowerbed.strategies.base import cast_like
from flowerbed.strategies.synced import SyncedStateStrategy
from flowerbed.training import is_finite


class FedDynStrategy(SyncedStateStrategy):
    checkpoint_attrs = ("h", "accepted")  # the server state h; whose replies it holds

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.h: dict[str, np.ndarray] = {}
        self._average: ArrayRecord | None = None  # the round's mean upload (feddyn-eval='average')

    def scored(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model to score after a round whose served model is ``arrays``."""
        if self.cfg.feddyn_eval == "average" and self._average is not None:
            return self._average
        return arrays

    def evaluate_global(self, server_round, arrays, train, test, device):
        return super().evaluate_global(server_round, self.scored(arrays), train, test, device)

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        return super().eval_content(self.scored(arrays))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, new, params = taken  # new: the mean, kept for the buffers
        alpha = self.cfg.feddyn_alpha
        m = self.all_clients(len(valid))
        average = {k: v for k, v in new.items()}  # (buffers: FedAvg's mean, as the served model's)
        h = {}
        for k in params:
            total = np.zeros(self._reference[k].numpy().shape)  # Σ_P θ_k, float64, one at a time
            for r in valid:
                total += r.content["arrays"][k].numpy()
            delta = total - len(valid) * self._reference[k].numpy().astype(np.float64)
            h[k] = self.h.get(k, 0.0) - alpha / m * delta
            average[k] = Array(np.asarray(total / len(valid)))
            new[k] = Array(np.asarray(total / len(valid) - h[k] / alpha))
        out = cast_like(ArrayRecord(new), self._reference)
        if is_finite(out):  # else refused by the round loop: h and the clients' state stay as they are
            self.h.update(h)
            self.took(server_round, self.round.ok)
            self._average = cast_like(ArrayRecord(average), self._reference)
        return out, self.client_metrics(valid)
