"""Rank, world size and group helpers that are safe without ``init_process_group``.

Every public op reads rank and world size at call time through these helpers, so the
same code runs unchanged in one plain process, in one process of a group, or in many.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["is_distributed", "get_rank", "get_world_size", "start_offset"]


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """Whether ``group`` spans more than one process.

    Without an initialised default process group this is ``False``, so callers fall back
    to the single-process (identity) behaviour.
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def get_rank(group: ProcessGroup | None = None) -> int:
    """Rank of this process within ``group`` (0 when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of processes in ``group`` (1 when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def start_offset(sizes: tuple[int, ...], rank: int) -> int:
    """Index of the first row owned by ``rank`` when rows are concatenated in rank order."""
    return sum(sizes[:rank])
