"""Client half of state kept in step with the server's (``strategies/synced.py``): a client
files its new state as pending with its reply, and adopts it in its next training round only if
the server says it took that reply; otherwise it keeps the state it had."""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord, ConfigRecord, Message

from flowerbed.clients.base import Client
from flowerbed.strategies.synced import ACCEPTED

log = logging.getLogger("flowerbed")


class SyncedStateClient(Client):
    keeps_state = True
    state_key = ""  # the ArrayRecord in context.state that holds the adopted state

    def held_state(self) -> ArrayRecord | None:
        return self.context.state.array_records.get(self.state_key)

    def file_pending(self, record: ArrayRecord, msg: Message) -> None:
        self.context.state[f"{self.state_key}-pending"] = record
        self.context.state[f"{self.state_key}-pending-round"] = ConfigRecord({"round": self.round_of(msg)})

    def adopt_pending(self, msg: Message) -> None:
        """The state ← the last reply's pending state if the server took that reply, else kept."""
        state, pending = self.context.state, f"{self.state_key}-pending"
        if pending not in state.array_records:
            return
        pending_round = state.config_records[f"{pending}-round"]["round"]
        accepted = msg.content.config_records.get(ACCEPTED, ConfigRecord())
        if accepted.get(str(self.partition_id)) == pending_round:
            state[self.state_key] = state.array_records[pending]
        else:
            log.info("%s: the server did not take round %d's reply; its state stays",
                     self.state_key, pending_round)
        del state[pending]
        del state[f"{pending}-round"]
