"""FedConcat (Diao, Li & He, AAAI 2024), server half: K cluster models by label distribution, then one
classifier over their concatenated encoders.

One of the FedCC paper's parameter-based baselines. As the official code (sjtudyq/FedConcat):

1. the clients are clustered into K = ``fedconcat-clusters`` groups by k-means on their label
   distributions (class shares, from the label counts each reports in its whoami reply, before
   round 1: :mod:`flowerbed.clients.fedconcat`);
2. encoder stage, rounds 1 … E = ``fedconcat-encoder-rounds``: each cluster trains its own model
   (all K from the same initial model) by FedAvg among its members;
3. classifier stage, the rounds after: the K models' encoders (their penultimate layers),
   concatenated and frozen, feed one new linear classifier, which every client trains for a few
   mini-batches a round and the server averages without weights (the clients take equal steps);
4. the global model is the K encoders and that classifier, scored on the test set from the first
   classifier round (the encoder stage has no global model: its rounds report no accuracy).

Where we depart: k-means is scipy's (``kmeans2``, k-means++ seeding, the best of 10 seeded starts;
the code: scikit-learn's), K capped at the number of distinct label distributions, and a cluster
k-means leaves empty is dropped (it would concatenate an untrained encoder); a client first seen
after round 1 joins the cluster of the nearest centroid. The code's Laplace noise on the
distributions (its ``eps``, 0 by default) and its constrained k-means for CIFAR-100 are not
implemented. The classifier stage sends all K models with every message (no client keeps them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerbed.clients.fedconcat import CLASSIFIER, ConcatModel, classifier_for
from flowerbed.clients.fedftg import COUNTS
from flowerbed.datasets.loading import NUM_CLASSES, DataSet
from flowerbed.strategies.base import FlowerbedFedAvg, cast_like, with_record
from flowerbed.strategies.fedftg import counts_problem
from flowerbed.training import cpu_seeded, evaluate, load_record, to_record

log = logging.getLogger("flowerbed")


def kmeans(points: np.ndarray, k: int, seed: int, starts: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(centroids [k', d], labels [n]): the lowest-inertia of ``starts`` seeded k-means++ runs,
    k capped at the number of distinct points and the clusters left empty dropped (k' <= k;
    labels renumbered 0 … k'−1)."""
    from scipy.cluster.vq import kmeans2  # here: every ClientApp imports this module

    k = min(k, len(np.unique(points, axis=0)))
    best = None
    for s in range(starts):
        cent, lab = kmeans2(points, k, minit="++", seed=np.random.default_rng([seed, s]))
        inertia = float(((points - cent[lab]) ** 2).sum())
        if best is None or inertia < best[0]:
            best = (inertia, cent, lab)
    _, cent, lab = best
    used = np.unique(lab)
    return cent[used], np.searchsorted(used, lab)


class FedConcatStrategy(FlowerbedFedAvg):
    checkpoint_attrs = ("cluster_of", "centroids", "cluster_models", "classifier")  # (shares: whoami)
    server_model = False  # K models and a classifier (model.pt would hold none of them whole)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.cluster_of: dict[str, int] = {}  # partition id (str) -> its cluster
        self.centroids: np.ndarray | None = None  # [K, C] label distributions
        self.cluster_models: dict[str, ArrayRecord] = {}  # cluster (str) -> its model
        self.classifier: ArrayRecord | None = None  # from the first classifier round
        self.shares: dict[int, np.ndarray] = {}  # partition -> its label distribution (whoami)
        self._stage2 = False  # this round is a classifier round

    def classifier_stage(self, server_round: int) -> bool:
        """After the encoder rounds (and once there are cluster models to concatenate)."""
        return server_round > self.cfg.fedconcat_encoder_rounds and bool(self.cluster_models)

    def check_setup(self, num_partitions: int) -> None:
        if self.cfg.fedconcat_clusters > num_partitions:
            log.warning("fedconcat-clusters=%d is more than the %d clients: k-means gets at most one "
                        "cluster per distinct label distribution", self.cfg.fedconcat_clusters,
                        num_partitions)

    def on_whoami(self, pid: int, info: ConfigRecord) -> None:
        """Keep the partition's label distribution; a partition first seen after the clustering
        joins the cluster of the nearest centroid."""
        counts = info.get(COUNTS)
        if problem := counts_problem(counts, NUM_CLASSES[self.cfg.dataset]):
            log.warning("partition %d: its whoami reply's %s: it is put in cluster 0", pid, problem)
            return
        self.shares[pid] = np.asarray(counts, np.float64) / sum(counts)
        self.join(pid)

    def join(self, pid: int) -> None:
        """Put a partition with label shares and no cluster yet in the nearest centroid's, once
        there are centroids."""
        if self.centroids is not None and pid in self.shares and str(pid) not in self.cluster_of:
            cluster = int(((self.centroids - self.shares[pid]) ** 2).sum(1).argmin())
            self.cluster_of[str(pid)] = cluster
            log.info("partition %d joins cluster %d (the nearest label distribution)", pid, cluster)

    def restore_state(self, state: dict) -> None:
        """The checkpoint's clusters; a partition whose whoami came before them (a resumed run
        asks every node first) and that the run had not seen joins the nearest one."""
        super().restore_state(state)
        for pid in sorted(self.shares):
            self.join(pid)

    def cluster(self, initial: ArrayRecord) -> None:
        """k-means on the label distributions of every partition known so far; each cluster's
        model starts as the initial model."""
        pids = sorted(self.shares)
        if not pids:
            raise RuntimeError("no client reported its label counts (whoami): FedConcat cannot cluster")
        self.centroids, labels = kmeans(np.stack([self.shares[p] for p in pids]),
                                        self.cfg.fedconcat_clusters, self.cfg.seed)
        self.cluster_of = {str(p): int(c) for p, c in zip(pids, labels, strict=True)}
        self.cluster_models = {str(c): initial for c in range(len(self.centroids))}
        log.info("%d clusters by label distribution: %s", len(self.centroids),
                 {c: [p for p in pids if self.cluster_of[str(p)] == c] for c in range(len(self.centroids))})

    # -------------------------------------------------------------- messages
    def stage_content(self) -> RecordDict:
        """The classifier stage's records: the K models and the classifier."""
        models = {f"model.{k}": self.cluster_models[str(k)] for k in range(len(self.cluster_models))}
        return RecordDict({**models, CLASSIFIER: self.classifier})

    def train_content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        if not self.classifier_stage(server_round):
            return super().train_content(server_round, arrays, config)
        if self.classifier is None:
            self.classifier = self._new_classifier()
        content = self.stage_content()
        content[self.configrecord_key] = config
        return content

    def eval_content(self, arrays: ArrayRecord) -> RecordDict:
        return self.stage_content() if self.classifier is not None else super().eval_content(arrays)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        if CLASSIFIER in content.array_records or self.arrayrecord_key not in content.array_records:
            return content  # the classifier stage
        cluster = self.cluster_of.get(str(self.partition_of.get(node)), 0)
        return with_record(content, self.arrayrecord_key, self.cluster_models[str(cluster)])

    def configure_train(self, server_round, arrays, config, grid):
        if self.centroids is None and not self.classifier_stage(server_round):
            self.cluster(arrays)  # before the first round: every node has answered whoami
        msgs = super().configure_train(server_round, arrays, config, grid)
        self._stage2 = self.classifier_stage(server_round)
        return msgs

    def check_arrays(self, content: RecordDict) -> str | None:
        if self._stage2:
            if set(content.array_records) != {CLASSIFIER}:
                return (f"expected the ArrayRecord '{CLASSIFIER}' alone in the classifier stage, "
                        f"got {sorted(content.array_records)}")
            return self.check_record(CLASSIFIER, content[CLASSIFIER], self.classifier)
        return super().check_arrays(content)

    # -------------------------------------------------------------- aggregation
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True)
        if not valid:
            return None, None
        if self._stage2:
            equal = MetricRecord({"w": 1})  # unweighted: the clients take equal steps (the code)
            mean = aggregate_arrayrecords([RecordDict({"a": r.content[CLASSIFIER], "m": equal})
                                           for r in valid], "w")
            self.classifier = cast_like(mean, self.classifier)
            return self.classifier, self.client_metrics(valid)
        pids = list(self.round.ok)  # partition order, as the valid replies
        extra = {}
        for c in range(len(self.cluster_models)):
            members = [r for p, r in zip(pids, valid, strict=True) if self.cluster_of.get(str(p), 0) == c]
            extra[f"cluster-{c}-clients"] = len(members)
            if members:
                self.cluster_models[str(c)] = cast_like(aggregate_arrayrecords(
                    [r.content for r in members], self.weighted_by_key), self._reference)
        mean = aggregate_arrayrecords([r.content for r in valid], self.weighted_by_key)
        return cast_like(mean, self._reference), self.client_metrics(valid, extra)

    # -------------------------------------------------------------- the global model
    def concat_model(self) -> ConcatModel:
        encoders = [self.network_with(self.cluster_models[str(k)]) for k in range(len(self.cluster_models))]
        clf = classifier_for(encoders, NUM_CLASSES[self.cfg.dataset])
        load_record(clf, self.classifier)
        return ConcatModel(encoders, clf)

    def evaluate_global(self, server_round: int, arrays: ArrayRecord, train: DataSet,
                        test: DataSet, device: torch.device) -> tuple[float, float] | None:
        if server_round == 0:
            return super().evaluate_global(server_round, arrays, train, test, device)
        if self.classifier is None or not self.classifier_stage(server_round):
            return None  # the encoder stage: K cluster models, no global model yet
        return evaluate(self.concat_model(), test, device)

    def _new_classifier(self) -> ArrayRecord:
        with cpu_seeded(self.cfg.seed * 100 + 91):
            encoders = [self.model] * len(self.cluster_models)
            return to_record(classifier_for(encoders, NUM_CLASSES[self.cfg.dataset]))
