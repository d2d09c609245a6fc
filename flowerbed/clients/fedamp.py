"""FedAMP (Huang et al., AAAI 2021), client half: w_i = argmin F_i(w) + (λ/2α_k)·||w − u_i||².

The training message carries the client's cloud model u_i (``strategies/fedamp.py``) and
``proximal-mu`` = λ/α_k; the client takes ``local-epochs`` of SGD from u_i on its loss plus that
proximal term (FedProx's client, whose anchor and start are the received model) and uploads w_i.
It keeps nothing: the server holds w_i and sends it back in the evaluation message, which the
client scores on its local test split.

Starting from u_i, the proximal operator's centre, is our reading of the paper's argmin (it
does not say where the local solver starts; flgo's FedAMP starts there too). PFLlib starts from
the client's own previous w_i, and its proximal term has had no gradient since 2023 (it is
computed on ``.data``), so PFLlib's FedAMP trains as Local does.
"""

from __future__ import annotations

from flowerbed.clients.fedavg import FedProxClient


class FedAMPClient(FedProxClient):
    """FedProx's local update, with the server's u_i as anchor and μ = λ/α_k."""
