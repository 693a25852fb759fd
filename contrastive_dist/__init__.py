"""contrastive_dist: exact contrastive losses under data parallelism, on a differentiable variable-size all-gather.

The package is layered, bottom to top (each layer imports only the ones below it):

* :mod:`contrastive_dist.engine`: raw transports (collectives, ring hops), the agreement every rank
  reaches before data moves, and the differentiable gather built on them;
* :mod:`contrastive_dist.losses`: each loss defined once, over either transport;
* :mod:`contrastive_dist.nn`: synchronized BatchNorm, the gradient cache;
* :mod:`contrastive_dist.data`: drop-last-free sampling and streaming;
* :mod:`contrastive_dist.queue`, :mod:`contrastive_dist.metrics`: a memory queue of past keys, retrieval accuracy;
* :mod:`contrastive_dist.lightning`, :mod:`contrastive_dist.testing`: integrations (Lightning, gloo test processes).
"""

import sys as _sys

from contrastive_dist._dist import GroupLike, set_default_group
from contrastive_dist.data import collate as _collate
from contrastive_dist.data import sampler as _sampler
from contrastive_dist.data import shards as _shards
from contrastive_dist.data import streaming as _streaming
from contrastive_dist.data.collate import EmptySafeCollate
from contrastive_dist.data.sampler import DistributedBatchSampler
from contrastive_dist.data.shards import DistributedShardList
from contrastive_dist.data.streaming import DistributedStreamingBatches
from contrastive_dist.engine import collectives as _collectives
from contrastive_dist.engine import gather as _gather
from contrastive_dist.engine._faults import PeerFailureError
from contrastive_dist.engine.collectives import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from contrastive_dist.engine.gather import Gathered, GatheredMany, all_gather, all_gather_many
from contrastive_dist.losses import (
    DCLLoss,
    DistributedInfoNCE,
    HCLLoss,
    NTXentLoss,
    SharedNegatives,
    SigLIPLoss,
    SupConLoss,
    dcl,
    hcl,
    info_nce,
    nt_xent,
    siglip,
    supcon,
)
from contrastive_dist.metrics import retrieval_accuracy
from contrastive_dist.nn import norm as _norm
from contrastive_dist.nn.grad_cache import grad_cache
from contrastive_dist.nn.norm import SyncBatchNorm, convert_sync_batchnorm
from contrastive_dist.queue import DistributedMemoryQueue

# The public submodules that moved into the layer folders keep their old import paths
# (``import contrastive_dist.sampler``, ``from contrastive_dist.gather import all_gather``):
# each old name is the moved module itself, not a copy.
_MOVED_MODULES = {
    "collate": _collate,
    "collectives": _collectives,
    "gather": _gather,
    "norm": _norm,
    "sampler": _sampler,
    "shards": _shards,
    "streaming": _streaming,
}
for _old_name, _module in _MOVED_MODULES.items():
    _sys.modules[f"{__name__}.{_old_name}"] = _module

__all__ = [
    "DistributedInfoNCE",
    "NTXentLoss",
    "SigLIPLoss",
    "SupConLoss",
    "DCLLoss",
    "HCLLoss",
    "info_nce",
    "nt_xent",
    "siglip",
    "supcon",
    "dcl",
    "hcl",
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
    "grad_cache",
    "DistributedBatchSampler",
    "DistributedShardList",
    "DistributedStreamingBatches",
    "EmptySafeCollate",
    "PeerFailureError",
    "GroupLike",
    "set_default_group",
]

__version__ = "0.1.0"
