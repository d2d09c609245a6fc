"""FedU (Zhuang et al., ICCV 2021): FedBYOL with a divergence-aware predictor update.

The online encoder (backbone + projector) always starts from the global model. The predictor
starts from the global one only when the client's last local encoder is within ``fedu-mu``
(L2 distance over the encoder's parameters, BatchNorm buffers excluded) of the global encoder;
otherwise the client keeps its own predictor. The distance is the paper's ‖W_g − W_k‖ over the
whole encoder; EasyFL's FedSSL code averages per-layer distances over convolution weights only,
which on a ResNet-8 after one round is about 12× smaller, so its μ values do not carry over.
"""

from __future__ import annotations

import torch
from flwr.app import Message

from flowerbed.clients.fedbyol import BYOLClient
from flowerbed.models.ssl import SSLNet
from flowerbed.training import is_finite, to_record

LOCAL = "fedu.online"


class FedUClient(BYOLClient):
    kept_with_target = (LOCAL,)
    def prepare(self, model: SSLNet, msg: Message) -> None:
        super().prepare(model, msg)
        self.divergence: float | None = None  # no local model yet: nothing to compare, not 0
        local = self.context.state.array_records.get(LOCAL)
        if local is None or not is_finite(local):  # (a NaN one is not kept past this round)
            return
        sd = local.to_torch_state_dict()
        # the encoder's weights only: BatchNorm buffers (running stats, num_batches_tracked,
        # which counts local steps) are not weights and would dominate the distance
        enc = {k: p for k, p in model.named_parameters() if k.startswith(("backbone.", "projector."))}
        self.divergence = float(torch.sqrt(sum(((sd[k].float() - p.detach().float().cpu()) ** 2).sum()
                                               for k, p in enc.items())))
        if self.divergence >= self.cfg.fedu_mu:
            model.load_state_dict({k: v for k, v in sd.items() if k.startswith("predictor.")},
                                  strict=False)

    def finish(self, model: SSLNet) -> dict[str, float]:
        self.keep_model(LOCAL, to_record(model), self.target_key)
        if self.divergence is None:  # (the round's mean is over the clients that compared)
            return super().finish(model)
        return {**super().finish(model), "fedu-divergence": self.divergence,
                "fedu-kept-local-predictor": float(self.divergence >= self.cfg.fedu_mu)}
