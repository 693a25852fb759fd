"""The process group a drop-in computes over: the world, or this rank alone when the original does not gather."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["loss_group"]

_ALONE: dict[object, ProcessGroup] = {}


def loss_group(gather: bool) -> ProcessGroup | None:
    """``None`` (the world) when ``gather``; else a group of this rank alone, made once per world on every rank.

    An original without its gather option set (lightly's ``gather_distributed=False``,
    sentence-transformers' ``gather_across_devices=False``) computes each rank's loss over that rank's
    batch only; a group of one gives the package's losses exactly that meaning. Every rank makes the
    groups together on its first call, as ``torch.distributed.new_subgroups`` requires.
    """
    if gather or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if world not in _ALONE:
        _ALONE[world], _ = dist.new_subgroups(group_size=1)
    return _ALONE[world]
