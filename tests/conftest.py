"""Shared fixtures: a real local SuperLink for end-to-end runs, and fake replies for unit tests."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, RecordDict

from flowerbed.config import Config

_ids = itertools.count(1)


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs 2 workers) one torch thread per worker, and per engine
    process it starts: on 2 cores, two workers with two threads each only spin against each other."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _task_identity():
    """Flower stamps messages with the running task's identity; give unit tests one."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield


@pytest.fixture(scope="session")
def superlink(tmp_path_factory):
    """One simulation SuperLink (this venv, no per-run installs) for every end-to-end test."""
    from flowerbed import engine

    home = tmp_path_factory.mktemp("flwr-home")
    with engine.local_superlink(home=home) as (h, conn):
        yield h, conn


def sent(node_id: int, content: RecordDict | None = None, mtype: str = "train") -> Message:
    """A server->client message as the Grid would have sent it (message id filled in)."""
    msg = Message(content=content or RecordDict(), message_type=mtype, dst_node_id=node_id)
    msg.metadata.__dict__["_message_id"] = f"m{next(_ids)}"
    return msg


def prepared(strategy, nodes: list[int]) -> list[Message]:
    """A strategy that 'sent' a training message to each node (partition i = nodes[i])."""
    for i, n in enumerate(nodes):
        strategy.node_of[i], strategy.partition_of[n] = n, i
    strategy.num_partitions = len(nodes)
    strategy._sent = [sent(n) for n in nodes]
    return strategy._sent


def train_messages(strategy, rnd: int, arrays, grid) -> list[Message]:
    """Round ``rnd``'s training messages from ``strategy.configure_train``, with the ids the Grid
    would stamp on them when it sends them (replies name the message they answer)."""
    from flwr.app import ConfigRecord

    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
    for m in msgs:
        m.metadata.__dict__["_message_id"] = f"r{rnd}-{m.metadata.dst_node_id}"
    return msgs


class StreamClient:
    """A stream method's (Fed-ADE, Fed-POE, ATLAS) server half and the client of partition 1 of
    3 on node 2, called directly: ``train(rnd)`` hands the client round ``rnd``'s message."""

    def __init__(self, run_config: dict) -> None:
        from flwr.app import Context

        from flowerbed.registry import METHODS

        self.cfg = Config.from_run_config(run_config)
        self.strategy = METHODS[self.cfg.method].strategy(self.cfg)
        self.arrays = self.strategy.initial_arrays(None)
        self.ctx = Context(run_id=1, node_id=2, node_config={"partition-id": 1, "num-partitions": 3},
                           state=RecordDict(), run_config=self.cfg.to_run_config())
        self.client = METHODS[self.cfg.method].client(self.cfg, self.ctx)

    def message(self, rnd: int) -> Message:
        from flwr.app import ConfigRecord

        content = self.strategy.train_content(rnd, self.arrays, ConfigRecord({"server-round": rnd}))
        return sent(2, self.strategy.content_for(2, content))

    def train(self, rnd: int) -> Message:
        return self.client.train(self.message(rnd))


class FakeGrid:
    """The one Grid call sampling makes: which nodes are connected."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def bn_record(v: float, var: float = 1.0, n: int | None = None) -> ArrayRecord:
    """A BatchNorm1d(2)'s arrays: weight, bias and running mean v, running variance var, and
    num_batches_tracked n (int64) unless None."""
    arrays = {k: Array(np.full(2, val, np.float32)) for k, val in
              (("weight", v), ("bias", v), ("running_mean", v), ("running_var", var))}
    if n is not None:
        arrays["num_batches_tracked"] = Array(np.array(n, np.int64))
    return ArrayRecord(arrays)


def reply(to: Message, content: RecordDict) -> Message:
    return Message(content=content, reply_to=to)


def error_reply(to: Message, reason: str = "Traceback...\nValueError: boom") -> Message:
    return Message(error=Error(code=2, reason=reason), reply_to=to)


@pytest.fixture
def cfg() -> Config:
    return Config.from_run_config({"min-clients": 1})


def pytest_sessionfinish(session, exitstatus):
    """Let in-process clients that outlived their round (slower than its timeout) finish before exit."""
    import sys

    for worker in getattr(sys.modules.get("inprocess"), "STRAGGLERS", []):
        worker.join()
