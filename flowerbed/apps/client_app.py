"""ClientApp: hands each message to the client class of the run's ``method``."""

from __future__ import annotations

import functools
from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from flowerbed import client_state
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


def _restored(client: Client, msg: Message, evaluating: bool = False) -> str:
    """A client process's first message in a run (a resumed run, a restarted SuperNode): its
    filed state goes back into context.state first."""
    key = client_state.run_key_of(msg)
    client_state.restore(client.cfg, client.context, key, client.partition_id, client.round_of(msg),
                         client.keeps_state, client_state.resumed_after_of(msg), evaluating)
    return key


def _naming_missing_keys(handler: Callable[[Message, Context], Message]):
    """A KeyError while handling a message (a record, config key or node-config key the method
    needs is missing) becomes an error naming the key, the message type and the method: Flower's
    simulation keeps only the exception's text, which for a KeyError is the bare key."""
    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except KeyError as e:
            raise ValueError(f"{msg.metadata.message_type} message for method "
                             f"{context.run_config.get('method')!r}: {e.args[0]!r} is missing (a "
                             "record or config key the server should send, or a node-config "
                             "key the SuperNode should set)") from e
    return wrapped


@app.train()
@_naming_missing_keys
def train(msg: Message, context: Context) -> Message:
    client = client_for(context)
    key = _restored(client, msg)
    reply = inject(client.cfg, client.partition_id, msg, lambda: client.train(msg))
    client_state.save(client.cfg, context, key, client.partition_id, client.round_of(msg),
                      len(client_state.resumed_after_of(msg)))
    return reply


@app.evaluate()
@_naming_missing_keys
def evaluate(msg: Message, context: Context) -> Message:
    client = client_for(context)
    _restored(client, msg, evaluating=True)
    return client.evaluate(msg)


@app.query("whoami")
@_naming_missing_keys
def whoami(msg: Message, context: Context) -> Message:
    pid, num = (int(context.node_config[k]) for k in ("partition-id", "num-partitions"))
    if not 0 <= pid < num:  # no data to load: the server names the problem (before round 1)
        info = ConfigRecord({"partition-id": pid, "num-partitions": num})
        return Message(content=RecordDict({"info": info}), reply_to=msg)
    return client_for(context).whoami(msg)
