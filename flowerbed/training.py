"""The few local loops every method reuses: seeding, batching, a supervised epoch, evaluation."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn
from torch.nn import functional as F

from flowerbed.datasets import DataSet

log = logging.getLogger("flowerbed")

LossHook = Callable[[nn.Module], torch.Tensor]
GradHook = Callable[[nn.Module], None]
BatchHook = Callable[[torch.Tensor, torch.Tensor], None]
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def cpu_seeded(seed: int):
    """Draws from the CPU's global generator seeded with ``seed`` (a model's initialisation,
    built on the CPU), its state put back afterwards. Other devices' generators are left alone:
    ``torch.manual_seed`` would reseed CUDA's for good (fork_rng(devices=[]) puts back the
    CPU's only), and asking fork_rng for CUDA's would make a context on every GPU."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(int(seed))
        yield


def pick_device(choice: str = "auto") -> torch.device:
    """CUDA when this process was given a GPU, else CPU; or ``choice`` (run-config
    ``server-device``: cpu, cuda, cuda:N), a ConfigError where that GPU is not there."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and not _ray_actor_without_gpu() else "cpu")
    device = torch.device(choice)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        from flowerbed.config import ConfigError

        raise ConfigError("server-device", choice, f"this machine's ServerApp sees "
                          f"{torch.cuda.device_count()} GPU(s)")
    return device


def _ray_actor_without_gpu() -> bool:
    """A simulation client (a Ray actor) given no GPU share. Ray 2.x hides the GPUs from such an
    actor (CUDA_VISIBLE_DEVICES=""), a default it announces it will drop
    (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO): then every such client would see them all and pile
    onto cuda:0 outside Ray's accounting. So Ray's own assignment decides. Ray is only asked
    where it is already loaded (a simulation; the ServerApp there is its driver, not an actor)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().get_actor_id() is not None and not ray.get_gpu_ids()


def configure_threads() -> None:
    """Use as many torch threads as CPUs this process was given (Ray sets OMP_NUM_THREADS)."""
    n = os.environ.get("OMP_NUM_THREADS")
    if n and n.isdigit() and int(n) > 0 and torch.get_num_threads() != int(n):
        torch.set_num_threads(int(n))


def seeded_generator(*parts: int) -> torch.Generator:
    """A torch generator seeded from several integers (e.g. seed, partition id, round).

    It also seeds torch's global RNG with the same number, on purpose: what draws from it
    inside a client's round (augmentations, random anchors, layer initialisation) then
    repeats per client and round, in any process and after a resume."""
    gen = generator_of(*parts)
    torch.manual_seed(gen.initial_seed())
    return gen


def generator_of(*parts: int) -> torch.Generator:
    """:func:`seeded_generator` without touching torch's global RNG (a draw inside a round
    that must not move the augmentations after it: FedProtoCL's k-means)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([int(p) for p in parts])
                                             .generate_state(1)[0]))


def batches(data: DataSet, batch_size: int, device: torch.device,
            generator: torch.Generator | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Normalised ``(x, y)`` batches on ``device``; shuffled when a generator is given.

    Slicing an in-memory uint8 tensor is much cheaper than a DataLoader with per-sample
    transforms, which matters on small CPU machines.
    """
    n = len(data)
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        yield data.normalise(data.x[idx].to(device)), data.y[idx].to(device)


def cycled_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless index batches over ``n`` samples, reshuffled each pass (an auxiliary data stream
    drawn alongside the local batches: FedCC's public set, FedXDS's shared set)."""
    while True:
        order = torch.randperm(n, generator=generator)
        yield from (order[i:i + batch_size] for i in range(0, n, batch_size))


def make_optimizer(model: nn.Module, lr: float, momentum: float, weight_decay: float,
                   kind: str = "sgd") -> torch.optim.Optimizer:
    """SGD with momentum (the default everywhere) or Adam (the distillation methods)."""
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def train_epochs(model: nn.Module, data: DataSet, *, epochs: int, batch_size: int, lr: float,
                 momentum: float, weight_decay: float, device: torch.device,
                 generator: torch.Generator, loss_hook: LossHook | None = None,
                 grad_hook: GradHook | None = None, batch_hook: BatchHook | None = None,
                 criterion: Criterion = F.cross_entropy, optimizer: str = "sgd",
                 last_epoch: bool = False) -> tuple[float, int]:
    """Supervised training; returns (mean loss, number of optimiser steps).

    Per batch, in this order: ``batch_hook(x, y)`` gets the batch (APFL's personal model steps
    on the same batches; FedVLS's teacher scores it; FedSAM keeps it for its second pass); the
    model's forward pass; ``criterion``; ``loss_hook(model)`` adds a term to the batch's loss
    (FedProx's proximal term); backward; ``grad_hook(model)`` edits the gradients (SCAFFOLD's
    correction, FedSAM's second pass); the optimiser's step.
    ``criterion(logits, y)`` is a batch's loss, cross-entropy unless a method has its own (FedLC's
    calibrated logits, FedRS's restricted softmax, FedVLS's terms);
    ``last_epoch``: the mean loss of the last epoch only (FedFew's L_ik), not of all epochs.
    """
    model.to(device).train()
    opt = make_optimizer(model, lr, momentum, weight_decay, optimizer)
    total, count, steps = 0.0, 0, 0
    for _ in range(epochs):
        if last_epoch:
            total, count = 0.0, 0
        for xb, yb in batches(data, batch_size, device, generator):
            if batch_hook is not None:
                batch_hook(xb, yb)
            opt.zero_grad(set_to_none=True)
            loss = criterion(model(xb), yb)
            if loss_hook is not None:
                loss = loss + loss_hook(model)
            loss.backward()
            if grad_hook is not None:
                grad_hook(model)
            opt.step()
            total += float(loss.detach()) * len(yb)
            count += len(yb)
            steps += 1
    return (total / max(count, 1), steps)


@torch.no_grad()
def evaluate(model: nn.Module, data: DataSet, device: torch.device,
             batch_size: int = 1000) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``data``."""
    if len(data) == 0:
        return float("nan"), float("nan")
    model.to(device).eval()
    loss, correct = 0.0, 0
    for xb, yb in batches(data, batch_size, device):
        out = model(xb)
        if not torch.isfinite(out).all():  # diverged (NaN, or logits overflowing to ±inf): argmax
            # would say class 0, scored as a guess
            return float("nan"), float("nan")
        loss += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    return loss / len(data), correct / len(data)


def to_record(model: nn.Module) -> ArrayRecord:
    """The model's state_dict as an ArrayRecord (CPU tensors)."""
    return ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})


def load_record(model: nn.Module, record: ArrayRecord) -> nn.Module:
    """Load an ArrayRecord into ``model`` (strict: every key and shape must match)."""
    model.load_state_dict(record.to_torch_state_dict(), strict=True)
    return model


def is_finite(record: ArrayRecord) -> bool:
    """True when every floating value in the record is finite."""
    for arr in record.values():
        a = arr.numpy()
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            return False
    return True


def finite_or_nan(x: float) -> float:
    return float(x) if math.isfinite(x) else float("nan")


SSLStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def ssl_epochs(model: nn.Module, data: DataSet, *, epochs: int, batch_size: int, lr: float,
               momentum: float, weight_decay: float, device: torch.device,
               generator: torch.Generator, augment: Callable[[torch.Tensor], torch.Tensor],
               step: SSLStep, random_batch: bool = False,
               after_step: Callable[[], None] | None = None,
               before_epoch: Callable[[], None] | None = None,
               grad_hook: GradHook | None = None) -> tuple[float, int]:
    """Self-supervised training on two augmented views of each batch; never reads labels.

    ``step(x1, x2, xr, idx)`` returns the loss; ``idx`` are the batch's sample indices into
    ``data`` (FedProtoCL looks up their clusters), ``xr`` an independent random batch of the same
    size (FedX's anchor set for the relational loss) when ``random_batch``, else None.
    ``before_epoch()`` runs at the start of every epoch (FedProtoCL's clustering);
    ``grad_hook(model)`` edits the gradients before each step (FedX's SCAFFOLD-style regulariser).
    A last batch of fewer than 2 samples is dropped (contrastive losses need a negative).
    """
    model.to(device).train()
    opt = make_optimizer(model, lr, momentum, weight_decay)
    n = len(data)
    total, count, steps = 0.0, 0, 0
    for _ in range(epochs):
        if before_epoch is not None:
            before_epoch()
        order = torch.randperm(n, generator=generator)
        rand = torch.randperm(n, generator=generator) if random_batch else None
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            if len(idx) < 2:
                continue
            xa = data.x[idx]
            x1 = data.normalise(augment(xa).to(device))
            x2 = data.normalise(augment(xa).to(device))
            xr = None
            if rand is not None:
                xr = data.normalise(augment(data.x[rand[start:start + len(idx)]]).to(device))
            loss = step(x1, x2, xr, idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_hook is not None:
                grad_hook(model)
            opt.step()
            if after_step is not None:
                after_step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
            steps += 1
    return total / max(count, 1), steps


@torch.no_grad()
def extract_features(encode: Callable[[torch.Tensor], torch.Tensor], data: DataSet,
                     device: torch.device, batch_size: int = 1000) -> torch.Tensor:
    """``encode`` applied to the whole (non-augmented) data set, as one CPU tensor."""
    return torch.cat([encode(xb).float().cpu() for xb, _ in batches(data, batch_size, device)])


def linear_probe(train_f: torch.Tensor, train_y: torch.Tensor, test_f: torch.Tensor,
                 test_y: torch.Tensor, num_classes: int, *, epochs: int, lr: float,
                 batch_size: int, seed: int) -> tuple[float, float]:
    """Train a linear classifier on frozen, cached features; (test loss, top-1 test accuracy).

    Features are standardised with the training set's statistics; Adam with weight decay 1e-6
    (FedX's probe), on shuffled mini-batches from a seeded generator.
    """
    mean, std = train_f.mean(0, keepdim=True), train_f.std(0, keepdim=True)
    # a feature constant on the training set (a ReLU unit dead there) is left unscaled: divided
    # by 1e-6, a test image that fires it got a value of a million, which a short probe misread
    std = torch.where(std > 0, std + 1e-6, torch.ones_like(std))
    xtr, xte = (train_f - mean) / std, (test_f - mean) / std
    gen = torch.Generator().manual_seed(seed)
    clf = nn.Linear(xtr.shape[1], num_classes)
    with cpu_seeded(seed):
        clf.reset_parameters()
    opt = torch.optim.Adam(clf.parameters(), lr=lr, weight_decay=1e-6)
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=gen)
        for start in range(0, len(xtr), batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(clf(xtr[idx]), train_y[idx]).backward()
            opt.step()
    with torch.no_grad():
        out = clf(xte)
        if torch.isnan(out).any():  # diverged features or probe: not a guess of class 0
            return float("nan"), float("nan")
        return float(F.cross_entropy(out, test_y)), float((out.argmax(1) == test_y).float().mean())


def fit_targets(model: nn.Module, data: DataSet, targets: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, epochs: int,
                batch_size: int, lr: float, device: torch.device, generator: torch.Generator
                ) -> float:
    """Fit ``model(x)`` to per-sample ``targets`` (row i belongs to ``data`` sample i) with Adam.

    The distillation stage of FedCC/FedDF/FedMD; ``loss_fn(outputs, target_batch)``. Returns the
    mean loss of the last epoch.
    """
    model.to(device).train()
    opt = make_optimizer(model, lr, 0.0, 0.0, "adam")
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=generator)
        total = 0.0
        for start in range(0, len(data), batch_size):
            idx = order[start:start + batch_size]
            xb = data.normalise(data.x[idx].to(device))
            loss = loss_fn(model(xb), targets[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        last = total / max(len(data), 1)
    return last


@torch.no_grad()
def predict(model: nn.Module, data: DataSet, device: torch.device, batch_size: int = 1000,
            probabilities: bool = True) -> torch.Tensor:
    """Softmax outputs (or logits) of ``model`` on ``data``, in order, on the CPU."""
    model.to(device).eval()
    outs = [model(xb).float() for xb, _ in batches(data, batch_size, device)]
    out = torch.cat(outs).cpu()
    return torch.softmax(out, 1) if probabilities else out
