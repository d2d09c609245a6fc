"""Fed-ADE (Park et al., CVPR 2026), server half: shared layers averaged, personal ones kept.

One Flower round per (time step t, round r within t): round k = t·R + r + 1 with R =
``fedade-rounds-per-step``. The global record starts from the centrally pre-trained model
(:mod:`flowerbed.pretrain`); clients upload only the shared layers, which are averaged (as
FedRep's body). At the end of each step every client scores its current model on its own batch
(online accuracy, pooled over clients) and on its next step's batch, before adapting to it:
the predict-then-update accuracy (``pre-accuracy``) of the next step, recorded in that step's
first round. For step 0 it comes from the clients sampled in round 1, which score the
pre-trained model (every client's model then) before adapting. With ``fedade-risk =
bbse`` every training message carries the confusion matrix and a small labelled reference set;
with ``fedade-correction = fth`` every evaluation message carries the confusion matrix.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from flowerbed.clients.fedade import BLACK_BOX
from flowerbed.config import ConfigError
from flowerbed.datasets.streams import client_weight, num_steps, target_partitions
from flowerbed.models import is_personal
from flowerbed.pretrain import confusion, pools, pretrained
from flowerbed.strategies.base import metric_record, with_record
from flowerbed.strategies.fedrep import FedRepStrategy
from flowerbed.training import to_record

log = logging.getLogger("flowerbed")

REF_PER_CLASS = 20


class FedADEStrategy(FedRepStrategy):
    # and the next step's predict-then-update accuracy
    checkpoint_attrs = (*FedRepStrategy.checkpoint_attrs, "_next_pre")
    corrects = True  # reads fedade-correction (FTH): Fed-POE does not

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.bbse: ArrayRecord | None = None
        self.fth: ArrayRecord | None = None
        self._pretrained: ArrayRecord | None = None
        self._next_pre: float | None = None

    def subset_keys(self, key: str, reference: ArrayRecord) -> set[str] | None:
        return {k for k in reference if not is_personal(k)}  # the shared layers, all of them

    def with_black_box(self, node: int, content: RecordDict) -> RecordDict:
        """BBSE's fixed classifier (the pre-trained model) in a training message to a client that
        has not replied to one yet (``fedade-risk='bbse'``); it keeps its copy."""
        if self.bbse is None or "bbse" not in content or self.holds(node):
            return content
        return with_record(content, BLACK_BOX, self._pretrained)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        return self.with_black_box(node, super().content_for(node, content))

    def check_setup(self, num_partitions: int) -> None:
        cfg = self.cfg
        # a covariate-shift batch is drawn from the whole pool without replacement (a label-shift
        # batch with replacement: one larger than the pool only repeats it, or fills the memory)
        if cfg.fedade_batch > (post := len(pools(cfg)[2])):
            raise ConfigError("fedade-batch", cfg.fedade_batch, f"at most the {post} samples "
                              "of the post-deployment pool (20% of train-samples)")
        if cfg.fedade_shift == "label":  # every client's target mix must exist
            target_partitions(cfg, num_partitions)
        steps = num_steps(cfg)
        if not any(client_weight(cfg, p, t) for p in range(num_partitions) for t in range(steps)):
            why = ("a single time step" if steps == 1 else
                   f"fedade-ber-p={cfg.fedade_ber_p:g}: no chain flips in {steps} steps")
            log.warning("%s: the streams never shift (w = 0 at every step: %s), so every "
                        "client sees the pre-training %s all run; more steps: num-server-rounds = "
                        "steps x fedade-rounds-per-step (%d)", cfg.method, why,
                        "label mix" if cfg.fedade_shift == "label"
                        else "corruption at its lowest severity (1)",
                        cfg.fedade_rounds_per_step)

    def step_of(self, server_round: int) -> tuple[int, int]:
        return divmod(server_round - 1, self.cfg.fedade_rounds_per_step)

    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        net = pretrained(self.cfg)
        if self.model is not None:
            self.model.load_state_dict(net.state_dict())
        _, held, _ = pools(self.cfg)
        bbse = self.cfg.fedade_risk == "bbse"
        fth = self.corrects and self.cfg.fedade_correction == "fth"
        conf = Array(confusion(net, held)) if bbse or fth else None  # one pass over the held-out pool
        if bbse:
            y = held.y.numpy()
            rng = np.random.default_rng([self.cfg.seed, 82])
            ref = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:REF_PER_CLASS]
                                  for c in range(held.num_classes)])
            self.bbse = ArrayRecord({"confusion": conf, "ref_x": Array(held.x[ref].numpy()),
                                     "ref_y": Array(y[ref].astype(np.int64))})
        if fth:
            self.fth = ArrayRecord({"confusion": conf})
        self._pretrained = to_record(net)
        return self._pretrained

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        t, r = self.step_of(server_round)
        config["fedade-step"], config["fedade-round-in-step"] = t, r
        content = super().train_content(server_round, arrays, config)
        if self.bbse is not None:
            content["bbse"] = self.bbse
        return content

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        content = super().eval_content(arrays)
        if self.fth is not None:
            content["bbse"] = self.fth
        return content

    def check_reply(self, reply: Message, is_train: bool) -> str | None:
        return (super().check_reply(reply, is_train)
                or counts_problem(metric_record(reply.content)))

    def evaluates(self, server_round: int) -> bool:
        return server_round % self.cfg.fedade_rounds_per_step == 0

    def evaluates_locally(self) -> bool:
        return False  # clients score their stream's batch, not a local test split

    def configure_evaluate(self, server_round, arrays, config, grid):
        config["fedade-step"] = self.step_of(server_round)[0]
        return super().configure_evaluate(server_round, arrays, config, grid)

    def local_only(self) -> bool:
        """Local-only adaptation (``fedade-sync=false``): the clients keep their shared layers."""
        return not self.cfg.fedade_sync

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        if self.local_only() and arrays is not None:
            # local-only adaptation: nothing is shared, so the server keeps sending the
            # pre-trained model; a client that has not adapted yet starts (and is scored) from
            # it, not from an average of the others' adapted layers
            arrays = self._pretrained
        t, r = self.step_of(server_round)
        if r == 0:  # step 0: this round's clients; later: the previous step's evaluation
            pre = pooled(self.round.clients.values(), "train-pre") if t == 0 else self._next_pre
            if pre is not None:
                self.round.train_metrics["pre-accuracy"] = pre
            self._next_pre = None
        self.round.train_metrics.pop("pre-correct", None)
        self.round.train_metrics.pop("pre-n", None)
        return arrays, metrics

    def aggregate_evaluate(self, server_round, replies):
        metrics = super().aggregate_evaluate(server_round, replies)
        self._next_pre = pooled(self.round.clients.values(), "evaluate-next")
        self.round.eval_metrics.pop("next-correct", None)
        self.round.eval_metrics.pop("next-n", None)
        return metrics


def pooled(clients, prefix: str) -> float | None:
    """Correct predictions over predictions, summed over the clients that reported them (None
    when none did, or they made no predictions)."""
    counts = [(v[f"{prefix}-correct"], v[f"{prefix}-n"]) for v in clients if f"{prefix}-n" in v]
    total = sum(n for _, n in counts)
    return sum(c for c, _ in counts) / total if total > 0 else None


def counts_problem(metrics) -> str | None:
    """Why a reply's prediction counts (``pre-``/``next-correct`` and ``-n``) cannot be pooled."""
    for p in ("pre", "next"):
        n, c = metrics.get(f"{p}-n"), metrics.get(f"{p}-correct")
        if n is None and c is None:
            continue
        if not all(isinstance(v, int | float) for v in (n, c)) or not 0 <= c <= n:
            return f"metrics '{p}-correct' ({c!r}) and '{p}-n' ({n!r}) need 0 <= correct <= n"
    return None
