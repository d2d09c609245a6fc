"""FedXDS (Hoefler, Müller, Samek, ICCV 2025), server half: warm-up, one-shot sharing, main FL.

Rounds 1..R_w (``fedxds-warmup-rounds``) are FedAvg. In round R_w each client, after training,
also uploads its privatised shared samples (an ArrayRecord ``shared`` with ``x`` [n, C, H, W]
float16 and ``y`` [n] int64; see :mod:`flowerbed.privacy`). The server pools them, in partition
order, into D_g and sends D_g to each client once (the first main round in which the client does not report
having it); clients keep it in ``context.state``. Main rounds are FedAvg with the clients'
objective CE(local) + λ·CE(D_g). ``fedxds-init``: ``scratch`` restarts the model from the
initial weights at the first main round (the official code), ``warmup`` keeps the warm-up model.
Every valid upload of the share round is pooled, also one whose reply is left out of the model
average (a bad model, or fewer valid replies than ``min-clients``): it has been released, and
asking again would release the same samples a second time with fresh noise. A share round
without any valid upload is repeated in the next round, so a run never goes on silently
without D_g.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from flowerbed.datasets.loading import IMAGE_SHAPES, NUM_CLASSES
from flowerbed.strategies.base import FlowerbedFedAvg, log, metric_record, with_record

SHARED = "shared"   # ArrayRecord {"x": [n, C, H, W] float16, "y": [n] int64}


class FedXDSStrategy(FlowerbedFedAvg):
    # D_g, which partitions already hold it, and the initial weights ("scratch" restarts from them)
    # and the round in which clients share (the last warm-up round, later if that one failed)
    checkpoint_attrs = ("pool", "has_pool", "_initial", "share_round")

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.pool: ArrayRecord | None = None
        self.has_pool: set[int] = set()
        self._pool_holder: dict[int, int] = {}  # partition -> the node that said it holds D_g (this run)
        self._initial: ArrayRecord | None = None
        self.share_round: int | None = None  # None: fedxds-warmup-rounds
        self._share_round = False

    def check_setup(self, num_partitions: int) -> None:
        self.cfg.resolved_sigma()  # an (epsilon, delta) opacus finds no noise for: a ConfigError

    def describe(self) -> dict:
        """Recorded in config.json: which noise was used and the resulting (ε, δ)."""
        from flowerbed.privacy import epsilon_for

        cfg = self.cfg
        sigma = cfg.resolved_sigma()
        secret = cfg.fedxds_noise == "secret"
        return {"fedxds-noise-from": "epsilon-delta" if cfg.fedxds_epsilon > 0 else "sigma",
                "fedxds-sigma-used": sigma, "fedxds-delta": cfg.fedxds_delta,
                # seeded noise can be regenerated from the run config and subtracted: no ε holds
                "fedxds-epsilon-per-unit-l2": epsilon_for(sigma, cfg.fedxds_delta) if secret else None,
                "fedxds-epsilon-note": ("Gaussian mechanism, one release, per unit L2 distance in "
                                        "normalised pixel space (fixed-mask argument; opacus RDP)"
                                        if secret else "fedxds-noise='seeded': the noise is "
                                        "reproducible from the run config, so it gives no privacy")}

    def _share_at(self) -> int:
        return self.share_round or self.cfg.fedxds_warmup_rounds

    def phase(self, server_round: int) -> str:
        r = self._share_at()
        return "warmup" if server_round < r else "share" if server_round == r else "main"

    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        self._initial = super().initial_arrays(model)
        return self._initial

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        phase = self.phase(server_round)
        config["fedxds-phase"] = phase
        if self._restarts(server_round):
            arrays = self._initial
        self._share_round = phase == "share"
        return super().configure_train(server_round, arrays, config, grid)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        """D_g goes (in training messages of the main phase) to each client without it yet."""
        config = content.config_records.get(self.configrecord_key)  # (evaluation's has no phase)
        if (self.pool is None or config is None or config.get("fedxds-phase") != "main"
                or self.holds_pool(node)):
            return content
        return with_record(content, SHARED, self.pool)

    def holds_pool(self, node: int) -> bool:
        """Whether ``node`` holds D_g: its partition said so, and no other node serves that
        partition now (a node that took a partition over holds none of its files)."""
        pid = self.partition_of.get(node)
        return pid in self.has_pool and self._pool_holder.get(pid, node) == node

    def _restarts(self, server_round: int) -> bool:
        """Whether ``server_round`` is the first main round, which starts from the initial weights
        (``fedxds-init='scratch'``)."""
        return (self.phase(server_round - 1) == "share" and self.cfg.fedxds_init == "scratch"
                and self._initial is not None)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None and self._restarts(server_round):
            # a skipped first main round still leaves the model where the main phase starts,
            # not at the warm-up model the next round would otherwise train on
            arrays = self._initial
        return arrays, metrics

    def sample(self, grid: Grid, server_round: int, fraction: float, stream: int) -> list[int]:
        # every client uploads its share of D_g once (the paper: all clients share), whatever
        # part of them fraction-train samples in the other rounds
        if stream == 0 and self._share_round:
            fraction = 1.0
        return super().sample(grid, server_round, fraction, stream)

    def check_arrays(self, content: RecordDict) -> str | None:
        if self._share_round:  # the shared samples, then the model as usual
            problem = check_shared(content.array_records.get(SHARED), self.cfg.dataset)
            if problem:
                return problem
            content = RecordDict({k: v for k, v in content.items() if k != SHARED})
        return super().check_arrays(content)

    def check_reply(self, reply: Message, is_train: bool) -> str | None:
        """A main-phase update made without D_g (the client's copy is gone: a lost state
        folder) lacks the shared term: left out, and D_g goes to that client again."""
        problem = super().check_reply(reply, is_train)
        if (problem or not is_train or self.pool is None or self._share_round
                or self.cfg.fedxds_lambda <= 0):
            return problem
        if metric_record(reply.content).get("has-pool") == 0:
            return "it holds no D_g (its copy is gone), so it did not train; D_g is sent to it again"
        return None

    def _released(self, replies: list[Message]) -> list[ArrayRecord]:
        """The valid uploads among ``replies``, in partition order, whatever else each reply holds."""
        destinations = self._destinations()
        parts = []
        for r in replies:
            if r.has_error():
                continue
            shared = r.content.array_records.get(SHARED)
            if check_shared(shared, self.cfg.dataset) is None:
                parts.append((self._sender(r, destinations)[1], shared))
        return [shared for _, shared in sorted(parts, key=lambda t: t[0])]

    def _check_and_log_replies(self, replies: Iterable[Message], is_train: bool,
                               validate: bool = True) -> tuple[list[Message], list[Message]]:
        replies = list(replies)
        parts = self._released(replies) if is_train and self._share_round else []
        valid, rejected = super()._check_and_log_replies(replies, is_train, validate)
        if not is_train:
            return valid, rejected
        # every checked reply says whether its client holds D_g, also in a round skipped for
        # fewer than min-clients replies (valid is then empty) and a reply refused for its model
        # (a NaN update): D_g is not resent needlessly, and is resent to a client that lost it
        said = {pid: m["train-has-pool"] for pid, m in self.round.clients.items() if "train-has-pool" in m}
        destinations = self._destinations()
        for r in rejected:
            if not r.has_error() and r.content.metric_records:
                flag = metric_record(r.content).get("has-pool")
                pid = self._sender(r, destinations)[1]
                if flag in (0, 1) and pid >= 0:
                    said.setdefault(pid, flag)
        for pid, flag in said.items():
            if flag == 1:
                self.has_pool.add(pid)
                self._pool_holder[pid] = self.node_of.get(pid, -1)
            else:  # e.g. a client restarted without its state: it gets D_g again next time
                self.has_pool.discard(pid)
        if self._share_round:
            # Pool the valid uploads (see the module docstring), then strip them from the replies
            # so that FedAvg averages the models only.
            for r in replies:
                if not r.has_error() and SHARED in r.content.array_records:
                    del r.content[SHARED]
            if parts:
                self.pool = ArrayRecord({
                    "x": Array(np.concatenate([p["x"].numpy() for p in parts])),
                    "y": Array(np.concatenate([p["y"].numpy() for p in parts]))})
                log.info("FedXDS: pooled %d shared samples from %d of %d clients into D_g",
                         len(self.pool["y"].numpy()), len(parts), len(self._sent))
            elif (rnd := self._share_at()) < self.cfg.num_server_rounds:
                self.share_round = rnd + 1
                log.warning("FedXDS: no valid shared samples in round %d; round %d asks every "
                            "client to share again (one main round fewer)", rnd, rnd + 1)
            else:
                log.warning("FedXDS: no valid shared samples in the last round %d; the run ends "
                            "without D_g", rnd)
            self._share_round = False
        return valid, rejected


def check_shared(shared: ArrayRecord | None, dataset: str) -> str | None:
    """None when ``shared`` holds x [n, C, H, W] (the data set's image shape, n ≥ 1, finite) and
    y [n], integer labels of the data set's classes."""
    if shared is None:
        return f"missing ArrayRecord '{SHARED}'"
    if set(shared) != {"x", "y"}:
        return f"'{SHARED}' must hold 'x' and 'y', got {sorted(shared)}"
    x, y = shared["x"].numpy(), shared["y"].numpy()
    if x.ndim != 4 or y.shape != (x.shape[0],):
        return f"shared samples have shapes {x.shape} and {y.shape}"
    if not len(y):
        return "no shared samples"
    if x.shape[1:] != IMAGE_SHAPES[dataset]:
        return f"shared images have shape {x.shape[1:]}, {dataset}'s are {IMAGE_SHAPES[dataset]}"
    if not np.isfinite(x.astype(np.float32)).all():
        return "shared samples hold NaN or inf values"
    if y.dtype.kind not in "iu":
        return f"shared labels have dtype {y.dtype}, expected integers"
    if y.min() < 0 or y.max() >= NUM_CLASSES[dataset]:
        return f"shared labels outside 0..{NUM_CLASSES[dataset] - 1} ({y.min()}..{y.max()})"
    return None
