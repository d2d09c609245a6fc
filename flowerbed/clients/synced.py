"""Client half of state kept in step with the server's (``strategies/synced.py``): a client
files its new state as pending with its reply, and adopts it in its next training round only if
the server says it took that reply; otherwise it keeps the state it had."""

from __future__ import annotations

import logging

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from flowerbed.clients.base import Client
from flowerbed.strategies.synced import ACCEPTED

log = logging.getLogger("flowerbed")


def pending_key(state_key: str) -> str:
    """Where a client keeps the state it sent with its last reply until the server took it."""
    return f"{state_key}-pending"


class SyncedStateClient(Client):
    keeps_state = True
    state_key = ""  # the ArrayRecord in context.state that holds the adopted state
    state_name = "state"  # what one of its tensors is called in an error
    #: the ConfigRecord naming the pending state's round (default ``<state_key>-pending-round``)
    pending_round_key = ""

    @property
    def pending_key(self) -> str:
        return pending_key(self.state_key)

    def _round_key(self) -> str:
        return self.pending_round_key or f"{self.pending_key}-round"

    def held_state(self) -> ArrayRecord | None:
        return self.context.state.array_records.get(self.state_key)

    def state_tensor(self, record: ArrayRecord | None, name: str, like: torch.Tensor) -> torch.Tensor:
        """``record[name]`` as a tensor beside ``like`` (its parameter), zeros where absent."""
        if record is not None and name in record:
            v = torch.as_tensor(record[name].numpy(), device=like.device)
            if v.shape != like.shape:  # a (1,) would broadcast into every gradient element
                raise ValueError(f"{self.state_name} '{name}' has shape {tuple(v.shape)}, the "
                                 f"parameter {tuple(like.shape)}")
            return v
        return torch.zeros_like(like)

    def file_pending(self, record: ArrayRecord, msg: Message) -> None:
        self.context.state[self.pending_key] = record
        self.context.state[self._round_key()] = ConfigRecord({"round": self.round_of(msg)})

    def adopt_pending(self, msg: Message) -> None:
        """The state ← the last reply's pending state if the server took that reply, else kept."""
        state, pending, round_key = self.context.state, self.pending_key, self._round_key()
        if pending not in state.array_records:
            accepted = msg.content.config_records.get(ACCEPTED, ConfigRecord())
            if self.state_key not in state.array_records and str(self.partition_id) in accepted:
                # the server's aggregate (SCAFFOLD's c, FedDyn's h) holds this partition's earlier
                # contributions, and this client restarts from zero: they will count twice
                log.warning("partition %d: the server took this partition's %s in round %s, but "
                            "this client holds none (its state was lost, or another node served the "
                            "partition): it starts from zero, and the server's aggregate keeps the "
                            "earlier contribution as well", self.partition_id, self.state_name,
                            accepted[str(self.partition_id)])
            return
        if round_key not in state.config_records:
            log.warning("%s: pending state without its round; dropped, the state stays", self.state_key)
            del state[pending]
            return
        pending_round = state.config_records[round_key]["round"]
        accepted = msg.content.config_records.get(ACCEPTED, ConfigRecord())
        if accepted.get(str(self.partition_id)) == pending_round:
            state[self.state_key] = state.array_records[pending]
        else:
            log.info("%s: the server did not take round %d's reply; its state stays",
                     self.state_key, pending_round)
        del state[pending]
        del state[round_key]
