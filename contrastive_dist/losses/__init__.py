"""Contrastive losses that follow the gradient contract: local rows against gathered columns."""

from contrastive_dist.losses._negatives import SharedNegatives
from contrastive_dist.losses.infonce import DistributedInfoNCE, info_nce
from contrastive_dist.losses.ntxent import NTXentLoss, nt_xent
from contrastive_dist.losses.siglip import SigLIPLoss, siglip
from contrastive_dist.losses.supcon import SupConLoss, supcon

__all__ = [
    "DistributedInfoNCE",
    "NTXentLoss",
    "SharedNegatives",
    "SigLIPLoss",
    "SupConLoss",
    "info_nce",
    "nt_xent",
    "siglip",
    "supcon",
]
