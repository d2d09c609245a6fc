"""FedDyn (Acar et al., ICLR 2021), client half: local SGD on the dynamically regularised loss

    L_k(θ) − ⟨∇L_k, θ⟩ + (α/2)·||θ − θ_s||²,

θ_s the received server model, ∇L_k this client's linear term (zero at first), kept in
``context.state``. After the local update, ∇L_k ← ∇L_k − α (θ_k − θ_s) (the first-order
condition of the regularised problem); it is adopted in the next round only if the server took
this reply (``clients/synced.py``). The client uploads θ_k. The official code also divides α
by the client's data share relative to the mean, clips each step's gradient norm to 10 and adds
weight decay 1e-3; flowerbed uses one α, does not clip, and adds weight decay only if
``weight-decay`` says so.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, Message
from torch import nn

from flowerbed.clients.fedavg import proximal
from flowerbed.clients.synced import SyncedStateClient

STATE_KEY = "feddyn.grad"


class FedDynClient(SyncedStateClient):
    state_key = STATE_KEY
    state_name = "linear term"

    def fit(self, model: nn.Module, msg: Message, rnd: int, **hooks):
        self.adopt_pending(msg)
        held = self.held_state()
        alpha = self.cfg.feddyn_alpha
        self._start = {k: p.detach().clone() for k, p in model.named_parameters()}
        self._grad = {k: self.state_tensor(held, k, p) for k, p in model.named_parameters()}
        prox = proximal(model, alpha)

        def regulariser(m: nn.Module) -> torch.Tensor:  # −⟨∇L_k, θ − θ_s⟩: the gradient of
            # −⟨∇L_k, θ⟩, centred so that the reported loss does not depend on θ's size
            linear = sum((self._grad[k] * (p - self._start[k])).sum() for k, p in m.named_parameters())
            return prox(m) - linear

        return super().fit(model, msg, rnd, loss_hook=regulariser, **hooks)

    def extra_arrays(self, model: nn.Module, msg: Message) -> dict[str, ArrayRecord]:
        alpha = self.cfg.feddyn_alpha
        new = {k: Array((self._grad[k] - alpha * (p.detach() - self._start[k])).cpu().numpy())
               for k, p in model.named_parameters()}
        self.file_pending(ArrayRecord(new), msg)
        return {}  # only θ_k travels
