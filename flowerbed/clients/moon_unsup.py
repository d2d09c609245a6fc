"""MOON-unsup: MOON (Li, He & Song, CVPR 2021) in the unsupervised form FedX's appendix compares
with. FedSimCLR's NT-Xent plus ``moon-mu`` times MOON's model-contrastive loss: each view's
projection is pulled towards a frozen copy of the received global model's projection of the
same view and pushed from the client's previous local model's (``moon-tau``;
:func:`flowerbed.losses.model_contrastive`), averaged over the two views. The previous local
model is the client's upload of its last training round, kept in ``context.state``; a client
without one (its first training round, or its state lost) trains on NT-Xent alone, as MOON's
code, which has no negative in its first round, adds nothing there.
"""

from __future__ import annotations

import copy

import torch
from flwr.app import Message

from flowerbed.clients.fedsimclr import SimCLRClient
from flowerbed.losses import model_contrastive
from flowerbed.models.ssl import SSLNet
from flowerbed.training import to_record

PREVIOUS = "moon.previous"


class MoonUnsupClient(SimCLRClient):
    keeps_state = True

    def prepare(self, model: SSLNet, msg: Message) -> None:
        super().prepare(model, msg)
        self.global_model = copy.deepcopy(model).eval().requires_grad_(False)
        previous = self.state_model(PREVIOUS)
        self.previous = previous.eval().requires_grad_(False) if previous is not None else None

    def loss(self, model, v, x1, x2, xr):
        simclr = super().loss(model, v, x1, x2, xr)
        if self.previous is None:
            return simclr
        x = torch.cat([x1, x2])
        with torch.no_grad():
            _, zg, _ = self.global_model(x)
            _, zp, _ = self.previous(x)
        z = torch.cat([v["z1"], v["z2"]])
        return simclr + self.cfg.moon_mu * model_contrastive(z, zg, zp, self.cfg.moon_tau)

    def finish(self, model: SSLNet) -> dict[str, float]:
        self.keep_model(PREVIOUS, to_record(model))
        return super().finish(model)
