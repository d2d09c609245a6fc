"""Method name -> (strategy, client, model). The launcher and both apps use this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import Context
from torch import nn

from flowerbed.clients.apfl import APFLClient
from flowerbed.clients.atlas import ATLASClient
from flowerbed.clients.base import Client, make_model
from flowerbed.clients.ditto import DittoClient
from flowerbed.clients.fedade import FedADEClient
from flowerbed.clients.fedamp import FedAMPClient
from flowerbed.clients.fedavg import FedAvgClient, FedAvgFTClient, FedProxClient
from flowerbed.clients.fedbyol import BYOLClient
from flowerbed.clients.fedcc import FedCCClient
from flowerbed.clients.fedconcat import FedConcatClient
from flowerbed.clients.fedct import FedCTClient
from flowerbed.clients.feddf import FedDFClient
from flowerbed.clients.feddyn import FedDynClient
from flowerbed.clients.fedfed import FedFedClient
from flowerbed.clients.fedfew import FedFewClient
from flowerbed.clients.fedftg import FedFTGClient
from flowerbed.clients.fedlc import FedLCClient
from flowerbed.clients.fedmd import FedMDClient
from flowerbed.clients.fedmoco import MoCoClient
from flowerbed.clients.fednova import FedNovaClient
from flowerbed.clients.fedpoe import FedPOEClient
from flowerbed.clients.fedprotocl import ProtoCLClient
from flowerbed.clients.fedrep import FedRepClient
from flowerbed.clients.fedrs import FedRSClient
from flowerbed.clients.fedsam import FedSAMClient
from flowerbed.clients.fedsimclr import SimCLRClient, make_ssl_model
from flowerbed.clients.fedsoft import FedSoftClient
from flowerbed.clients.fedu import FedUClient
from flowerbed.clients.fedvls import FedVLSClient
from flowerbed.clients.fedx import fedx_client
from flowerbed.clients.fedxds import FedXDSClient
from flowerbed.clients.ifca import IFCAClient
from flowerbed.clients.local import LocalClient
from flowerbed.clients.moon_unsup import MoonUnsupClient
from flowerbed.clients.scaffold import ScaffoldClient
from flowerbed.config import Config
from flowerbed.datasets.loading import DataSet
from flowerbed.strategies.apfl import APFLStrategy
from flowerbed.strategies.atlas import ATLASStrategy
from flowerbed.strategies.base import FlowerbedFedAvg
from flowerbed.strategies.cfl import CFLStrategy
from flowerbed.strategies.ditto import DittoStrategy
from flowerbed.strategies.fedade import FedADEStrategy
from flowerbed.strategies.fedamp import FedAMPStrategy
from flowerbed.strategies.fedavg import FedAvgFTStrategy, FedAvgStrategy, FedProxStrategy
from flowerbed.strategies.fedcc import FedCCStrategy
from flowerbed.strategies.fedconcat import FedConcatStrategy
from flowerbed.strategies.fedct import FedCTStrategy
from flowerbed.strategies.feddf import FedDFStrategy
from flowerbed.strategies.feddyn import FedDynStrategy
from flowerbed.strategies.fedfed import FedFedStrategy
from flowerbed.strategies.fedfew import FedFewStrategy
from flowerbed.strategies.fedftg import FedFTGStrategy
from flowerbed.strategies.fedmd import FedMDStrategy
from flowerbed.strategies.fedmgda import FedMGDAStrategy
from flowerbed.strategies.fedmr import FedMRStrategy
from flowerbed.strategies.fednova import FedNovaStrategy
from flowerbed.strategies.fedpoe import FedPOEStrategy
from flowerbed.strategies.fedrep import FedRepStrategy
from flowerbed.strategies.fedsoft import FedSoftStrategy
from flowerbed.strategies.fedx import fedx_strategy
from flowerbed.strategies.fedxds import FedXDSStrategy
from flowerbed.strategies.ifca import IFCAStrategy
from flowerbed.strategies.local import LocalStrategy
from flowerbed.strategies.scaffold import ScaffoldStrategy
from flowerbed.strategies.ssl import SSLStrategy


def no_server_model(cfg: Config, data: DataSet) -> None:
    """Distillation methods hold no global model on the server (only soft targets)."""
    return None


@dataclass(frozen=True)
class Method:
    name: str
    strategy: Callable[[Config], FlowerbedFedAvg]
    client: Callable[[Config, Context], Client]
    model: Callable[[Config, DataSet], nn.Module | None]
    summary: str


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("fedavg", FedAvgStrategy, FedAvgClient, make_model, "FedAvg (McMahan et al., 2017)"),
        Method("fedprox", FedProxStrategy, FedProxClient, make_model, "FedProx (Li et al., 2020)"),
        Method("scaffold", ScaffoldStrategy, ScaffoldClient, make_model,
               "SCAFFOLD (Karimireddy et al., 2020), option II control variates"),
        Method("fednova", FedNovaStrategy, FedNovaClient, make_model,
               "FedNova (Wang et al., 2020): updates normalised by each client's local steps"),
        Method("feddyn", FedDynStrategy, FedDynClient, make_model,
               "FedDyn (Acar et al., 2021): dynamic regularisation, a linear term kept per client"),
        Method("fedmgda", FedMGDAStrategy, FedAvgClient, make_model,
               "FedMGDA+ (Hu et al., 2022): FedAvg's clients, a min-norm common descent direction"),
        Method("fedlc", FedAvgStrategy, FedLCClient, make_model,
               "FedLC (Zhang et al., 2022): FedAvg, local logits calibrated by the client's label counts"),
        Method("fedrs", FedAvgStrategy, FedRSClient, make_model,
               "FedRS (Li & Zhan, 2021): FedAvg, restricted softmax (absent classes' logits scaled)"),
        Method("fedsam", FedAvgStrategy, FedSAMClient, make_model,
               "FedSAM (Qu et al., 2022): FedAvg, sharpness-aware minimisation as the local step"),
        Method("fedvls", FedAvgStrategy, FedVLSClient, make_model,
               "FedVLS (Guo et al., 2024): FedAvg, vacant-class distillation + logit suppression"),
        Method("fedmr", FedMRStrategy, FedAvgClient, make_model,
               "FedMR (Hu et al., 2024): a pool of local models, recombined layer-wise every round"),
        Method("fedconcat", FedConcatStrategy, FedConcatClient, make_model,
               "FedConcat (Diao et al., 2024): cluster models by label mix, a classifier on their encoders"),
        Method("fedftg", FedFTGStrategy, FedFTGClient, make_model,
               "FedFTG (Zhang et al., 2022): FedAvg, the global model fine-tuned by data-free distillation"),
        Method("fedsimclr", SSLStrategy, SimCLRClient, make_ssl_model,
               "FedSimCLR: SimCLR (NT-Xent) locally, FedAvg; linear probe"),
        Method("fedbyol", SSLStrategy, BYOLClient, make_ssl_model,
               "FedBYOL: BYOL locally (EMA target kept on the client), FedAvg; linear probe"),
        Method("fedmoco", SSLStrategy, MoCoClient, make_ssl_model,
               "FedMoCo: MoCo v2 locally (key encoder and queue kept on the client), FedAvg; linear probe"),
        Method("fedprotocl", SSLStrategy, ProtoCLClient, make_ssl_model,
               "FedProtoCL: PCL (Li et al., 2021) locally, MoCo + k-means prototypes of the client's data"),
        Method("moon-unsup", SSLStrategy, MoonUnsupClient, make_ssl_model,
               "MOON-unsup: FedSimCLR + MOON's model-contrastive term (global +, previous local -)"),
        Method("fedu", SSLStrategy, FedUClient, make_ssl_model,
               "FedU (Zhuang et al., 2021): FedBYOL + divergence-aware predictor update"),
        Method("fedx", fedx_strategy, fedx_client, make_ssl_model,
               "FedX (Han et al., 2022) on the base chosen by fedx-base; linear probe"),
        Method("fedcc", FedCCStrategy, FedCCClient, no_server_model,
               "FedCC (Ye et al.): unknown class + calibrated pseudo-labels; ensemble inference"),
        Method("feddf", FedDFStrategy, FedDFClient, no_server_model,
               "FedDF-style: averaged soft targets on the public set + distillation"),
        Method("fedmd", FedMDStrategy, FedMDClient, no_server_model,
               "FedMD (Li & Wang, 2019): consensus class scores, digest + revisit"),
        Method("fedct", FedCTStrategy, FedCTClient, no_server_model,
               "FedCT (Abourayya et al., 2025): hard labels on the public set, majority-vote pseudo-labels"),
        Method("fedfew", FedFewStrategy, FedFewClient, make_model,
               "FedFew (Guo et al., 2026): K server models, smooth Tchebycheff weights"),
        Method("ifca", IFCAStrategy, IFCAClient, make_model,
               "IFCA (Ghosh et al., 2020): K cluster models, hard assignment"),
        Method("cfl", CFLStrategy, FedAvgClient, make_model,
               "CFL (Sattler et al., 2021): one cluster, split by the updates' cosine similarity"),
        Method("fedsoft", FedSoftStrategy, FedSoftClient, make_model,
               "FedSoft (Ruan & Joe-Wong, 2022): S cluster centres, soft assignment, local models"),
        Method("fedrep", FedRepStrategy, FedRepClient, make_model,
               "FedRep (Collins et al., 2021): shared body, personal head"),
        Method("ditto", DittoStrategy, DittoClient, make_model,
               "Ditto (Li et al., 2021): FedAvg + a personal model pulled towards it"),
        Method("apfl", APFLStrategy, APFLClient, make_model,
               "APFL (Deng et al., 2020): FedAvg + a personal model, served mixed with it by a learnt alpha"),
        Method("fedamp", FedAMPStrategy, FedAMPClient, make_model,
               "FedAMP (Huang et al., 2021): per-client cloud models by attentive message passing"),
        Method("local", LocalStrategy, LocalClient, make_model, "Local-only training"),
        Method("fedavg-ft", FedAvgFTStrategy, FedAvgFTClient, make_model,
               "FedAvg, evaluated after local fine-tuning"),
        Method("fedxds", FedXDSStrategy, FedXDSClient, make_model,
               "FedXDS (Hoefler et al., 2025): attribution-masked, noised data sharing"),
        Method("fedfed", FedFedStrategy, FedFedClient, make_model,
               "FedFed (Yang et al., 2023): a federated VAE's x - VAE(x) shared, clipped and noised"),
        Method("fedade", FedADEStrategy, FedADEClient, make_model,
               "Fed-ADE (Park et al., 2026): shift-adaptive learning rates on unlabelled streams"),
        Method("fedpoe", FedPOEStrategy, FedPOEClient, make_model,
               "Fed-POE (Ghari & Shen, 2024) on Fed-ADE's streams: local + federated model, Hedge"),
        Method("atlas", ATLASStrategy, ATLASClient, make_model,
               "ATLAS (Bai et al., 2022) on Fed-ADE's streams: local OGD at a pool of step sizes, Hedge"),
    )
}
