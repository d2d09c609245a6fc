"""ClientApp: hands each message to the client class of the run's ``method``."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from flowerbed.clients.base import Client
from flowerbed.config import Config
from flowerbed.faults import inject
from flowerbed.registry import METHODS

app = ClientApp()


def client_for(context: Context) -> Client:
    """The method's client for this node (data cached per process, state in context.state).

    A SuperNode's ``--node-config data-root=...`` overrides the run's ``data-root`` (where this
    machine keeps the data set); ``data-dir=...`` (read in ``Client``) replaces the seeded
    partition by the node's own data folder.
    """
    node_root = context.node_config.get("data-root")
    overrides = {"data-root": str(node_root)} if node_root else {}
    cfg = Config.from_run_config(context.run_config, **overrides)
    return METHODS[cfg.method].client(cfg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    client = client_for(context)
    return inject(client.cfg, client.partition_id, msg, lambda: client.train(msg))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return client_for(context).evaluate(msg)


@app.query("whoami")
def whoami(msg: Message, context: Context) -> Message:
    return client_for(context).whoami(msg)
