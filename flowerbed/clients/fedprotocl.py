"""FedProtoCL: PCL (Prototypical Contrastive Learning, Li et al., ICLR 2021) locally, FedAvg.

One of the FedX paper's bases. PCL is MoCo plus prototypes: from round
``protocl-warmup-rounds`` + 1 on (PCL warms up with InfoNCE alone for 10% of its epochs), at the
start of every local epoch the client embeds its own training data with the key encoder (eval
mode, no augmentation, L2-normalised projections), runs k-means once for each count in
``protocl-clusters``, and estimates each cluster's concentration as PCL's code does:

    φ_j = mean_{v in j} ‖v − c_j‖ / log(Z_j + 10)

(clusters of one sample take the largest φ; then clipped to the 10th–90th percentile and scaled so
that the mean φ is ``ssl-tau``). The loss is FedMoCo's symmetrised InfoNCE plus, for each view, the
mean over the clusterings of :func:`flowerbed.losses.proto_nce` with the sample's cluster as its
positive. The online network is FedAvg-aggregated; the key encoder and queue stay on the client
as FedMoCo's do, and the prototypes, rebuilt from the key encoder every epoch, never leave it
(FedX's setting: clients share no features).

Neither the FedX paper's text nor its code specifies its FedProtoCL; this is PCL federated by
FedAvg, as FedX's other bases are. Differences from PCL's code:

- the prototype term's softmax runs over every prototype once (the paper's equation); PCL's code
  takes one column per batch sample's own prototype (a prototype shared by m samples of the batch
  appears m times) plus r sampled from the others, which needs its 25k–100k ImageNet clusters;
- each cluster count is capped at n/10 (2 where n < 20): faiss, which PCL uses, only warns below 10
  points per centroid, but a client has tens to thousands of samples, not ImageNet's 1.28M;
- a cluster whose samples all coincide (zero spread, like PCL's one-sample clusters) takes the
  largest φ, and φ is floored at a tenth of its mean before the scaling: with tens of clusters the
  percentile clip does not stop one tight cluster's φ → 0 (logits of 1e5; with PCL's 25k+ it does);
- k-means is seeded Lloyd in torch, 5 restarts × 20 iterations (faiss's counts in PCL), keeping the
  lowest inertia, an emptied centroid moved to a random sample;
- τ is ``ssl-tau`` (0.1; PCL 0.2); the views and heads are FedMoCo's.
"""

from __future__ import annotations

import torch
from flwr.app import Message
from torch.nn import functional as F

from flowerbed.clients.fedmoco import MoCoClient
from flowerbed.losses import proto_nce
from flowerbed.models.ssl import SSLNet
from flowerbed.training import extract_features, generator_of

KMEANS_ITERS, KMEANS_RESTARTS = 20, 5  # PCL's faiss settings (niter, nredo)
MIN_POINTS = 10  # per centroid: a cluster count is capped at n / MIN_POINTS (faiss warns below it)
SPREAD_EPS = 1e-6  # a cluster's mean distance to its centroid at most this: no spread (unit vectors)
PHI_FLOOR = 0.1  # φ at least this fraction of its mean (before scaling to ssl-tau)


def kmeans(x: torch.Tensor, k: int, generator: torch.Generator, iters: int = KMEANS_ITERS,
           restarts: int = KMEANS_RESTARTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on the rows of ``x``: (centroids [k, d], each row's cluster [n]), the
    restart with the lowest inertia. Starts at k distinct random rows; a centroid left empty
    moves to a random row. scipy's ``kmeans2`` does one start, on the CPU only, and was about 30×
    slower here (6000 × 256, k = 100)."""
    n, sq = len(x), x.pow(2).sum(1)

    def nearest(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (x·c − ½‖c‖², centroid) for its nearest centroid: argmin ‖x − c‖² is
        argmax x·c − ½‖c‖² (one matmul; cdist was 5× slower)."""
        return (x @ c.T - 0.5 * c.pow(2).sum(1)).max(1)

    best: tuple[float, torch.Tensor, torch.Tensor] | None = None
    for _ in range(restarts):
        c = x[torch.randperm(n, generator=generator)[:k].to(x.device)].clone()
        for _ in range(iters):
            _, assign = nearest(c)
            counts = torch.bincount(assign, minlength=k)
            c = torch.zeros_like(c).index_add_(0, assign, x) / counts.clamp(min=1)[:, None].to(x.dtype)
            empty = (counts == 0).nonzero().flatten()
            if len(empty):
                c[empty] = x[torch.randint(n, (len(empty),), generator=generator).to(x.device)]
        score, assign = nearest(c)
        inertia = float((sq - 2 * score).sum())  # Σ ‖x − c_assign‖²
        if best is None or inertia < best[0]:
            best = (inertia, c, assign)
    assert best is not None
    return best[1], best[2]


def concentration(x: torch.Tensor, centroids: torch.Tensor, assign: torch.Tensor,
                  tau: float) -> torch.Tensor:
    """PCL's per-cluster temperature φ (its ``run_kmeans``): mean distance to the centroid over
    log(size + 10); size ≤ 1 takes the largest φ; clipped to the 10th–90th percentile; scaled to
    mean ``tau``. Beyond PCL (module docstring): a cluster of zero spread also takes the largest
    φ, and φ is at least a tenth of its mean before the scaling; all equal to ``tau`` when every
    distance is 0 (a collapsed encoder)."""
    k = len(centroids)
    counts = torch.bincount(assign, minlength=k).to(x.dtype)
    dist = (x - centroids[assign]).norm(dim=1)
    phi = torch.zeros(k, dtype=x.dtype, device=x.device).index_add_(0, assign, dist)
    phi = phi / counts.clamp(min=1) / torch.log(counts + 10)
    spread = (counts > 1) & (phi > SPREAD_EPS)
    phi = torch.where(spread, phi, phi[spread].max() if spread.any() else phi.new_tensor(0.0))
    phi = phi.clamp(torch.quantile(phi, 0.1), torch.quantile(phi, 0.9))
    if not phi.mean() > 0:
        return torch.full_like(phi, tau)
    phi = phi.clamp(min=PHI_FLOOR * phi.mean())
    return tau * phi / phi.mean()


class ProtoCLClient(MoCoClient):
    """FedMoCo's client with PCL's prototype terms (module docstring)."""

    def prepare(self, model: SSLNet, msg: Message) -> None:
        super().prepare(model, msg)
        self.rnd, self.epoch = self.round_of(msg), 0
        # per clustering: (normalised prototypes, φ, each training sample's cluster); none in warm-up
        self.protos: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def cluster_counts(self) -> list[int]:
        """``protocl-clusters``, each at most n/10 (but 2 where n < 20; n where n < 2), without repeats."""
        n = len(self.train_data)
        return sorted({min(k, max(2, n // MIN_POINTS), n) for k in self.cfg.protocl_ks()})

    def before_epoch(self, model: SSLNet) -> None:
        self.epoch += 1
        if self.rnd <= self.cfg.protocl_warmup_rounds:
            return
        self.target.eval()
        feats = extract_features(lambda xb: F.normalize(self.target(xb)[1], dim=1), self.train_data,
                                 self.device).to(self.device)
        self.target.train()
        self.protos = []
        for m, k in enumerate(self.cluster_counts()):
            gen = generator_of(self.cfg.seed, self.partition_id, self.rnd, self.epoch, m, 71)
            c, assign = kmeans(feats, k, gen)
            self.protos.append((F.normalize(c, dim=1), concentration(feats, c, assign, self.cfg.ssl_tau),
                                assign))

    def loss(self, model, v, x1, x2, xr):
        total = super().loss(model, v, x1, x2, xr)
        if not self.protos:
            return total
        idx = self.batch_idx.to(self.device)
        proto = sum(proto_nce(v[z], c, phi, assign[idx]) for c, phi, assign in self.protos
                    for z in ("z1", "z2"))
        return total + proto / len(self.protos)
