"""CFL, clustered federated learning (Sattler et al., IEEE TNNLS 2021), server half.

One of the FedFew paper's discussed baselines. All clients start in one cluster; each cluster
has its own model, which its members train with FedAvg's client and which becomes the
sample-weighted mean of their uploads. After aggregation a cluster whose training has stalled
while its members still pull apart is split in two:

    ||Σ_i p_i Δθ_i|| < ε1   and   max_i ||Δθ_i|| > ε2   and   ≥ 3 members   and   round > warm-up,

Δθ_i = θ_i − θ_c the members' updates (parameters), p_i their sample shares
(``cfl-eps1``, ``cfl-eps2``, ``cfl-warmup``; the official code's 0.4, 1.6 and 20). The split
is complete-linkage agglomerative clustering of the updates' cosine similarities into two
groups (scipy's, as the official code's scikit-learn call), and each half becomes the weighted
mean of its own members' uploads. Clusters are split at most once a round, and the official
code's means are unweighted (its clients hold equal shares). A client is trained and scored on
its cluster's model (personalised accuracy on its local test split); a partition not seen yet
starts in cluster 0. A cluster splits only in a round where every client it holds replied (the
official code trains every client every round and never moves one afterwards: a member left out
of a split would stay on a half's model for good). Per round ``cfl-clusters`` counts the clusters and
``cluster-<c>-mean-norm`` / ``-max-norm`` give each trained cluster's two norms (the scale for
ε1 and ε2, which depend on the model, the learning rate and the local epochs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from flowerbed.strategies.base import cast_like, metric_record, update_gram, with_record
from flowerbed.strategies.personal import PersonalStrategy

log = logging.getLogger("flowerbed")


def bipartition(gram: np.ndarray) -> np.ndarray:
    """Two groups (labels 0/1) of the updates whose Gram matrix is ``gram``: complete linkage on
    the cosine distance 1 − cos (two groups always, as scikit-learn's AgglomerativeClustering
    gives the official code; scipy's fcluster can return one group where distances tie); the
    first update's group is 0."""
    from scipy.cluster.hierarchy import cut_tree, linkage  # here: every ClientApp imports this module
    from scipy.spatial.distance import squareform

    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    cos = gram / np.maximum(np.outer(norms, norms), np.finfo(float).tiny)
    dist = np.clip(1.0 - cos, 0.0, 2.0)
    np.fill_diagonal(dist, 0.0)
    tree = linkage(squareform(dist, checks=False), method="complete")
    labels = cut_tree(tree, n_clusters=2).ravel()  # two groups even where distances tie
    return (labels != labels[0]).astype(int)


class CFLStrategy(PersonalStrategy):
    checkpoint_attrs = ("cluster_of", "cluster_models")
    server_model = False  # one model per cluster

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.cluster_of: dict[str, int] = {}  # partition id (str) -> its cluster
        self.cluster_models: dict[str, ArrayRecord] = {}  # cluster (str) -> its model

    def check_setup(self, num_partitions: int) -> None:
        if self.cfg.fraction_train < 1:
            log.warning("CFL splits a cluster only in a round in which every client it holds "
                        "replied; with fraction-train=%g most rounds sample only some of them, so "
                        "clusters rarely split (the official code trains every client every round)",
                        self.cfg.fraction_train)

    def content_for(self, node: int, content: RecordDict) -> RecordDict:
        cluster = self.cluster_of.get(str(self.partition_of.get(node)), 0)
        model = self.cluster_models.get(str(cluster))  # none before round 1: the initial model
        return content if model is None else with_record(content, self.arrayrecord_key, model)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        if (taken := self.valid_mean(replies)) is None:
            return None, None
        valid, mean, params = taken
        members: dict[int, list[tuple[int, Message]]] = {}
        for pid, r in zip(self.round.ok, valid, strict=True):  # both in partition order
            if str(pid) not in self.cluster_of and len(self.cluster_models) > 1:
                log.info("round %d: partition %d trains for the first time after the clusters split: "
                         "it joins cluster 0 (CFL places a client by its updates within a cluster only)",
                         server_round, pid)
            members.setdefault(self.cluster_of.get(str(pid), 0), []).append((pid, r))
        extra: dict[str, float] = {}
        for c, group in sorted(members.items()):
            sent = self.cluster_models.get(str(c), self._reference)
            gram = update_gram(sent, [r.content["arrays"] for _, r in group], params)
            n = self.sample_counts(r for _, r in group)
            p = n / n.sum()
            mean_norm = float(np.sqrt(max(p @ gram @ p, 0.0)))
            max_norm = float(np.sqrt(max(np.diag(gram).max(), 0.0)))
            extra.update({f"cluster-{c}-mean-norm": mean_norm, f"cluster-{c}-max-norm": max_norm})
            halves, ids = [group], [c]
            known = {int(q) for q, k in self.cluster_of.items() if k == c}
            due = (server_round > self.cfg.cfl_warmup and mean_norm < self.cfg.cfl_eps1
                   and max_norm > self.cfg.cfl_eps2 and len(group) >= 3)
            if due and (missing := sorted(known - {q for q, _ in group})):
                log.info("round %d: cluster %d meets the split criteria (mean update norm %.3g < %g, "
                         "max %.3g > %g) but its partitions %s did not reply this round: not split "
                         "(a cluster splits only in a round all its members reply)", server_round, c,
                         mean_norm, self.cfg.cfl_eps1, max_norm, self.cfg.cfl_eps2, missing)
            elif due:
                labels = bipartition(gram)
                ids.append(max([*map(int, self.cluster_models), *self.cluster_of.values(), c]) + 1)
                halves = [[g for g, lab in zip(group, labels, strict=True) if lab == side]
                          for side in (0, 1)]
                log.info("round %d: cluster %d split (mean update norm %.3g < %g, max %.3g > %g): "
                         "partitions %s stay, %s form cluster %d", server_round, c, mean_norm,
                         self.cfg.cfl_eps1, max_norm, self.cfg.cfl_eps2, [q for q, _ in halves[0]],
                         [q for q, _ in halves[1]], ids[1])
            for cluster, half in zip(ids, halves, strict=True):
                for pid, _ in half:
                    self.cluster_of[str(pid)] = cluster
                self.cluster_models[str(cluster)] = cast_like(aggregate_arrayrecords(
                    [RecordDict({"arrays": r.content["arrays"], "m": metric_record(r.content)})
                     for _, r in half], self.weighted_by_key), self._reference)
        extra["cfl-clusters"] = len(self.cluster_models)
        return cast_like(ArrayRecord(mean), self._reference), self.client_metrics(valid, extra)
