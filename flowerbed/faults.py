"""Fault injection for tests and demos (off by default): clients that raise or send bad replies.

Which clients misbehave in a round is drawn from (seed, partition, round), so a run with faults
is as reproducible as one without. Kinds: ``raise`` (the ClientApp raises), ``nan`` (the reply's
arrays hold NaN), ``shape`` (an array has the wrong shape).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict

from flowerbed.config import Config

KINDS = ("raise", "nan", "shape")


class InjectedFault(RuntimeError):
    """Raised by a client chosen to fail (fault-kind = raise)."""


def chosen(cfg: Config, partition_id: int, server_round: int) -> bool:
    if cfg.fault_fraction <= 0:
        return False
    return np.random.default_rng([cfg.seed, partition_id, server_round, 4242]).random() < cfg.fault_fraction


def inject(cfg: Config, partition_id: int, msg: Message, make_reply: Callable[[], Message]
           ) -> Message:
    """``make_reply()`` for training message ``msg``, unless this client is chosen to fail."""
    server_round = int(msg.content["config"].get("server-round", 0))
    if not chosen(cfg, partition_id, server_round):
        return make_reply()
    if cfg.fault_kind == "raise":
        raise InjectedFault(f"injected fault: partition {partition_id} raises in round {server_round}")
    reply = make_reply()
    content = RecordDict()
    for name, record in reply.content.items():
        if isinstance(record, ArrayRecord) and len(record):
            arrays = dict(record.items())
            key = next(iter(arrays))
            a = arrays[key].numpy()
            bad = np.full_like(a, np.nan) if cfg.fault_kind == "nan" else np.zeros(a.size + 1, a.dtype)
            arrays[key] = Array(bad)
            record = ArrayRecord(arrays)
        content[name] = record
    return Message(content=content, reply_to=msg)
