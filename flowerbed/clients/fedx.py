"""FedX (Han et al., ECCV 2022): local and global cross knowledge distillation, as an add-on.

On top of the base method's loss (``fedx-base``: SimCLR's NT-Xent, BYOL's regression, FedU's
(BYOL's regression, the predictor kept locally when the client has diverged), MoCo's InfoNCE
against its queue, or ProtoCL's InfoNCE + prototype terms):

    L_local  = base + JS(z1, z2; A = zr; τ, τ_s)                     (``fedx-local-kd``)
    L_global = NTXent(p1, z2ᵍ; τ) + JS(p1, p2; A = zrᵍ; τ, τ_t)      (``fedx-global-kd``)

z are local projections, p local predictions, ·ᵍ projections of a frozen copy of the received
global model (eval mode, no gradient); the anchor set A is an independent random batch of the
client's own data. With ``fedx-global='prox'`` (the paper's Table 2 comparison) L_global is
instead FedProx's (``proximal-mu``/2)·‖w − w_g‖² to the received model, and with
``fedx-global='scaffold'`` (the table's other one) SCAFFOLD's gradient correction g − c_i + c,
the control variates kept and exchanged as SCAFFOLD's (``clients/scaffold.py``). Over BYOL and FedU, p
comes from BYOL's predictor (``fedx-head='shared'``) or from a
prediction head of FedX's own (``'separate'``: the paper's "additional prediction head"). JS is
:func:`flowerbed.losses.relational_loss` in the ``fedx-relational`` form. All weights are 1, as
in the official code. Each term's mean over the round's samples, as ``train-loss``'s, goes into
the client's metrics (``fedx-loss-base``, ``-local-relational``, ``-global-contrastive``,
``-global-relational``, ``-prox``), and so into ``metrics.jsonl`` and the round's progress line,
weighted over clients as ``train-loss`` is: where a run's loss goes, term by term.
"""

from __future__ import annotations

import copy

import torch
from flwr.app import Context, Message

from flowerbed.clients.fedavg import proximal
from flowerbed.clients.fedbyol import BYOLClient
from flowerbed.clients.fedmoco import MoCoClient
from flowerbed.clients.fedprotocl import ProtoCLClient
from flowerbed.clients.fedsimclr import SimCLRClient, SSLClient
from flowerbed.clients.fedu import FedUClient
from flowerbed.clients.scaffold import ScaffoldClient
from flowerbed.config import Config
from flowerbed.losses import nt_xent, relational_loss
from flowerbed.models.ssl import SSLNet


class FedXMixin:
    random_batch = True

    def prepare(self, model: SSLNet, msg: Message) -> None:
        super().prepare(model, msg)
        self.prox = proximal(model, self.cfg.proximal_mu) if self.cfg.fedx_global == "prox" else None
        self.global_model = None  # the frozen copy: only the global KD terms read it
        if self.cfg.fedx_global_kd and self.cfg.fedx_global == "kd":
            self.global_model = copy.deepcopy(model).eval()
            self.global_model.requires_grad_(False)
        self.term_names: list[str] = []
        self.term_sums: torch.Tensor | None = None  # each term's sum over the round's samples
        self.term_samples = 0

    def loss(self, model, v, x1, x2, xr):
        cfg = self.cfg
        terms = {"base": super().loss(model, v, x1, x2, xr)}
        if cfg.fedx_local_kd:
            terms["local-relational"] = relational_loss(v["z1"], v["z2"], v["zr"], cfg.ssl_tau,
                                                        cfg.fedx_tau_local, cfg.fedx_relational)
        if cfg.fedx_global_kd and self.prox is not None:
            terms["prox"] = self.prox(model)
        elif self.global_model is not None:
            with torch.no_grad():
                _, zg, _ = self.global_model(torch.cat([x2, xr]))
            zg2, zgr = zg.split([len(x2), len(xr)])
            # through the prediction head: BYOL's predictor, or FedX's own (fedx-head='separate')
            p1, p2 = ((model.kd_head(v["z1"]), model.kd_head(v["z2"])) if model.kd_head is not None
                      else (v["p1"], v["p2"]))
            terms["global-contrastive"] = nt_xent(p1, zg2, cfg.ssl_tau)
            terms["global-relational"] = relational_loss(p1, p2, zgr, cfg.ssl_tau,
                                                         cfg.fedx_tau_target, cfg.fedx_relational)
        # weighted by the batch's samples, as train-loss is; summed on the device, read in finish()
        # (a read here would wait for the forward pass before backward could be queued)
        n = len(x1)
        step = torch.stack([v.detach() for v in terms.values()]).double() * n
        self.term_sums = step if self.term_sums is None else self.term_sums + step
        self.term_names, self.term_samples = list(terms), self.term_samples + n
        return sum(terms.values())  # left to right, as before these metrics: the same value

    def finish(self, model: SSLNet) -> dict[str, float]:
        means = [] if self.term_sums is None else (self.term_sums / self.term_samples).tolist()
        return {**super().finish(model),
                **{f"fedx-loss-{k}": v for k, v in zip(self.term_names, means, strict=True)}}


class FedXSimCLRClient(FedXMixin, SimCLRClient):
    """FedX on FedSimCLR."""


class FedXBYOLClient(FedXMixin, BYOLClient):
    """FedX on FedBYOL."""


class FedXFedUClient(FedXMixin, FedUClient):
    """FedX on FedU (one of the paper's bases): FedU's predictor rule, then FedX's frozen copy of
    the received encoder and projector (the global terms never read the copy's predictor)."""


class FedXMoCoClient(FedXMixin, MoCoClient):
    """FedX on FedMoCo (the predictor, which MoCo does not use, is FedX's prediction head)."""


class FedXProtoCLClient(FedXMixin, ProtoCLClient):
    """FedX on FedProtoCL (as over MoCo, the predictor is FedX's prediction head)."""


BASES: dict[str, type[SSLClient]] = {"simclr": FedXSimCLRClient, "byol": FedXBYOLClient,
                                     "fedu": FedXFedUClient, "moco": FedXMoCoClient,
                                     "protocl": FedXProtoCLClient}


class FedXScaffoldMixin:
    """``fedx-global='scaffold'``: SCAFFOLD's correction in every step, its c_i filed and its Δc_i
    sent back as ScaffoldClient's."""

    def grad_hook(self, model, msg):
        return self.correction(model, msg)


#: each base with SCAFFOLD's client state and correction
SCAFFOLD_BASES: dict[str, type[SSLClient]] = {
    k: type(f"{v.__name__}Scaffold", (FedXScaffoldMixin, v, ScaffoldClient), {}) for k, v in BASES.items()}


def fedx_client(cfg: Config, context: Context) -> SSLClient:
    """The FedX client over the base named by ``fedx-base`` (with SCAFFOLD's state for
    ``fedx-global='scaffold'``)."""
    return (SCAFFOLD_BASES if cfg.fedx_global == "scaffold" else BASES)[cfg.fedx_base](cfg, context)
