"""Central pre-training for post-deployment adaptation (Fed-ADE), saved once per (data, seed).

The model is trained on the 80 % pre-training pool (labels uniform, the data set's own
balance) minus a held-out 10 % of it, which gives BBSE's confusion matrix and a small labelled
reference set per class. The weights are cached under ``~/.cache/flowerbed/pretrained`` (or
``$FLOWERBED_CACHE``) and reused by later runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flowerbed import cache_root
from flowerbed.checkpoint import write_synced
from flowerbed.config import Config
from flowerbed.datasets.federated import full_train
from flowerbed.datasets.loading import DataSet
from flowerbed.datasets.streams import split_pretrain
from flowerbed.models import build_model
from flowerbed.training import (
    evaluate,
    is_finite,
    pick_device,
    predict,
    seeded_generator,
    to_record,
    train_epochs,
)

log = logging.getLogger("flowerbed")


def cache_dir() -> Path:
    return cache_root() / "pretrained"


@functools.lru_cache(maxsize=4)
def pools(cfg: Config) -> tuple[DataSet, DataSet, DataSet]:
    """(pre-training set, held-out labelled set, post-deployment pool) of the training data."""
    full = dataclasses.replace(full_train(cfg), pixels=cfg.fedade_pixels)  # honours train-samples
    pre, post = split_pretrain(full.y.numpy(), cfg.seed)
    rng = np.random.default_rng([cfg.seed, 81])
    pre = rng.permutation(pre)
    k = len(pre) // 10
    return full.subset(np.sort(pre[k:])), full.subset(np.sort(pre[:k])), full.subset(post)


RECIPE_ARGS = {"batch_size": 128, "lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "optimizer": "adam"}
RECIPE = ",".join(f"{k}={v}" for k, v in RECIPE_ARGS.items())


def cache_path(cfg: Config, train: DataSet) -> Path:
    """The cache file of the model pre-trained on ``train``: keyed by its images and labels
    themselves (two train-samples values can give pools of equal size but other images), the
    model, seed, epochs, pixel scale and :data:`RECIPE`."""
    key = (f"{cfg.dataset}|{cfg.model}|{cfg.seed}|{cfg.fedade_pretrain_epochs}|{train.pixels}|"
           f"{RECIPE}|").encode() + train.x.numpy().tobytes() + train.y.numpy().tobytes()
    digest = hashlib.sha1(key).hexdigest()[:10]
    return cache_dir() / f"{cfg.dataset}-{cfg.model}-s{cfg.seed}-{digest}.pt"


def pretrained(cfg: Config) -> nn.Module:
    """The centrally pre-trained network (trained once, then loaded from the cache)."""
    train, held, _ = pools(cfg)
    c, h, _ = train.shape
    model = build_model(cfg.model, c, train.num_classes, h)
    path = cache_path(cfg, train)
    if path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu"))
        log.info("pre-trained model loaded from %s", path)
        return model
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, c, train.num_classes, h)
    device = pick_device(cfg.server_device)
    log.info("pre-training %s on %d samples (%s pixels) for %d epochs (cached afterwards)",
             cfg.model, len(train), train.pixels, cfg.fedade_pretrain_epochs)
    train_epochs(model, train, epochs=cfg.fedade_pretrain_epochs, device=device,
                 generator=seeded_generator(cfg.seed, 808), **RECIPE_ARGS)
    log.info("pre-trained: held-out accuracy %.4f", evaluate(model, held, device)[1])
    model.cpu()  # after the evaluation (which moves it to the device): the file and the model
    if not is_finite(to_record(model)):  # cached, it would serve every later run of this key
        raise RuntimeError(f"Fed-ADE's pre-training diverged ({cfg.model}, {train.pixels} pixels, "
                           f"{cfg.fedade_pretrain_epochs} epochs): its weights are not finite, so "
                           "nothing was cached")
    path.parent.mkdir(parents=True, exist_ok=True)  # returned are on the CPU, as when loaded
    write_synced(path, model.state_dict())  # a temporary file per process: runs may pre-train at once
    return model


def confusion(model: nn.Module, held: DataSet) -> np.ndarray:
    """BBSE's confusion matrix M[ŷ, y] = P(f(x) = ŷ, y) on held-out labelled data."""
    pred = predict(model, held, torch.device("cpu")).argmax(1).numpy()
    c = held.num_classes
    m = np.zeros((c, c))
    np.add.at(m, (pred, held.y.numpy()), 1)
    return m / m.sum()
