"""Server half of client state that must stay in step with the server's (SCAFFOLD's control
variate c_i with the server's c, FedDyn's ∇L_i with the server's h).

The server's state is a sum over the replies it took. A reply it refuses (a timeout, a failed
check, a skipped round) would leave a client's new state out of that sum, so every training
message names, per partition, the last round whose reply the server took (``ACCEPTED``), and a
client adopts its new state only then (``clients/synced.py``).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from flowerbed.strategies.base import FlowerbedFedAvg

ACCEPTED = "accepted-rounds"  # ConfigRecord: partition id (str) -> last round whose reply was taken


class SyncedStateStrategy(FlowerbedFedAvg):
    checkpoint_attrs: tuple[str, ...] = ("accepted",)  # a subclass adds its own state

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.accepted: dict[str, int] = {}

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        content = super().train_content(server_round, arrays, config)
        content[ACCEPTED] = ConfigRecord(dict(self.accepted))
        return content

    def all_clients(self, taken: int) -> int:
        """m, every client of the federation (at least the ``taken`` replies): the server's
        state is a mean over all of them, not over this round's participants."""
        return max(self.num_partitions or taken, taken)

    def took(self, server_round: int, partitions: list[int]) -> None:
        """The server's state now holds these partitions' replies of ``server_round``."""
        for pid in partitions:
            self.accepted[str(pid)] = server_round
