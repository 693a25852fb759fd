"""contrastive_dist: exact contrastive losses under data parallelism, on a differentiable variable-size all-gather."""

from contrastive_dist.collate import EmptySafeCollate
from contrastive_dist.collectives import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from contrastive_dist.gather import Gathered, GatheredMany, all_gather, all_gather_many
from contrastive_dist.losses import (
    DistributedInfoNCE,
    NTXentLoss,
    SharedNegatives,
    SigLIPLoss,
    SupConLoss,
    info_nce,
    nt_xent,
    siglip,
    supcon,
)
from contrastive_dist.metrics import retrieval_accuracy
from contrastive_dist.norm import SyncBatchNorm, convert_sync_batchnorm
from contrastive_dist.queue import DistributedMemoryQueue
from contrastive_dist.sampler import DistributedBatchSampler
from contrastive_dist.shards import DistributedShardList
from contrastive_dist.streaming import DistributedStreamingBatches

__all__ = [
    "DistributedInfoNCE",
    "NTXentLoss",
    "SigLIPLoss",
    "SupConLoss",
    "info_nce",
    "nt_xent",
    "siglip",
    "supcon",
    "SharedNegatives",
    "DistributedMemoryQueue",
    "retrieval_accuracy",
    "Gathered",
    "GatheredMany",
    "all_gather",
    "all_gather_many",
    "copy_to_group",
    "gather_from_group",
    "reduce_from_group",
    "scatter_to_group",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "DistributedBatchSampler",
    "DistributedShardList",
    "DistributedStreamingBatches",
    "EmptySafeCollate",
]

__version__ = "0.1.0"
