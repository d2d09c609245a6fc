"""Fault injection for tests and demos (off by default): clients that raise or send bad replies.

Which clients misbehave in a round is drawn from (seed, partition, round), so a run with faults
is as reproducible as one without. Kinds: ``raise`` (the ClientApp raises), ``nan`` (the reply's
arrays hold NaN), ``shape`` (an array has the wrong shape), ``hang`` (the client answers only after
the round's ``round-timeout``, so the server has moved on: a client that never answers), and
``mixed`` (each chosen client shows one of these, cycling with partition and round).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from flowerbed.config import Config

KINDS = ("raise", "nan", "shape", "hang")


class SimulatedCrash(RuntimeError):
    """Raised by the ServerApp after round ``fault-crash-after``'s checkpoint: the run dies there
    (no summary), as it would if the server were killed, so that tests and demos can resume it."""


class InjectedFault(RuntimeError):
    """Raised by a client chosen to fail (fault-kind = raise)."""


def chosen(cfg: Config, partition_id: int, server_round: int) -> bool:
    if cfg.fault_fraction <= 0:
        return False
    return np.random.default_rng([cfg.seed, partition_id, server_round, 4242]).random() < cfg.fault_fraction


def kind_of(cfg: Config, partition_id: int, server_round: int) -> str:
    """The fault a chosen client shows; ``mixed`` cycles through every kind."""
    if cfg.fault_kind != "mixed":
        return cfg.fault_kind
    return KINDS[(partition_id + server_round) % len(KINDS)]


def inject(cfg: Config, partition_id: int, msg: Message, make_reply: Callable[[], Message]
           ) -> Message:
    """``make_reply()`` for training message ``msg``, unless this client is chosen to fail."""
    server_round = int(msg.content["config"].get("server-round", 0))
    if not chosen(cfg, partition_id, server_round):
        return make_reply()
    kind = kind_of(cfg, partition_id, server_round)
    if kind == "raise":
        raise InjectedFault(f"injected fault: partition {partition_id} raises in round {server_round}")
    if kind == "hang":
        time.sleep(cfg.round_timeout + 1.0)  # the reply arrives after the server stopped waiting
        return make_reply()
    reply = make_reply()
    content = RecordDict()
    corrupted = False
    for name, record in reply.content.items():
        if isinstance(record, ArrayRecord) and len(record) and not corrupted:
            arrays = dict(record.items())
            key = next(iter(arrays))
            a = arrays[key].numpy()
            bad = np.full_like(a, np.nan) if kind == "nan" else np.zeros(a.size + 1, a.dtype)
            arrays[key] = Array(bad)
            record, corrupted = ArrayRecord(arrays), True
        content[name] = record
    if not corrupted:  # a reply of metrics only (Local): corrupt those
        for name, record in content.metric_records.items():
            values = dict(record)
            n = values.get("num-examples", 1)
            values["num-examples"] = float("nan") if kind == "nan" else [float(n), float(n)]
            content[name] = MetricRecord(values)
    return Message(content=content, reply_to=msg)
