"""Self-supervised and distillation losses (NT-Xent, MoCo's InfoNCE, PCL's prototype term, FedX's
relational loss, BYOL)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def nt_xent(u: torch.Tensor, v: torch.Tensor, tau: float) -> torch.Tensor:
    """NT-Xent (SimCLR): row i of ``u`` and row i of ``v`` are positives, the other 2n−2 negatives.

    loss = −mean_i log( exp(sim(i, pos(i))/τ) / Σ_{j≠i} exp(sim(i, j)/τ) ) over the 2n rows.
    """
    n = u.shape[0]
    z = F.normalize(torch.cat([u, v]), dim=1)
    sim = z @ z.T / tau
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, target)


def moco_loss(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, tau: float) -> torch.Tensor:
    """MoCo's InfoNCE: query i's positive is key i, its negatives the queue's rows (not the batch).

    loss = −mean_i log( exp(q_i·k_i/τ) / (exp(q_i·k_i/τ) + Σ_j exp(q_i·n_j/τ)) ), on L2-normalised
    q, k and queue rows; ``k`` and ``queue`` (the momentum encoder's keys) get no gradient.
    """
    q = F.normalize(q, dim=1)
    k = F.normalize(k.detach(), dim=1)
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ F.normalize(queue.detach(), dim=1).T], 1)
    return F.cross_entropy(logits / tau, torch.zeros(len(q), dtype=torch.long, device=q.device))


def relational_loss(u1: torch.Tensor, u2: torch.Tensor, anchors: torch.Tensor, tau: float,
                    tau_target: float, form: str = "official") -> torch.Tensor:
    """FedX's relational loss: similarity distributions of two views over an anchor set agree.

    s_v = norm(u_v) · norm(A)ᵀ, P_v = softmax(s_v / τ).
    - ``official`` (the FedX code's ``js_loss``): target M = ½(softmax(s1/τ') + softmax(s2/τ')),
      not detached; loss = ½[KL(M‖P1) + KL(M‖P2)], batch mean.
    - ``js``: the textbook Jensen–Shannon divergence ½KL(P1‖M) + ½KL(P2‖M) with M = ½(P1 + P2).
    """
    a = F.normalize(anchors, dim=1)
    s1 = F.normalize(u1, dim=1) @ a.T
    s2 = F.normalize(u2, dim=1) @ a.T
    # in log space: at small τ (or τ') a softmax entry underflows to 0, and M log M's gradient
    # (official: M is not detached) or log(½(p1 + p2)) (js) is NaN or −inf
    lp1, lp2 = F.log_softmax(s1 / tau, dim=1), F.log_softmax(s2 / tau, dim=1)
    if form == "official":
        log_m = _log_mean(F.log_softmax(s1 / tau_target, dim=1), F.log_softmax(s2 / tau_target, dim=1))
        return 0.5 * (F.kl_div(lp1, log_m, reduction="batchmean", log_target=True)
                      + F.kl_div(lp2, log_m, reduction="batchmean", log_target=True))
    if form == "js":
        log_m = _log_mean(lp1, lp2)
        return 0.5 * (F.kl_div(log_m, lp1, reduction="batchmean", log_target=True)
                      + F.kl_div(log_m, lp2, reduction="batchmean", log_target=True))
    raise ValueError(f"unknown relational loss form '{form}' (official, js)")


def _log_mean(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """log(½(p + q)) from log p and log q."""
    return torch.logsumexp(torch.stack([logp, logq]), dim=0) - math.log(2.0)


def byol_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """BYOL's regression loss 2 − 2·cos(p, z), batch mean; ``z`` (the target) gets no gradient."""
    return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=1)).mean()


def proto_nce(q: torch.Tensor, prototypes: torch.Tensor, phi: torch.Tensor,
              assign: torch.Tensor) -> torch.Tensor:
    """PCL's prototype term (Li et al., ICLR 2021) for one clustering: query i's positive is
    its cluster's prototype, the other prototypes are its negatives, each prototype's logit at
    its own temperature (concentration) φ_j:

    loss = −mean_i log( exp(q_i·c_{s(i)}/φ_{s(i)}) / Σ_j exp(q_i·c_j/φ_j) ), on L2-normalised q
    and c; prototypes and φ get no gradient. PCL samples r negative prototypes per batch, which
    needs tens of thousands of clusters; with tens (a client's data) every prototype takes part.
    """
    logits = F.normalize(q, dim=1) @ F.normalize(prototypes.detach(), dim=1).T / phi.detach()
    return F.cross_entropy(logits, assign)


def model_contrastive(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor,
                      tau: float) -> torch.Tensor:
    """MOON's model-contrastive loss: each row's positive is the global model's projection of the
    same input, its one negative the client's previous local model's.

    loss = −mean_i log( e^{cos(z_i, zg_i)/τ} / (e^{cos(z_i, zg_i)/τ} + e^{cos(z_i, zp_i)/τ}) );
    ``z_global`` and ``z_previous`` get no gradient.
    """
    pos = F.cosine_similarity(z, z_global.detach(), dim=1)
    neg = F.cosine_similarity(z, z_previous.detach(), dim=1)
    logits = torch.stack([pos, neg], 1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))
