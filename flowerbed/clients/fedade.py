"""Fed-ADE client: adapt to an unlabelled, shifting stream with a learning rate set by the shift.

At time step t (one Flower round per (t, round within t)) the client regenerates its batch x_c^t
(:mod:`flowerbed.datasets.streams`), estimates how much its stream moved and adapts:

- uncertainty dynamics S_unc = 1 − cos(q^{prev}, q^t), q = mean softmax of the batch (paper) or
  the normalised argmax histogram (``fedade-unc='hist'``, the official code);
- representation dynamics S_rep = ½(1 − cos(z^{prev}, z^t)), z = mean of the l2-normalised
  shared-layer features (paper) or, with ``fedade-rep-ref='ema'``, normalise(mean) against an
  EMA reference (the official code);
- S = ½(S_unc + S_rep) (``fedade-estimators`` unc / rep for the ablations), 0 on first sight,
  estimated once per time step (later rounds of the step reuse it);
  η = η_min + (η_max − η_min)·S (``fedade-lr-mode``: adaptive | fixed | none);
- the unsupervised risk (``fedade-risk``): mean prediction entropy (the official code) or BBSE
  (the paper): label-shift weights w = (M⁻¹ q̂) / q_0 from the server's confusion matrix M and the
  predicted-label frequencies q̂, applied to class-conditional risks on a small labelled
  reference set shipped with M;
- SGD steps: ``fedade-steps`` full-batch steps on the personal layers, then as many on all.

With ``fedade-correction='fth'`` (FTH, Follow The History, Wu et al. 2021: one of the paper's
localised online label-shift baselines, run with ``fedade-lr-mode='none'``) the client does not
train: it reweights the fixed model's softmax by p̂_t / q_0, p̂_t the mean of its (unbiased,
unprojected) BBSE estimates of the label mix of steps 0 … t−1, projected onto the simplex
(weights 1 at step 0), the estimates kept in ``context.state``.

Personal layers and the estimator buffers live in ``context.state``; only the shared layers are
uploaded. Labels are read only to score predictions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from torch import nn
from torch.nn import functional as F

from flowerbed.clients.base import Client
from flowerbed.datasets.streams import client_batch, num_steps
from flowerbed.models import is_personal
from flowerbed.pretrain import pools
from flowerbed.training import is_finite, to_record

PERSONAL, SHARED_OWN, BUFFERS = "fedade.personal", "fedade.shared", "fedade.buffers"
FTH = "fedade.fth"  # the BBSE estimate of each step's label mix, and how many steps it holds
BLACK_BOX = "fedade.black-box"  # BBSE's fixed classifier f_0: the pre-trained model (fedade-risk='bbse')


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: np.ndarray | None = None) -> int:
    """How many of ``x`` the model (in eval mode) labels ``y``, its softmax reweighted by ``w``."""
    with torch.no_grad():
        return int((reweighted(model(x), w).argmax(1) == y).sum())


def reweighted(logits: torch.Tensor, w: np.ndarray | None) -> torch.Tensor:
    """Log-probabilities of softmax(logits) · w, renormalised (the logits' own without ``w``).
    A weight of 0 (a class BBSE estimates absent) counts as 1e-8, so that a sample of that
    class has a finite loss."""
    if w is None:
        return torch.log_softmax(logits, 1)
    log_w = torch.log(torch.as_tensor(np.maximum(w, 1e-8), dtype=logits.dtype, device=logits.device))
    return torch.log_softmax(logits + log_w, 1)


def lr_from(s: float, lr_min: float, lr_max: float) -> float:
    """η = η_min + (η_max − η_min)·S with S clipped to [0, 1]; η_min where S is not finite (a
    NaN learning rate would reach SGD unchecked)."""
    return lr_min + (lr_max - lr_min) * float(np.clip(s, 0.0, 1.0)) if np.isfinite(s) else lr_min


def bbse_raw(conf: np.ndarray, pred_freq: np.ndarray) -> np.ndarray:
    """BBSE's unbiased, unprojected label-mix estimate from M[ŷ, y] = P(ŷ, y) and predicted
    frequencies q̂_ŷ: M_c⁻¹ q̂ with M_c = M / q_0 (column-normalised, P(ŷ | y)), by least squares."""
    cond = conf / np.maximum(conf.sum(0), 1e-12)
    q, *_ = np.linalg.lstsq(cond, pred_freq, rcond=None)
    return q


def to_simplex(q: np.ndarray) -> np.ndarray:
    """A label mix from an estimate: clipped at 0, renormalised (uniform if nothing is left)."""
    q = np.clip(q, 0, None)
    return q / q.sum() if q.sum() > 0 else np.full_like(q, 1 / len(q))


def bbse_estimate(conf: np.ndarray, pred_freq: np.ndarray) -> np.ndarray:
    """BBSE's label mix Q̂: :func:`bbse_raw` projected onto the simplex (clip, renormalise)."""
    return to_simplex(bbse_raw(conf, pred_freq))


def bbse_weights(conf: np.ndarray, pred_freq: np.ndarray) -> np.ndarray:
    """Label-shift weights Q̂_y / q_0,y (:func:`bbse_estimate`)."""
    return bbse_estimate(conf, pred_freq) / np.maximum(conf.sum(0), 1e-12)


class FedADEClient(Client):
    keeps_state = True

    def data_line(self) -> str:
        c = self.cfg
        return (f"an unlabelled {c.fedade_shift}-shift stream ({c.fedade_schedule}) of {num_steps(c)} "
                f"time steps x {c.fedade_batch} samples from the post-deployment pool")

    def model_for(self, msg: Message) -> nn.Module:
        """ψ̄ from the server (or the client's own ψ when sync is off) + its own φ."""
        state = self.context.state.array_records
        own = None if self.cfg.fedade_sync else state.get(SHARED_OWN)
        return self.model_with(msg.content["arrays"], own, state.get(PERSONAL))

    def batch(self, msg: Message) -> tuple[torch.Tensor, torch.Tensor, int]:
        t = int(msg.content["config"]["fedade-step"])
        return (*self.step_batch(t), t)

    def step_batch(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This client's batch at time step ``t``, as the model sees it, and its labels."""
        x, y = client_batch(self.cfg, self.partition_id, self.num_partitions, t)
        return self.model_input(x), y.to(self.device)

    def model_input(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images as the model sees them (``fedade-pixels``: standardised or raw 0-255)."""
        return pools(self.cfg)[2].normalise(x.to(self.device))

    def shift(self, model: nn.Module, x: torch.Tensor, t: int) -> tuple[float, float]:
        """(S_unc^t, S_rep^t): this step's batch against the one this client last estimated on.

        Estimated once per time step, at the client's first training round of step t, against
        the buffers of an earlier step; later rounds of step t reuse the step's S (the paper's
        S^t compares steps t−1 and t; recomputing on the same batch, as the official code does
        each selection, gives S ≈ 0 from the second round of a step on).
        """
        cfg = self.cfg
        buf = self.context.state.array_records.get(BUFFERS)
        if buf is not None and "t" in buf and int(buf["t"].numpy()[0]) == t:
            s_unc, s_rep = (float(v) for v in buf["s"].numpy())
            return s_unc, s_rep
        model.eval()
        with torch.no_grad():
            feats = model.trunk(x)
            probs = torch.softmax(model(x), 1)
        if cfg.fedade_unc == "hist":
            q = torch.bincount(probs.argmax(1), minlength=probs.shape[1]).double()
            q = q / q.sum()
        else:
            q = probs.mean(0).double()
        if cfg.fedade_rep_ref == "ema":
            z = F.normalize(feats.mean(0), dim=0).double()
        else:
            z = F.normalize(feats, dim=1).mean(0).double()
        s_unc = s_rep = 0.0
        if buf is not None:
            q_prev = torch.as_tensor(buf["q"].numpy())
            z_prev = torch.as_tensor(buf["z"].numpy())
            s_unc = 1 - cosine(q_prev, q.cpu())
            s_rep = float(np.clip(0.5 * (1 - cosine(z_prev, z.cpu())), 0, 1))
            if cfg.fedade_rep_ref == "ema":
                z = F.normalize(0.9 * z_prev.to(z) + 0.1 * z.cpu().to(z), dim=0)
        # (buffers from a model gone NaN are dropped, not kept: the next step starts afresh, S = 0)
        self.keep_model(BUFFERS, ArrayRecord({
            "q": Array(q.cpu().numpy()), "z": Array(z.cpu().numpy()),
            "t": Array(np.array([t], np.int64)), "s": Array(np.array([s_unc, s_rep]))}))
        return s_unc, s_rep

    def fth_weights(self, model: nn.Module, msg: Message, t: int) -> np.ndarray | None:
        """FTH's weights p̂_t / q_0 for step ``t`` (None without ``fedade-correction='fth'``):
        p̂_t the mean of the unbiased (unprojected) BBSE estimates of steps 0 … t−1, projected
        onto the simplex, each made from that step's batch (regenerated) with the model, which
        FTH never trains, and kept in ``context.state`` (filed at the next training round; a
        resumed client remakes any it lacks, to the same values); 1 at step 0."""
        if self.cfg.fedade_correction != "fth":
            return None
        conf = msg.content["bbse"]["confusion"].numpy()
        c = conf.shape[0]
        rec = self.context.state.array_records.get(FTH)
        est = rec["est"].numpy().copy() if rec is not None else np.zeros((num_steps(self.cfg), c))
        done = int(rec["done"].numpy()[0]) if rec is not None else 0
        if done < t:
            model.eval()
            for tau in range(done, t):
                x, _ = self.step_batch(tau)
                with torch.no_grad():
                    pred = model(x).argmax(1).cpu().numpy()
                est[tau] = bbse_raw(conf, np.bincount(pred, minlength=c) / len(pred))
            self.context.state[FTH] = ArrayRecord({"est": Array(est),
                                                   "done": Array(np.array([t], np.int64))})
        if t == 0:
            return np.ones(c)
        return to_simplex(est[:t].mean(0)) / np.maximum(conf.sum(0), 1e-12)

    def learning_rate(self, s_unc: float, s_rep: float) -> float:
        cfg = self.cfg
        if cfg.fedade_lr_mode == "none":
            return 0.0
        if cfg.fedade_lr_mode == "fixed":
            return cfg.fedade_fixed_lr
        s = {"both": 0.5 * (s_unc + s_rep), "unc": s_unc, "rep": s_rep}[cfg.fedade_estimators]
        return lr_from(s, cfg.fedade_lr_min, cfg.fedade_lr_max)

    def black_box_record(self, msg: Message) -> ArrayRecord:
        """BBSE's fixed classifier f_0, the pre-trained model whose confusion matrix the server
        ships: this client's copy, filed from the message that first brings it (the server sends
        it until the client has replied to a training round)."""
        rec = self.context.state.array_records.get(BLACK_BOX)
        if rec is None:
            if BLACK_BOX not in msg.content.array_records:
                raise RuntimeError(f"partition {self.partition_id}: this client holds no copy of "
                                   "the pre-trained model for BBSE (its context.state was lost?) "
                                   "and the message has none; the server sends it next time")
            rec = self.context.state[BLACK_BOX] = msg.content[BLACK_BOX]
        return rec

    def black_box(self, msg: Message) -> nn.Module:
        """f_0 as a model (:meth:`black_box_record`), built once per client object."""
        if getattr(self, "_black_box", None) is None:
            self._black_box = self.model_with(self.black_box_record(msg)).eval()
        return self._black_box

    def risk_on(self, x: torch.Tensor, msg: Message) -> Callable[[nn.Module], torch.Tensor]:
        """The unsupervised risk on batch ``x`` as a function of the model. What does not depend
        on the model (BBSE's label-shift weights from f_0's predictions, the reference set) is
        computed once here, not at every step that evaluates the risk."""
        if self.cfg.fedade_risk == "entropy":
            def entropy(model: nn.Module) -> torch.Tensor:
                out = model(x)
                return -(torch.softmax(out, 1) * torch.log_softmax(out, 1)).sum(1).mean()
            return entropy
        bb = msg.content["bbse"]
        conf = bb["confusion"].numpy()
        # the predicted-label mix of the classifier M describes (the paper's BBSE), not of the
        # model being adapted, whose confusion matrix nobody measured
        with torch.no_grad():
            pred = self.black_box(msg)(x).argmax(1)
        freq = np.bincount(pred.cpu().numpy(), minlength=conf.shape[0]) / len(x)
        w = torch.as_tensor(bbse_weights(conf, freq), dtype=torch.float32, device=x.device)
        q0 = torch.as_tensor(conf.sum(0), dtype=torch.float32, device=x.device)
        rx = self.model_input(torch.as_tensor(bb["ref_x"].numpy()))
        ry = torch.as_tensor(bb["ref_y"].numpy()).long().to(self.device)
        counts = torch.bincount(ry, minlength=conf.shape[0]).clamp_min(1)

        def bbse(model: nn.Module) -> torch.Tensor:
            per_sample = F.cross_entropy(model(rx), ry, reduction="none")
            class_risk = torch.zeros(conf.shape[0], device=x.device).index_add(0, ry, per_sample)
            return (w * q0 * class_risk / counts).sum()  # Σ_y Q̂_y R̂_y
        return bbse

    def adapt(self, model: nn.Module, risk: Callable[[nn.Module], torch.Tensor], lr: float) -> float:
        """``fedade-steps`` full-batch SGD steps on the unsupervised risk (:meth:`risk_on`) at rate
        ``lr``, on the personal layers, then as many on all; the last step's risk (NaN when ``lr``
        is 0)."""
        loss = float("nan")
        if lr <= 0:
            return loss
        model.train()
        for personal_only in (True, False):
            for p_name, p in model.named_parameters():
                p.requires_grad_(is_personal(p_name) or not personal_only)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
            for _ in range(self.cfg.fedade_steps):
                opt.zero_grad(set_to_none=True)
                value = risk(model)
                value.backward()
                opt.step()
                loss = float(value.detach())
        model.requires_grad_(True)
        return loss

    def train(self, msg: Message) -> Message:
        cfg = self.cfg
        model = self.model_for(msg)
        x, y, t = self.batch(msg)
        pre = {}
        if t == 0 and int(msg.content["config"]["fedade-round-in-step"]) == 0:
            # predict-then-update for step 0 (later steps: the previous step's evaluation):
            # the pre-trained model on the batch, before adapting to it
            pre = {"pre-correct": correct(model.eval(), x, y), "pre-n": len(y)}
        s_unc, s_rep = self.shift(model, x, t)
        lr = self.learning_rate(s_unc, s_rep)
        loss = self.adapt(model, self.risk_on(x, msg), lr) if lr > 0 else float("nan")  # (no f_0 pass)
        record = to_record(model)
        shared = ArrayRecord({k: v for k, v in record.items() if not is_personal(k)})
        # a model gone NaN: its layers and buffers dropped (the server sends the whole model
        # again after this round's refused reply), not kept for the rest of the run
        kept = self.keep_model(PERSONAL, ArrayRecord({k: v for k, v in record.items() if is_personal(k)}),
                               BUFFERS, SHARED_OWN, finite=is_finite(shared))
        if kept and not cfg.fedade_sync:
            self.context.state[SHARED_OWN] = shared
        metrics = {"num-examples": len(y), "lr": lr, "s-unc": s_unc, "s-rep": s_rep, "time-step": t, **pre}
        if np.isfinite(loss) or not kept:  # (none at learning rate 0: no step was taken)
            metrics["risk"] = loss if kept else float("nan")  # dropped layers: the reply is refused
        return self.reply(msg, metrics, arrays=shared)

    def evaluate(self, msg: Message) -> Message:
        """Online accuracy: the current model on this step's batch, after the step's rounds.

        The same model, the one the client starts step t+1 with, also predicts step t+1's batch
        before adapting to it (``next-correct``/``next-n``): the predict-then-update accuracy
        of step t+1, from every evaluating client, as online accuracy is.
        """
        model = self.model_for(msg).eval()
        x, y, t = self.batch(msg)
        with torch.no_grad():
            logp = reweighted(model(x), self.fth_weights(model, msg, t))
        metrics = {"num-examples": len(y), "accuracy": float((logp.argmax(1) == y).float().mean()),
                   "loss": float(F.nll_loss(logp, y)), "time-step": t}
        if t + 1 < num_steps(self.cfg):
            xn, yn = self.step_batch(t + 1)
            metrics.update({"next-correct": correct(model, xn, yn, self.fth_weights(model, msg, t + 1)),
                            "next-n": len(yn)})
        return self.reply(msg, metrics)


