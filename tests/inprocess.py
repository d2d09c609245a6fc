"""An in-process Grid for tests of our own round logic: the real ServerApp ``run`` and the real
ClientApp, without Flower's transport (messages are deep-copied as serialisation would).

Used where a matrix over every method would be too slow through real engines (resume equality,
each fault kind); the real engines are covered by test_e2e.py and test_deploy.py.
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Iterable

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from flowerbed import faults
from flowerbed.apps import client_app, server_app
from flowerbed.config import Config

#: client threads still running after their round stopped waiting (slower than round-timeout): joined at
#: the end of the session (conftest), since a daemon thread inside torch when the interpreter
#: exits aborts it ("terminate called without an active exception", exit 134 after all passed)
STRAGGLERS: list[threading.Thread] = []


class LocalGrid(Grid):
    def __init__(self, run_config: dict, num_nodes: int, node_extra: list[dict] | None = None) -> None:
        self.contexts = {
            1000 + i: Context(run_id=1, node_id=1000 + i,
                              node_config={"partition-id": i, "num-partitions": num_nodes,
                                           **(node_extra[i] if node_extra else {})},
                              state=RecordDict(), run_config=dict(run_config))
            for i in range(num_nodes)}
        self.timeouts: list[tuple[str, float | None]] = []  # (message type, timeout) a call was given

    def set_run(self, run) -> None:  # noqa: D102
        pass

    @property
    def run(self):  # noqa: D102
        return None

    def create_message(self, *a, **k):  # noqa: D102
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages):  # noqa: D102
        raise NotImplementedError

    def pull_messages(self, message_ids):  # noqa: D102
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        replies = []
        messages = list(messages)
        self.timeouts += [(m.metadata.message_type, timeout) for m in messages]
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ctx = self.contexts[msg.metadata.dst_node_id]
            if self._hangs(msg, ctx):  # no reply, as from a real client that answers too late, at
                continue  # no cost in time: a loaded machine's clock has no say in which rounds fail
            box: list[Message] = []
            worker = threading.Thread(target=lambda m=msg, c=ctx, b=box: b.append(self._call(m, c)),
                                      daemon=True)
            worker.start()
            worker.join(timeout)  # per message: a hanging client does not starve the others
            if worker.is_alive():
                STRAGGLERS.append(worker)
            if box:
                replies.append(box[0])
        return replies

    @staticmethod
    def _hangs(msg: Message, ctx: Context) -> bool:
        """Whether the client is chosen for a "hang" fault in this training round: ``faults.inject``
        would sleep past the round's timeout before it answered."""
        if msg.metadata.message_type != MessageType.TRAIN:
            return False
        cfg, partition = Config.from_run_config(ctx.run_config), ctx.node_config["partition-id"]
        rnd = int(msg.content["config"].get("server-round", 0))
        return faults.chosen(cfg, partition, rnd) and faults.kind_of(cfg, partition, rnd) == "hang"

    @staticmethod
    def _call(msg: Message, ctx: Context) -> Message:
        incoming = copy.deepcopy(msg)
        try:
            reply = client_app.app(incoming, ctx)
        except Exception as e:  # noqa: BLE001 - what Flower's runtime turns into an error reply
            # (as Flower's runtime words it: str(type) + the message)
            reason = str(type(e)) + ":<'" + str(e) + "'>"
            return Message(error=Error(code=2, reason=reason), reply_to=incoming)
        return copy.deepcopy(reply)


def run_inprocess(run_config: dict, num_nodes: int, node_extra: list[dict] | None = None) -> dict:
    """The ServerApp's whole run against in-process clients (``node_extra``: each node's
    node-config beyond its partition, e.g. a data-dir); returns summary.json's content."""
    cfg = Config.from_run_config(run_config)
    return server_app.run(LocalGrid(cfg.to_run_config(), num_nodes, node_extra), cfg)
