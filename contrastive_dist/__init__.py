"""contrastive_dist: exact contrastive losses under data parallelism, on a differentiable variable-size all-gather."""

from contrastive_dist.gather import Gathered, GatheredMany, all_gather, all_gather_many

__all__ = [
    "Gathered",
    "GatheredMany",
    "all_gather",
    "all_gather_many",
]

__version__ = "0.1.0"
