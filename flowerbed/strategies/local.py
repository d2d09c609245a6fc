"""Local-only training, server half: nothing is aggregated; the server only schedules rounds."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from flowerbed.strategies.personal import PersonalStrategy


class LocalStrategy(PersonalStrategy):
    reply_arrays: dict[str, str] = {}  # clients upload metrics only
    server_model = False  # its arrays stay the initial model: no model.pt

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        return RecordDict({self.configrecord_key: config})

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        return RecordDict()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        return None, self.client_metrics(valid)
