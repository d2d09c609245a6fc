"""FedXDS client: FedAvg training; once, privatised shared samples; then local + λ·shared loss.

In the sharing round the client trains as usual, then takes ``fedxds-share-fraction`` of its
training samples (seeded), computes attributions with its own locally trained model for their
true labels (:mod:`flowerbed.attribution`), masks, clips and noises them
(:mod:`flowerbed.privacy`) and uploads them with their labels. Nothing unmasked or noise-free
leaves the client (``fedxds-mask='none'`` is the "unmasked, noised" baseline; noise is always
added, drawn from the OS's randomness unless ``fedxds-noise='seeded'``). The pooled D_g
arrives once and is kept in a file beside the client's filed state
(``<client-state-dir>/<run-key>/fedxds-pool-<digest>.pt``, written once), with only its digest
in ``context.state``: D_g (47 MB for Fashion-MNIST, about 300 MB for CIFAR) is not carried in
the context Flower passes around with every message, nor filed again every round. The client's own
release (drawn once, re-sent if its share round is repeated) is kept the same way, in
``<client-state-dir>/<run-key>/partition-<i>/fedxds-release.pt``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from torch import nn
from torch.nn import functional as F

from flowerbed import client_state
from flowerbed.attribution import attribute
from flowerbed.checkpoint import digest, write_synced
from flowerbed.clients.base import Client
from flowerbed.privacy import privatise
from flowerbed.strategies.fedxds import SHARED
from flowerbed.training import cycled_batches, generator_of, seeded_generator, to_record

log = logging.getLogger("flowerbed")
STATE = "fedxds.pool"  # ConfigRecord {"digest": D_g's}: D_g itself is in pool_file()
RELEASE_FILE = "fedxds-release.pt"  # this client's own upload to D_g, in its state folder
# where the release was kept before (state filed by an older flowerbed; a message without a run key)
RELEASED = client_state.RELEASED + "fedxds.shared"


class FedXDSClient(Client):
    keeps_state = True

    def sigma(self) -> float:
        return self.cfg.resolved_sigma()

    def shared_samples(self, model: nn.Module, rnd: int) -> ArrayRecord:
        """Privatised (masked, clipped, noised) samples of this client, with their labels."""
        cfg, data = self.cfg, self.train_data
        if not len(data):
            raise ValueError(f"partition {self.partition_id} has no training samples to share "
                             "(min-partition-size allowed an empty partition)")
        rng = np.random.default_rng([cfg.seed, self.partition_id, 17])
        n = max(1, int(round(len(data) * cfg.fedxds_share_fraction)))
        idx = np.sort(rng.permutation(len(data))[:n])
        x = data.normalise(data.x[idx].to(self.device))
        y = data.y[idx].to(self.device)
        # noise the server could regenerate from the run config would protect nothing: by
        # default it comes from the OS's randomness, never from the run's seed
        gen = (generator_of(cfg.seed, self.partition_id, rnd, 31337) if cfg.fedxds_noise == "seeded"
               else torch.Generator().manual_seed(secrets.randbits(63)))
        out = self.privatised(model, x, y, gen)
        return ArrayRecord({"x": Array(out.numpy().astype(np.float16)),
                            "y": Array(y.cpu().numpy().astype(np.int64))})

    def privatised(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   gen: torch.Generator) -> torch.Tensor:
        """Normalised images ``x`` of labels ``y`` as they leave the client: masked by their
        attributions under ``model`` (or not: ``fedxds-mask='none'``), clipped, noised (CPU)."""
        cfg = self.cfg
        heat = None if cfg.fedxds_mask == "none" else attribute(
            model, x, y, cfg.fedxds_attribution, lrp_first=cfg.fedxds_lrp_first).cpu()
        return privatise(x.detach().cpu(), heat, sparsity=cfg.fedxds_sparsity, mask_kind=cfg.fedxds_mask,
                         clip=cfg.fedxds_clip, sigma=self.sigma(), generator=gen)

    def train(self, msg: Message) -> Message:
        cfg, rnd = self.cfg, self.round_of(msg)
        phase = str(msg.content["config"].get("fedxds-phase", "warmup"))
        run_key = client_state.run_key_of(msg)
        self.file_older_release(run_key)
        if SHARED in msg.content.array_records:
            self.keep_pool(msg.content[SHARED], run_key)
        model = self.model_from(msg.content["arrays"])
        pool = self.pool(run_key)
        needs_pool = phase == "main" and cfg.fedxds_lambda > 0
        if needs_pool and pool is None:
            # its D_g is gone (a lost state folder): an update without the shared term is not
            # FedXDS's; the server leaves this reply out and sends D_g again
            log.warning("partition %d: holds no D_g in a main round; not training until the "
                        "server sends it again", self.partition_id)
            return self.reply(msg, {"num-examples": len(self.train_data), "has-pool": 0},
                              arrays=to_record(model))
        hooks = {}
        if needs_pool:
            hooks["loss_hook"] = self._shared_term(pool, seeded_generator(cfg.seed, self.partition_id,
                                                                         rnd, 7))
        loss, _ = self.fit(model, msg, rnd, **hooks)
        metrics = {"num-examples": len(self.train_data), "train-loss": loss,
                   "has-pool": int(pool is not None)}
        extra = {SHARED: self.release(model, rnd, run_key)} if phase == "share" else {}
        return self.reply(msg, metrics, arrays=to_record(model), **extra)

    def release(self, model: nn.Module, rnd: int, run_key: str) -> ArrayRecord:
        """The client's shared samples, drawn once and filed before they leave: a repeated share
        round (a retry, or a resumed run whose server died before that round's checkpoint)
        re-sends the same release; a fresh draw of noise on the same images would add up to less
        noise than the recorded ε. The file is not in ``context.state``, which Flower carries with
        every message and the client files every round (up to hundreds of MB on SVHN). A message
        without a run key (never the server's) files nothing: the release stays in the context."""
        state = self.context.state
        if not run_key:
            if RELEASED not in state.array_records:
                state[RELEASED] = self.shared_samples(model, rnd)
            return state[RELEASED]
        self.file_older_release(run_key)
        here = self._release_path(run_key)
        filed = client_state.filed_file(self.cfg, run_key, self.partition_id, RELEASE_FILE)
        if filed is None:
            self._file_release(run_key, self.shared_samples(model, rnd))
        try:  # (what is filed, also where another handler of this partition filed its draw first)
            kept = torch.load(filed or here, map_location="cpu", weights_only=True)
            released = ArrayRecord({k: Array(kept[k].numpy()) for k in ("x", "y")})
        except Exception as e:  # never a second draw behind the user's back
            why = (str(e).splitlines() or [""])[0][:120]
            raise RuntimeError(
                f"partition {self.partition_id}: its FedXDS release {filed or here} is unreadable "
                f"({type(e).__name__}: {why}); a new draw of noise would weaken the stated "
                "(ε, δ). Restore the file, or remove it to release anew at that cost") from e
        if filed is not None and filed != here:  # under the run's former name: kept here too,
            try:  # with the run's own files
                self._file_release(run_key, released)
            except OSError as e:
                log.warning("partition %d: could not file its release under the run's new name "
                            "(%s); it stays in %s only", self.partition_id, e, filed)
        return released

    def file_older_release(self, run_key: str) -> None:
        """A release an older flowerbed kept in the client's state (restored with it) moves to
        its file, out of the context."""
        state = self.context.state
        if run_key and RELEASED in state.array_records:
            if client_state.filed_file(self.cfg, run_key, self.partition_id, RELEASE_FILE) is None:
                self._file_release(run_key, state[RELEASED])
            del state[RELEASED]

    def _file_release(self, run_key: str, released: ArrayRecord) -> None:
        """Filed only where none is (of two handlers of this partition at once, the first
        wins; the other sends the winner's)."""
        with contextlib.suppress(FileExistsError):
            _write_xy(self._release_path(run_key), released, exclusive=True)

    def _release_path(self, run_key: str) -> Path:
        return client_state.folder(self.cfg, run_key, self.partition_id) / RELEASE_FILE

    def pool_file(self, run_key: str, digest: str) -> Path:
        """Beside the run's filed client state (the run-key checked as there)."""
        run_dir = client_state.folder(self.cfg, run_key or "no-run-key", self.partition_id).parent
        return run_dir / f"fedxds-pool-{digest}.pt"

    def keep_pool(self, shared: ArrayRecord, run_key: str) -> None:
        """Write D_g to its file (once: clients on one machine share it) and its digest to the
        state."""
        key = digest(shared)
        path = self.pool_file(run_key, key)
        if not path.exists():
            _write_xy(path, shared)
        self.context.state[STATE] = ConfigRecord({"digest": key})

    def pool(self, run_key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """D_g as (x float16, y int64), or None if this client holds none (never received, or
        its file is gone: it says so, and the server sends D_g again)."""
        kept = self.context.state.config_records.get(STATE)
        if kept is None:
            return None
        path = self.pool_file(run_key, str(kept["digest"]))
        try:
            return _load_pool(str(path)) if path.exists() else None
        except Exception as e:  # noqa: BLE001 - damaged (a crash, a full disk): as if missing,
            log.warning("partition %d: D_g's file %s is unreadable (%s); removed, the server "
                        "sends D_g again", self.partition_id, path, type(e).__name__)
            path.unlink(missing_ok=True)  # so that the resent D_g is written afresh
            return None

    def _shared_term(self, pool: tuple[torch.Tensor, torch.Tensor], gen: torch.Generator):
        """λ·CE on the next batch of D_g (cycled, shuffled), added to every local batch's loss."""
        x, y = pool
        lam = self.cfg.fedxds_lambda
        it = cycled_batches(len(y), self.cfg.batch_size, gen)

        def hook(m: nn.Module) -> torch.Tensor:
            idx = next(it)
            return lam * F.cross_entropy(m(x[idx].to(self.device).float()), y[idx].to(self.device))

        return hook


def _write_xy(path: Path, record: ArrayRecord, exclusive: bool = False) -> None:
    """Samples ``x`` and labels ``y`` of ``record`` to ``path``, atomically, on disk on return
    (``exclusive``: :func:`~flowerbed.results.write_atomic`'s)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_synced(path, {k: torch.from_numpy(record[k].numpy()) for k in ("x", "y")}, exclusive)


@functools.lru_cache(maxsize=1)
def _load_pool(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """D_g from its file, read once per process (a simulation actor serves many clients, all
    with the same D_g)."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    return data["x"], data["y"].long()
