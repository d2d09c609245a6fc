"""FedFTG (Zhang et al., CVPR 2022), server half: FedAvg, then the global model fine-tuned on the
server by data-free knowledge distillation from the round's client models.

One of the FedXDS paper's generative baselines. After averaging, the server trains a conditional
generator G(z, y) and the global model θ against each other for ``fedftg-iterations`` iterations,
on batches of ``batch-size`` labels y drawn in proportion to the round's clients' label counts
(customised label sampling; the clients report their counts), each sample's teachers weighted by
the class-level ensemble α_k^y = n_k^y / Σ_j n_j^y:

- the generator, ``fedftg-gen-steps`` Adam steps (``fedftg-gen-lr``) on
  L_cls − ``fedftg-lambda-md``·L_md + ``fedftg-lambda-div``·L_div: L_cls = Σ_k α_k^y CE(f_k(x̃), y)
  (fidelity), L_md = Σ_k α_k^y KL(f_k(x̃) ‖ f_θ(x̃)) (hard samples: those the global model gets
  wrong), L_div = exp(−mean_ij ‖z_i − z_j‖²·|x̃_i − x̃_j|) (diversity, FedGen's);
- the global model, ``fedftg-student-steps`` SGD steps at the run's ``lr`` (and ``weight-decay``)
  on the cross-entropy of its softmax against the class-level ensemble's, Σ_k α_k^y softmax(f_k(x̃)).

There is no official code; this follows the paper. Our choices where it leaves room: one
generator step on the α-weighted sum over teachers (a public reimplementation steps once per
teacher); the global model's BatchNorm statistics stay FedAvg's (it fine-tunes in eval mode: the
generated batches' statistics are not the data's); the generator persists across rounds (in the
checkpoint) while its Adam state is new each round; a generator of DCGAN's shape (64 and 32
channels) whose last layer is a BatchNorm without affine parameters, so that its images come out
standardised, as the models' inputs are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.fedftg import COUNTS
from flowerbed.datasets.loading import IMAGE_SHAPES, NUM_CLASSES
from flowerbed.strategies.base import FlowerbedFedAvg, cast_like, metric_record
from flowerbed.training import cpu_seeded, is_finite, load_record, pick_device, to_record

log = logging.getLogger("flowerbed")

WIDTH = 64  # the generator's channels (DCGAN's CIFAR generator: 128; half costs a quarter on CPU)


class Generator(nn.Module):
    """z (``z_dim``) and a one-hot label -> a standardised C×H×W image (H, W divisible by 4)."""

    def __init__(self, z_dim: int, num_classes: int, shape: tuple[int, int, int]) -> None:
        super().__init__()
        c, h, w = shape
        self.num_classes, self.side = num_classes, (h // 4, w // 4)
        self.fc = nn.Linear(z_dim + num_classes, WIDTH * self.side[0] * self.side[1])
        self.net = nn.Sequential(
            nn.BatchNorm2d(WIDTH), nn.Upsample(scale_factor=2), nn.Conv2d(WIDTH, WIDTH, 3, padding=1),
            nn.BatchNorm2d(WIDTH), nn.LeakyReLU(0.2), nn.Upsample(scale_factor=2),
            nn.Conv2d(WIDTH, WIDTH // 2, 3, padding=1), nn.BatchNorm2d(WIDTH // 2), nn.LeakyReLU(0.2),
            nn.Conv2d(WIDTH // 2, c, 3, padding=1), nn.Tanh(), nn.BatchNorm2d(c, affine=False))

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat([z, F.one_hot(y, self.num_classes).to(z)], 1))
        return self.net(h.view(len(z), WIDTH, *self.side))


def diversity(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """exp(−mean_ij ‖z_i − z_j‖²_mean · |x_i − x_j|_mean): small when distant noises give distant
    images (FedGen's diversity loss, which FedFTG uses)."""
    dz = torch.cdist(z, z).pow(2) / z.shape[1]
    x = x.flatten(1)
    dx = torch.cdist(x, x, p=1) / x.shape[1]  # (B² distances, not B²·D differences in memory)
    return torch.exp(-(dz * dx).mean())


def generator_terms(teachers: list[torch.Tensor], student: torch.Tensor, y: torch.Tensor,
                    w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_cls, L_md) from the teachers' and the student's logits on generated images of labels
    ``y``, each sample's teachers weighted by ``w`` [B, K]: Σ_k w_k CE(f_k, y) and
    Σ_k w_k KL(softmax f_k ‖ softmax f_θ), each a mean over the batch."""
    log_s = F.log_softmax(student, 1)
    cls = sum((w[:, k] * F.cross_entropy(t, y, reduction="none")).mean() for k, t in enumerate(teachers))
    md = sum((w[:, k] * F.kl_div(log_s, F.log_softmax(t, 1), reduction="none", log_target=True).sum(1)).mean()
             for k, t in enumerate(teachers))
    return cls, md


def ensemble_target(teachers: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """The class-level ensemble's probabilities Σ_k w_k softmax(f_k) [B, C], ``w`` [B, K]."""
    return sum(w[:, k, None] * F.softmax(t, 1) for k, t in enumerate(teachers))


def class_weights(counts: np.ndarray) -> np.ndarray:
    """α[k, y] = n_k^y / Σ_j n_j^y (0 for a class no client holds)."""
    total = counts.sum(0, keepdims=True)
    return np.divide(counts, total, out=np.zeros_like(counts, dtype=np.float64), where=total > 0)


def counts_problem(counts: object, num_classes: int, total: float | None = None) -> str | None:
    """Why ``label-counts`` are unusable (None: one count >= 0 per class, summing to ``total``,
    or to more than 0 where no total is known): FedFTG's training replies carry them, FedConcat's
    whoami replies."""
    if (not isinstance(counts, list) or len(counts) != num_classes
            or not all(isinstance(v, int) and v >= 0 for v in counts)
            or (sum(counts) != total if total is not None else sum(counts) <= 0)):
        want = f"summing to num-examples = {total:g}" if total is not None else "not all 0"
        return f"'{COUNTS}' must be {num_classes} counts >= 0 (one per class), {want}; got {counts!r}"
    return None


class FedFTGStrategy(FlowerbedFedAvg):
    checkpoint_attrs = ("generator",)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.generator: ArrayRecord | None = None  # made at the first fine-tuning, seeded

    def check_arrays(self, content: RecordDict) -> str | None:
        mr = metric_record(content)
        problem = counts_problem(mr.get(COUNTS), NUM_CLASSES[self.cfg.dataset], mr[self.weighted_by_key])
        return f"metric {problem}" if problem else super().check_arrays(content)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, mean, _ = taken
        counts = np.array([metric_record(r.content)[COUNTS] for r in valid], np.float64)
        tuned, extra = self.fine_tune(server_round, ArrayRecord(mean),
                                      [r.content["arrays"] for r in valid], counts)
        return cast_like(tuned, self._reference), self.client_metrics(valid, extra, drop=(COUNTS,))

    def fine_tune(self, server_round: int, mean: ArrayRecord, uploads: list[ArrayRecord],
                  counts: np.ndarray) -> tuple[ArrayRecord, dict[str, float]]:
        """The global model ``mean`` after the round's data-free distillation from ``uploads``,
        and the losses of the last iteration."""
        cfg, device = self.cfg, pick_device(self.cfg.server_device)
        if not cfg.fedftg_iterations:
            return mean, {}  # FedAvg
        # (the mean as FedAvg casts it: a float64 mean of an int64 buffer rounded, not truncated)
        student = self.network_with(cast_like(mean, self._reference)).to(device).eval()
        teachers = [self.network_with(r).to(device).eval().requires_grad_(False) for r in uploads]
        gen = self._generator().to(device).train()
        opt_g = torch.optim.Adam(gen.parameters(), lr=cfg.fedftg_gen_lr)
        opt_s = torch.optim.SGD(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        alpha = torch.as_tensor(class_weights(counts), dtype=torch.float32, device=device)  # [K, C]
        p = counts.sum(0) / counts.sum()
        rng = np.random.default_rng([cfg.seed, server_round, 71])
        noise = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
        losses: dict[str, float] = {}
        for _ in range(cfg.fedftg_iterations):
            y = torch.as_tensor(rng.choice(len(p), size=cfg.batch_size, p=p), device=device)
            z = torch.randn(cfg.batch_size, cfg.fedftg_z_dim, generator=noise).to(device)
            w = alpha[:, y].T  # [B, K]: each sample's teachers
            student.requires_grad_(False)
            for _ in range(cfg.fedftg_gen_steps):
                x = gen(z, y)
                cls, md = generator_terms([t(x) for t in teachers], student(x), y, w)
                div = diversity(z, x)
                opt_g.zero_grad(set_to_none=True)
                self.generator_loss(cls, md, div).backward()
                opt_g.step()
            student.requires_grad_(True)
            with torch.no_grad():
                x = gen(z, y)
                target = ensemble_target([t(x) for t in teachers], w)
            for _ in range(cfg.fedftg_student_steps):
                kd = -(target * F.log_softmax(student(x), 1)).sum(1).mean()
                opt_s.zero_grad(set_to_none=True)
                kd.backward()
                opt_s.step()
            losses = {k: float(v.detach()) for k, v in
                      {"ftg-cls": cls, "ftg-md": md, "ftg-div": div, "ftg-kd": kd}.items()}
        tuned, generator = to_record(student), to_record(gen)
        if not (is_finite(tuned) and is_finite(generator)):
            # a NaN generator kept would spoil every later round's fine-tuning (and the checkpoint)
            log.warning("round %d: FedFTG's fine-tuning diverged (the global model or the generator "
                        "is not finite): the round keeps FedAvg's mean, the generator its weights "
                        "from before the round", server_round)
            return mean, losses
        self.generator = generator
        return tuned, losses

    def generator_loss(self, cls: torch.Tensor, md: torch.Tensor, div: torch.Tensor) -> torch.Tensor:
        """L_cls − λ_md·L_md + λ_div·L_div: faithful to the teachers, hard for the global model
        (it maximises their disagreement), diverse."""
        return cls - self.cfg.fedftg_lambda_md * md + self.cfg.fedftg_lambda_div * div

    def _generator(self) -> Generator:
        cfg = self.cfg
        with cpu_seeded(cfg.seed * 100 + 71):
            gen = Generator(cfg.fedftg_z_dim, NUM_CLASSES[cfg.dataset], IMAGE_SHAPES[cfg.dataset])
        return gen if self.generator is None else load_record(gen, self.generator)
