"""Server checkpoints: everything a run needs to continue after a crash, in ``<run-dir>/checkpoint.pt``.

Written at the end of every round (after the round's metrics line), atomically: the new file is
written next to the old one, flushed to disk, then renamed over it, so a crash mid-write leaves
the previous checkpoint intact. Contents: the round, the loop's global arrays (the model, K
models, or soft targets, depending on the method), the strategy's own state (SCAFFOLD's server
control variate, FedXDS's pooled shared set and who holds it, ...; see each strategy's
``checkpoint_attrs``), the server's RNG states and the run config.

Large ArrayRecords of the strategy's state (:data:`BLOB_MIN` bytes or more: FedXDS's D_g and
initial weights) are kept beside it, each in ``checkpoint-blobs/<digest>.pt``,
written when its content is new and removed once no checkpoint names it: D_g (tens to hundreds
of MB) is written once per run instead of every round.

Loading uses ``torch.load(weights_only=True)``: tensors and plain containers only, so a crafted
checkpoint cannot run code. Every problem (missing, truncated, corrupt, from another method or
config, already finished) is a :class:`CheckpointError` that names the file and the problem.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from flowerbed.results import write_atomic

FILE = "checkpoint.pt"
FORMAT = 2  # 2: large strategy records in checkpoint-blobs/ (older code refuses it by this number)
READABLE = (1, 2)
#: run-config keys that may differ between a run and its resumption
RESUMABLE_CHANGES = frozenset({"resume", "run-name", "output-dir", "num-server-rounds",
                               "round-timeout", "server-device", "fault-fraction", "fault-kind",
                               "fault-crash-after"})


def resumable_changes(saved: dict[str, Any]) -> frozenset[str]:
    """:data:`RESUMABLE_CHANGES` for the run whose config is ``saved``: a Fed-ADE (or Fed-POE)
    run's streams (their shift schedule, the time steps) are built for its number of rounds, so
    more rounds would be another stream with the earlier steps' rows kept from the first."""
    from flowerbed.config import STREAM_METHODS

    if saved.get("method") in STREAM_METHODS:
        return RESUMABLE_CHANGES - {"num-server-rounds"}
    return RESUMABLE_CHANGES


#: why a run whose :func:`resumable_changes` leave out num-server-rounds is not extended
NOT_EXTENDABLE = ("a Fed-ADE, Fed-POE or ATLAS run cannot be extended (its streams are built for its number "
                  "of rounds)")


def extendable(saved: dict[str, Any]) -> bool:
    """Whether the finished run whose config is ``saved`` may go on with more rounds."""
    return "num-server-rounds" in resumable_changes(saved)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used to resume; the message names the file and the reason."""


# ---------------------------------------------------------------------- encoding

BLOBS = "checkpoint-blobs"
#: ArrayRecords of the strategy's state at least this large are kept in blob files
BLOB_MIN = 1 << 20


def digest(rec: ArrayRecord) -> str:
    """The record's content digest (hashed at every save: a record changed in place must never
    keep an earlier digest; about 0.1 s for Fashion-MNIST's D_g against writing it again)."""
    h = hashlib.sha256()
    for k, v in rec.items():
        h.update(f"{k}|{v.dtype}|{v.shape}|".encode())
        h.update(v.data)
    return h.hexdigest()[:32]


def encode(obj: Any, blobs: dict[str, ArrayRecord] | None = None) -> Any:
    """Strategy state -> tensors and plain containers (what weights_only loading accepts).
    With ``blobs``, ArrayRecords of :data:`BLOB_MIN` bytes or more go there, by digest, and
    are named by it."""
    if isinstance(obj, ArrayRecord):
        if blobs is not None and sum(len(v.data) for v in obj.values()) >= BLOB_MIN:
            blobs[d := digest(obj)] = obj
            return {"__blob__": d}
        return {"__arrayrecord__": {k: torch.from_numpy(np.array(v.numpy())) for k, v in obj.items()}}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.array(obj))}
    if isinstance(obj, set):
        return {"__set__": sorted(obj)}
    if isinstance(obj, dict):
        return {str(k): encode(v, blobs) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode(v, blobs) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def decode(obj: Any, blob_dir: Path | None = None) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__arrayrecord__"}:
            return ArrayRecord({k: Array(v.numpy()) for k, v in obj["__arrayrecord__"].items()})
        if set(obj) == {"__blob__"}:
            path = Path(blob_dir or ".") / f"{obj['__blob__']}.pt"
            try:
                return decode(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # noqa: BLE001 - missing, truncated, not ours
                raise ValueError(f"its blob {path} is missing or unreadable ({type(e).__name__})"
                                 ) from None
        if set(obj) == {"__ndarray__"}:
            return obj["__ndarray__"].numpy()
        if set(obj) == {"__set__"}:
            return set(obj["__set__"])
        return {k: decode(v, blob_dir) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, blob_dir) for v in obj]
    return obj


def write_synced(path: Path, payload: Any, exclusive: bool = False) -> None:
    """``torch.save`` to ``path`` atomically (:func:`~flowerbed.results.write_atomic`)."""
    write_atomic(path, lambda f: torch.save(payload, f), exclusive)


# ---------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    kind, keys, *rest = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), *rest],
            "python": repr(random.getstate())}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    random.setstate(ast.literal_eval(state["python"]))


# ---------------------------------------------------------------------- save / load


def save(run_dir: Path, server_round: int, arrays: ArrayRecord, strategy_state: dict[str, Any],
         config: dict[str, Any]) -> Path:
    """Write ``<run_dir>/checkpoint.pt`` for a finished round, atomically."""
    path = Path(run_dir) / FILE
    blobs: dict[str, ArrayRecord] = {}
    payload = {"format": FORMAT, "round": int(server_round), "arrays": encode(arrays),
               "strategy": encode(strategy_state, blobs), "rng": rng_state(),
               "config": encode({k: v for k, v in config.items()})}
    blob_dir = Path(run_dir) / BLOBS
    named = {f"{d}.pt": rec for d, rec in blobs.items()}
    for name, rec in named.items():  # every blob on disk before the checkpoint that names it
        if not (blob_dir / name).exists():
            blob_dir.mkdir(exist_ok=True)
            write_synced(blob_dir / name, encode(rec))
    write_synced(path, payload)
    for old in blob_dir.iterdir() if blob_dir.is_dir() else []:  # named by no checkpoint now,
        if old.name not in named:  # or a write a crash left unfinished
            old.unlink(missing_ok=True)
    return path


def load(run_dir: Path) -> dict[str, Any]:
    """The checkpoint of ``run_dir``, decoded and checked; raises :class:`CheckpointError`."""
    run_dir = Path(run_dir)
    path = run_dir / FILE
    if not run_dir.is_dir():
        raise CheckpointError(f"resume: {run_dir} is not a run directory")
    if not path.is_file():
        raise CheckpointError(f"resume: {path} does not exist (a run writes it after each round; "
                              "did the run finish round 1?)")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, pickle errors, forbidden globals...
        raise CheckpointError(f"resume: {path} is corrupt or truncated ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from None
    missing = {"format", "round", "arrays", "strategy", "rng", "config"} - set(raw) \
        if isinstance(raw, dict) else {"everything"}
    if missing:
        raise CheckpointError(f"resume: {path} is not a flowerbed checkpoint (missing {sorted(missing)})")
    if raw["format"] not in READABLE:
        raise CheckpointError(f"resume: {path} has format {raw['format']}, this flowerbed reads "
                              f"{', '.join(map(str, READABLE))}")
    if not isinstance(raw["round"], int) or raw["round"] < 1:
        raise CheckpointError(f"resume: {path} holds round {raw['round']!r}, expected an integer >= 1")
    try:
        out = {k: decode(raw[k], run_dir / BLOBS) for k in ("arrays", "strategy", "config")}
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"resume: {path} holds malformed state ({e})") from None
    return {**out, "round": raw["round"], "rng": raw["rng"]}


def finished_rounds(run_dir: Path) -> int | None:
    """How many rounds the run in ``run_dir`` finished, or None when it has not finished (no
    ``summary.json``: it is running, stopped, or its extension crashed, which sets the summary
    aside). The one test of "has this run finished?" for the launcher, ``compare --resume`` and
    the ServerApp's resume."""

    if not (Path(run_dir) / "summary.json").is_file():
        return None
    # no readable config: nothing to compare against (the resume names the damage)
    rounds = saved_config(run_dir).get("num-server-rounds")
    return rounds if isinstance(rounds, int) else None


def saved_config(run_dir: Path) -> dict[str, Any]:
    """``run_dir``'s config.json ({} when it is missing, unreadable or not a table)."""
    import json

    with contextlib.suppress(OSError, ValueError, TypeError):
        saved = json.loads((Path(run_dir) / "config.json").read_text())
        return saved if isinstance(saved, dict) else {}
    return {}


def finished_reason(run_dir: Path, asked: int, reached: int | None = None) -> str | None:
    """Why the run in ``run_dir`` cannot continue to ``asked`` rounds, or None if it can: it
    finished that many rounds or more, or (``reached``, its checkpoint's round) went past them."""
    done = finished_rounds(run_dir)
    if done is not None and done >= asked:
        if not extendable(saved_config(run_dir)):
            return (f"the run in {run_dir} already finished {done} rounds; {NOT_EXTENDABLE}: start "
                    "the longer run in another folder")
        return (f"the run in {run_dir} already finished {done} rounds; raise num-server-rounds "
                "to extend it (--rounds N, or -c num-server-rounds=N)")
    if reached is not None and reached > asked:
        return f"the run in {run_dir} stopped after round {reached}, past the {asked} asked for"
    return None


#: a key added later -> the key whose value it took before (its value in older checkpoints)
INHERITED = {"fedx-tau-local": "fedx-tau-target"}


def with_added_keys(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (an older run's config) with the keys added since (num-partitions,
    fedxds-noise, ssl-augment, ...) at their value in ``current``, or at that of the key that
    used to serve for them (:data:`INHERITED`)."""
    return {**{k: saved[INHERITED[k]] if INHERITED.get(k) in saved else v
               for k, v in current.items() if k not in saved}, **saved}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"key: old -> new"`` for each run-config key of ``current`` that differs from ``saved``'s
    (:func:`with_added_keys`), :data:`RESUMABLE_CHANGES` aside. What the launcher refuses before
    a resume starts."""
    free = resumable_changes(saved)
    saved = with_added_keys(saved, current)
    return [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in current.items()
            if k not in free and saved.get(k, v) != v]


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """A resumed run must be the same experiment: only :data:`RESUMABLE_CHANGES` may differ."""
    free = resumable_changes(saved)
    diff = sorted(k for k in set(saved) | set(current) if k not in free and saved.get(k) != current.get(k))
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff[:5])
        raise CheckpointError(f"resume: the run config differs from the checkpoint's in {shown} "
                              f"({path}); pass the original run config again (it is in the run's "
                              f"config.json; `flowerbed run --resume <run-dir>` does that), only "
                              f"{sorted(free)} may change"
                              + (" (a Fed-ADE, Fed-POE or ATLAS run's streams are built for its number of "
                                 "rounds)"
                                 if free != RESUMABLE_CHANGES else ""))
