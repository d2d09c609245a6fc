"""FedXDS's privatisation of shared samples: attribution mask, L2 clipping, Gaussian noise.

Per sample (in normalised pixel space): ĥ = min-max normalised heatmap in [0, 1]; keep exactly
the top (1 − s)·HW pixels (s = ``fedxds-sparsity``, the fraction removed); mask m = 1 there
(``binary``, the paper's description) or m = ĥ there (``soft``, the official code), 0 elsewhere;
x̃ = x ⊙ m; clip ‖x̃‖₂ to C; add N(0, σ²) to every element, masked-out zeros included.

σ is given directly or calibrated from (ε, δ): for a fixed mask with entries in [0, 1] the map
x ↦ x ⊙ m is 1-Lipschitz in ℓ2, so one Gaussian release gives (ε, δ) metric privacy per unit ℓ2
distance. The calibration uses opacus' accountant (a single Gaussian-mechanism step at sample
rate 1, RDP), a maintained implementation, instead of a hand-written formula; the classic bound
√(2 ln(1.25/δ))/ε is reported alongside for reference.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch


def sparsify(heat: torch.Tensor, sparsity: float, kind: str = "binary") -> torch.Tensor:
    """[N, H, W] heatmaps -> [N, H, W] masks keeping exactly round((1 − s)·HW) pixels each."""
    n = heat.shape[0]
    flat = heat.reshape(n, -1).float()
    lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    norm = (flat - lo) / (hi - lo).clamp_min(1e-12)
    keep = int(round(flat.shape[1] * (1 - sparsity)))
    mask = torch.zeros_like(norm)
    if keep > 0:
        idx = norm.topk(keep, dim=1).indices
        mask.scatter_(1, idx, 1.0)
    if kind == "soft":
        mask = mask * norm
    elif kind != "binary":
        raise ValueError(f"unknown mask kind '{kind}' (binary, soft)")
    return mask.reshape(heat.shape)


def clip_l2(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each sample down to L2 norm <= ``max_norm``."""
    norms = x.reshape(len(x), -1).norm(dim=1).clamp_min(1e-12)
    factor = (max_norm / norms).clamp(max=1.0)
    return x * factor.view(-1, *([1] * (x.dim() - 1)))


def add_noise(x: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """x + N(0, σ²I), drawn on the generator's device (a seeded CPU draw is the same wherever x
    lies) and added on x's (one copy of the noise to a GPU, none of x)."""
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=generator.device)
    return x + sigma * noise.to(x.device)


def _opacus() -> tuple[Any, Any]:
    """opacus' RDPAccountant and get_noise_multiplier. opacus calls ``logging.basicConfig`` when
    imported, which gave the root logger a handler and printed every Flower log line twice;
    with a handler already there that call does nothing."""
    root, guard = logging.getLogger(), logging.NullHandler()
    root.addHandler(guard)
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.utils import get_noise_multiplier
    finally:
        root.removeHandler(guard)
    return RDPAccountant, get_noise_multiplier


def sigma_for(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Gaussian-mechanism noise for (ε, δ) per unit ℓ2 distance, by opacus' RDP accountant."""
    get_noise_multiplier = _opacus()[1]
    return sensitivity * get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                              sample_rate=1.0, steps=1, accountant="rdp",
                                              epsilon_tolerance=0.001)


def epsilon_for(sigma: float, delta: float, sensitivity: float = 1.0) -> float:
    """The ε (per unit distance) that opacus' RDP accountant gives one release at noise σ."""
    acc = _opacus()[0]()
    acc.history = [(sigma / sensitivity, 1.0, 1)]
    return float(acc.get_epsilon(delta))


def classic_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """The textbook bound σ = √(2 ln(1.25/δ))·Δ/ε (valid for ε < 1), for reference."""
    return math.sqrt(2 * math.log(1.25 / delta)) * sensitivity / epsilon


def privatise(x: torch.Tensor, heat: torch.Tensor | None, *, sparsity: float, mask_kind: str,
              clip: float, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """Mask by ``heat`` (or not, ``mask_kind='none'``: ``heat`` unused), clip and noise
    normalised images [N, C, H, W] (FedFed's x_s too, unmasked)."""
    if mask_kind != "none":
        x = x * sparsify(heat, sparsity, mask_kind).unsqueeze(1)
    return add_noise(clip_l2(x, clip), sigma, generator)
