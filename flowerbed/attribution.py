"""Per-sample attribution maps through captum, conditioned on each sample's true label.

Methods: ``lrp`` (captum's LRP with the paper's composite, zennit's EpsilonPlusFlat: the flat rule
on the first layer, α1β0 on the other convolutions, ε on dense layers, identity for skip
connections and for BatchNorm (zennit merges it into the convolution before it); captum's
default ε-rule everywhere would make LRP equal Input×Gradient on a ReLU network, and captum has
no flat rule, so ``FlatRule`` below adds it), ``ig`` (Integrated Gradients, zero baseline),
``ixg`` (Input×Gradient) and ``smoothgrad`` (NoiseTunnel over Saliency).

Model support: the CNN and the ResNets run every method. LRP needs every layer to be a module
with a rule, so both networks flatten functionally and use one ReLU/pooling module per use; in
the ResNets the residual addition is a module (``models.resnet.Add``) with the ε-rule, so the
relevance is split between the two branches by their shares of the sum, as captum's
``Addition_Module`` is (a functional ``+`` gave each branch all of it).
"""

from __future__ import annotations

import torch
from torch import nn

from flowerbed.models.resnet import Add

METHODS = ("lrp", "ig", "ixg", "smoothgrad")
LRP_FIRST = ("flat", "alpha1beta0")  # LRP's rule on the first layer: the paper's composite | α1β0


def _flat_rule():
    from captum.attr._utils.lrp_rules import EpsilonRule

    class FlatRule(EpsilonRule):
        """LRP's flat rule (zennit's ``Flat``), for the first layer: the layer is evaluated with
        unit weights, no bias and unit inputs, so each output's relevance is spread evenly over
        its receptive field, whatever the signs of the (normalised) pixels and weights."""

        def _manipulate_weights(self, module, inputs, outputs) -> None:
            module.weight.data = torch.ones_like(module.weight.data)
            if module.bias is not None:
                module.bias.data = torch.zeros_like(module.bias.data)

        def forward_pre_hook_activations(self, module, inputs):
            # captum's LRP feeds the layer ``input + 0`` (a copy), so the caller's tensor is untouched
            for inp, act in zip(inputs, module.activations[inputs[0].device], strict=True):
                inp.data = torch.ones_like(act)
            return inputs

    return FlatRule(epsilon=1e-9)


def _set_lrp_rules(model: nn.Module, first_rule: str = "flat") -> None:
    """The composite's rules on ``model``'s layers; ``first_rule='alpha1beta0'`` gives the first
    layer α1β0 like the other convolutions. captum's rule clamps the weights only, which is the
    z⁺ rule on ReLU outputs but not on signed, normalised pixels (x⁻w⁺ terms stay): relevance is
    conserved, but single pixels get large values that cancel."""
    from captum.attr._utils.lrp_rules import Alpha1_Beta0_Rule, EpsilonRule, IdentityRule

    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear))
    for m in model.modules():
        if m is first and first_rule == "flat":
            m.rule = _flat_rule()
        elif isinstance(m, nn.Conv2d):
            m.rule = Alpha1_Beta0_Rule()
        elif isinstance(m, nn.Linear):
            m.rule = EpsilonRule(epsilon=1e-6)
        elif isinstance(m, Add):  # the residual sum: relevance split by each branch's share
            m.rule = EpsilonRule(epsilon=1e-9)  # (captum's rule for its Addition_Module)
        elif isinstance(m, nn.Identity | nn.BatchNorm2d):
            # BatchNorm (the ResNets): relevance passes unchanged, as if merged into the conv
            # before it; captum's default ε-rule divided by its near-zero inputs
            m.rule = IdentityRule()


def attribute(model: nn.Module, x: torch.Tensor, y: torch.Tensor, method: str = "lrp",
              batch_size: int = 256, lrp_first: str = "flat") -> torch.Tensor:
    """Relevance of each input element for the true-class logit, summed over channels: [N, H, W].
    ``lrp_first``: LRP's rule on the first layer (``flat``, the paper's composite, or
    ``alpha1beta0``)."""
    if method not in METHODS:
        raise ValueError(f"unknown attribution method '{method}'; known: {', '.join(METHODS)}")
    if lrp_first not in LRP_FIRST:
        raise ValueError(f"unknown LRP first-layer rule '{lrp_first}'; known: {', '.join(LRP_FIRST)}")
    # captum imported here, not at module level: only FedXDS clients need it, and every deployed
    # ClientApp process (one per message) would pay its import time
    from captum.attr import LRP, InputXGradient, IntegratedGradients, NoiseTunnel, Saliency

    model.eval()
    if method == "lrp":
        explainer = LRP(model)
    elif method == "ig":
        explainer = IntegratedGradients(model)
    elif method == "ixg":
        explainer = InputXGradient(model)
    else:
        explainer = NoiseTunnel(Saliency(model))
    out = []
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size].clone().requires_grad_(True)
        yb = y[start:start + batch_size]
        if method == "lrp":
            # captum's LRP.attribute removes every layer's rule when it returns (its defaults, the
            # ε-rule, would take over in the next batch), so the rules are set for each batch
            _set_lrp_rules(model, lrp_first)
        # IG's 16 steps and SmoothGrad's 8 noisy copies are run batch_size inputs at a time, not
        # all at once (16 x 256 ResNet inputs in one backward pass could fill a shared GPU)
        if method == "ig":
            a = explainer.attribute(xb, target=yb, n_steps=16, internal_batch_size=len(xb))
        elif method == "smoothgrad":
            a = explainer.attribute(xb, target=yb, nt_type="smoothgrad", nt_samples=8, stdevs=0.15,
                                    abs=False, nt_samples_batch_size=1)
        else:
            a = explainer.attribute(xb, target=yb)
        out.append(a.detach().sum(1))
    return torch.cat(out)
