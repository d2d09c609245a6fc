"""FedCC client (Ye et al.): an "unknown" class, calibrated pseudo-labels, three stages a round.

Each round, with the model kept in ``context.state``:

1. sync (from round 2): distil towards the server's soft targets on the public set, KL;
2. supervised fit on the private labelled data (C+1 outputs; labels are never "unknown");
3. compute, with this model θ0, the class bias p = σ(f(x0)) on a featureless input x0, the
   smoothed p̃ = (1−δ)p + δ/C, w_l = H(p̃), the majority classes C_J = {c: p_c > 2 %},
   w_u = log(C − |C_J| + 1), per public sample α(x) = (w_l − min(w_l, H(σ(f(x))))) / (w_l + w_u),
   m(x) = argmax_{c∈C_J} f_c(x) and ŷ(x) = α e_m + (1 − α) e_u; then fit L_l + λ·L_u where
   L_u is the cross-entropy with ŷ on public batches;
4. upload σ(f(x)) ∈ Δ^{C+1} for every public sample: the only thing that leaves the client.

Flags for the paper's ambiguities (papers.md §3): ``fedcc-unknown-in-entropy`` (p and H over the
C known logits, the default, or all C+1), ``fedcc-distill-target`` (``pad``: target 0 for
unknown against the (C+1)-softmax, default; ``known``: the C-softmax), ``fedcc-probe-input``,
and the epochs of each stage (``distill-epochs``, ``local-epochs``, ``fedcc-ssl-epochs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.distill import DistillClient
from flowerbed.training import cycled_batches, predict


@dataclass
class Calibration:
    """FedCC's per-client quantities for one round (tensors on the CPU)."""

    w_l: float
    w_u: float
    majority: torch.Tensor   # [C] bool
    alpha: torch.Tensor      # [N]
    m: torch.Tensor          # [N] majority-class argmax
    pseudo: torch.Tensor     # [N, C+1]


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Natural-log entropy along the last dimension."""
    return -(p * torch.log(p.clamp_min(1e-12))).sum(-1)


def calibrate(bias_logits: torch.Tensor, public_logits: torch.Tensor, *, delta: float,
              majority: float, unknown_in_entropy: bool = False) -> Calibration:
    """The pseudo-labels of FedCC's Eq. 5-9 from the bias logits [C+1] and public logits [N, C+1]."""
    c = public_logits.shape[1] - 1
    width = c + 1 if unknown_in_entropy else c
    p = torch.softmax(bias_logits[:width].double(), -1)
    p_pub = torch.softmax(public_logits[:, :width].double(), -1)
    p_smooth = (1 - delta) * p + delta / width
    w_l = float(entropy(p_smooth))
    major = p[:c] > majority
    if not major.any():  # cannot happen for C <= 50 (max p >= 1/C), guarded for C = 100
        major[p[:c].argmax()] = True
    w_u = float(torch.log(torch.tensor(float(c - int(major.sum()) + 1))))
    w_x = torch.minimum(entropy(p_pub), torch.tensor(w_l, dtype=torch.float64))
    denom = w_l + w_u
    alpha = (w_l - w_x) / denom if denom > 0 else torch.zeros_like(w_x)
    masked = public_logits[:, :c].double().masked_fill(~major, float("-inf"))
    m = masked.argmax(1)
    pseudo = torch.zeros(len(m), c + 1, dtype=torch.float64)
    pseudo[torch.arange(len(m)), m] = alpha
    pseudo[:, c] += 1 - alpha
    return Calibration(w_l, w_u, major, alpha.float(), m, pseudo.float())


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -(targets * F.log_softmax(logits, 1)).sum(1).mean()


class FedCCClient(DistillClient):
    extra_outputs = 1

    def probe_input(self) -> torch.Tensor:
        """The featureless input x0 (a solid image), normalised like every batch."""
        c, h, w = self.train_data.shape
        if self.cfg.fedcc_probe_input == "mean":  # the data set's mean colour = 0 after normalising
            return torch.zeros(1, c, h, w, device=self.device)
        value = 0 if self.cfg.fedcc_probe_input == "black" else 255
        raw = torch.full((1, c, h, w), value, dtype=torch.uint8, device=self.device)
        return self.train_data.normalise(raw)

    def calibration(self, model: nn.Module) -> Calibration:
        model.eval()
        with torch.no_grad():
            bias = model(self.probe_input())[0].cpu()
        logits = predict(model, self.public, self.device, probabilities=False)
        cfg = self.cfg
        return calibrate(bias, logits, delta=cfg.fedcc_delta, majority=cfg.fedcc_majority,
                         unknown_in_entropy=cfg.fedcc_unknown_in_entropy)

    def distill_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.cfg.fedcc_distill_target == "pad":
            padded = torch.cat([targets, torch.zeros(len(targets), 1, device=targets.device)], 1)
            return F.kl_div(F.log_softmax(logits, 1), padded, reduction="batchmean")
        return F.kl_div(F.log_softmax(logits[:, :-1], 1), targets, reduction="batchmean")

    def local_update(self, model, targets, gen):
        cfg = self.cfg
        out = super().local_update(model, targets, gen)  # sync (distillation), supervised fit
        cal = self.calibration(model)
        if cfg.fedcc_ssl_epochs:
            out["train-loss"] = self.fit_private(model, gen, cfg.fedcc_ssl_epochs,
                                                 loss_hook=self._unlabelled_term(cal, gen))
        out.update({"fedcc-w-l": cal.w_l, "fedcc-w-u": cal.w_u,
                    "fedcc-majority-classes": float(cal.majority.sum()),
                    "fedcc-mean-alpha": float(cal.alpha.mean())})
        return out

    def _unlabelled_term(self, cal: Calibration, gen: torch.Generator):
        """λ·L_u on the next public batch, added to every private batch's loss."""
        stream = cycled_batches(len(self.public), self.cfg.batch_size, gen)

        def hook(m: nn.Module) -> torch.Tensor:
            idx = next(stream)
            xb = self.public.normalise(self.public.x[idx].to(self.device))
            return self.cfg.fedcc_lambda * soft_cross_entropy(m(xb), cal.pseudo[idx].to(self.device))

        return hook

    def global_accuracy(self, preds: torch.Tensor, y: torch.Tensor) -> float:
        """The paper's local-model accuracy on global test data: predicting "unknown" for a
        sample whose class is not one of this client's majority classes counts as correct."""
        major = self.calibration(self.local_model()).majority
        pred = preds.argmax(1)
        unknown = preds.shape[1] - 1
        ok = (pred == y) | ((pred == unknown) & ~major[y])
        return float(ok.float().mean())
