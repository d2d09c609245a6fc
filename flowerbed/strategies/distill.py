"""Server half shared by the distillation methods (FedCC, FedDF, FedMD, FedCT): no weights travel.

Each round the server broadcasts soft targets on the public set (a named ArrayRecord,
``soft_targets``, [|D_u|, C]; none in round 1), clients reply with their predictions on the
public set only (``predictions``, [|D_u|, width]) and the server combines them into the next
round's targets. Evaluation is the ensemble of the clients' models: clients return their
predictions on the test set (``test_predictions``), the server combines them the same way and
scores the argmax over the C classes. Subclasses set ``reply_width`` and :meth:`combine`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flowerbed.datasets.federated import public_indices, test_set
from flowerbed.datasets.loading import DataSet
from flowerbed.strategies.base import FlowerbedFedAvg, log, metric_record

SOFT_TARGETS = "soft_targets"
PREDICTIONS = "predictions"
TEST_PREDICTIONS = "test_predictions"
GLOBAL_ACC = "global-test-accuracy"  # a local model on the global test set (FedCC's Table II)
#: FedMD's class scores beyond this are refused: ten replies of 3e38 average to inf in float32
MAX_SCORE = 1e4


class DistillStrategy(FlowerbedFedAvg):
    reply_arrays = {PREDICTIONS: "predictions"}
    extra_outputs = 0        # FedCC's clients have one more output, "unknown"
    probabilities = True     # FedMD exchanges logits instead

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.n_public = len(public_indices(cfg))
        test = test_set(cfg)  # cached; known before round 0 so that a resumed run has it too
        self.num_classes, self._n_test = test.num_classes, len(test)
        self._ensemble: dict[int, tuple[float, float]] = {}

    # -------------------------------------------------------------- what the methods differ in
    def combine(self, preds: np.ndarray) -> np.ndarray:
        """[clients, N, width] -> [N, C] soft targets (FedDF: the mean of the probabilities)."""
        return preds.mean(0)

    def inspect(self, server_round: int, partitions: list[int], metrics: list) -> None:
        """Look at the valid replies' metrics (FedCC warns about degenerate clients)."""

    def ensemble_probs(self, preds: np.ndarray) -> np.ndarray:
        """[clients, N, width] -> [N, C] ensemble class scores for inference."""
        return self.combine(preds)

    # -------------------------------------------------------------- rounds
    def initial_arrays(self, model: torch.nn.Module | None) -> ArrayRecord:
        return ArrayRecord()  # no targets before the first round

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
                      ) -> RecordDict:
        content = RecordDict({self.configrecord_key: config})
        if len(arrays):
            content[SOFT_TARGETS] = arrays
        return content

    def check_arrays(self, content: RecordDict) -> str | None:
        extra = set(content.array_records) - {PREDICTIONS}
        if extra:
            return f"unexpected ArrayRecords {sorted(extra)}: only the predictions may be uploaded"
        if PREDICTIONS not in content.array_records:
            return f"missing ArrayRecord '{PREDICTIONS}'"
        return self._check_matrix(content[PREDICTIONS], self.n_public)

    def _check_matrix(self, rec: ArrayRecord, rows: int) -> str | None:
        if list(rec) != ["p"]:
            return f"expected one array 'p', got {sorted(rec)}"
        a = rec["p"].numpy()
        width = (self.num_classes or a.shape[-1] - self.extra_outputs) + self.extra_outputs
        if a.shape != (rows, width):
            return f"predictions have shape {a.shape}, expected {(rows, width)}"
        if not np.isfinite(a.astype(np.float32)).all():  # (float64 values can overflow it)
            return "predictions hold NaN or inf values, or values beyond float32's range"
        if self.probabilities and (a.min() < 0 or abs(a.sum(1) - 1).max() > 1e-3):
            return "predictions are not probability vectors (negative, or rows not summing to 1)"
        if not self.probabilities and abs(a).max() > MAX_SCORE:
            return f"class scores beyond ±{MAX_SCORE:g} (their mean could overflow float32)"
        return None

    def check_reply(self, reply: Message, is_train: bool) -> str | None:
        problem = super().check_reply(reply, is_train)
        if problem or is_train:
            return problem
        rec = reply.content.array_records.get(TEST_PREDICTIONS)  # the ensemble's input
        return (f"missing ArrayRecord '{TEST_PREDICTIONS}'" if rec is None
                else self._check_matrix(rec, self._n_test))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        preds = np.stack([r.content[PREDICTIONS]["p"].numpy().astype(np.float32) for r in valid])
        targets = self.combine(preds).astype(np.float32)
        client_metrics = [metric_record(r.content) for r in valid]
        self.inspect(server_round, self.round.ok, client_metrics)  # both in partition order
        metrics = self.train_metrics_aggr_fn([RecordDict({"m": m}) for m in client_metrics],
                                             self.weighted_by_key)
        self.round.train_metrics = dict(metrics)
        return ArrayRecord({SOFT_TARGETS: Array(targets)}), metrics

    # -------------------------------------------------------------- ensemble evaluation
    def clients_evaluate(self) -> bool:
        return True  # the ensemble is the clients' models

    def evaluates_locally(self) -> bool:
        return False  # every client's test-set predictions feed the ensemble

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        return RecordDict()  # no weights travel

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        """The clients' scores (their local test splits, weighted by size), the mean of their
        local models' accuracies on the global test set, and their test-set predictions for the
        ensemble (:meth:`evaluate_global`); a client that has not trained yet is left out."""
        valid, _ = self._check_and_log_replies(replies, is_train=False)
        untrained = [self.partition_of.get(r.metadata.src_node_id, -1) for r in valid
                     if not metric_record(r.content).get("trained", 1.0)]
        if untrained:
            log.info("round %d: partitions %s have not trained yet: their initial models are left "
                     "out of the ensemble and the clients' scores", server_round, untrained)
        valid = [r for r in valid if metric_record(r.content).get("trained", 1.0)]
        self._test_preds = [r.content[TEST_PREDICTIONS]["p"].numpy().astype(np.float32)
                            for r in valid]
        metrics = None
        replied = [metric_record(r.content) for r in valid]
        scored = [MetricRecord({k: v for k, v in m.items() if k not in ("trained", GLOBAL_ACC)})
                  for m in replied if m[self.weighted_by_key] > 0]  # no local test split: no scores
        if scored:
            metrics = self.evaluate_metrics_aggr_fn([RecordDict({"m": m}) for m in scored],
                                                    self.weighted_by_key)
        on_global = [float(m[GLOBAL_ACC]) for m in replied if GLOBAL_ACC in m]
        if on_global:  # every local model on the same test set (Table II): a plain mean over
            # the clients, with or without a local test split, not weighted by its size
            metrics = metrics if metrics is not None else MetricRecord()
            metrics[GLOBAL_ACC] = float(np.mean(on_global))
        self.round.eval_metrics = dict(metrics or {})
        return metrics

    def evaluate_global(self, server_round: int, arrays: ArrayRecord, train: DataSet,
                        test: DataSet, device: torch.device) -> tuple[float, float] | None:
        """Ensemble accuracy of this round's client predictions on the test set."""
        self.num_classes, self._n_test = test.num_classes, len(test)
        preds = getattr(self, "_test_preds", [])
        self._test_preds = []
        if server_round == 0 or not preds:
            return None
        probs = self.ensemble_probs(np.stack(preds))[:, : test.num_classes]
        y = test.y.numpy()
        p_true = probs[np.arange(len(y)), y] / np.maximum(probs.sum(1), 1e-12)
        loss = float(-np.log(np.maximum(p_true, 1e-12)).mean())
        return loss, float((probs.argmax(1) == y).mean())
