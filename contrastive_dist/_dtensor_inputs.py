"""DTensor inputs (a tensor-parallel layer's output with ``use_local_output=False``): this rank's rows, or refused.

A loss or a gather over ``group`` needs, on each rank, whole rows that no other rank of ``group`` also
holds. A ``DTensor`` gives that as its local tensor when, over every dimension of its mesh with more
than one rank:

* ``Replicate()``: the dimension's ranks hold the same rows, so at most one of them may be in
  ``group`` (a tensor-parallel dimension beside the data-parallel group); else every row would count
  once per replica;
* ``Shard(0)``: the rows are split over the dimension's ranks, so all of them must be in ``group``
  (the data-parallel dimension of a batch sharded by DTensor);
* anything else (features split by ``Shard(1)``, pending sums in ``Partial()``) is refused with a
  ``ValueError`` that says how to make the tensor replicated there.

The local tensor keeps the gradient path: its gradient goes back into the ``DTensor`` with the same
placements. Nothing is imported unless a ``DTensor`` exists (``torch.distributed.tensor`` loaded).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from contrastive_dist._dist import GroupLike, get_world_size, process_group

__all__ = ["as_local"]

T = TypeVar("T")

_REPLICATE = ("make it Replicate() there: give the tensor-parallel layer output_layouts=Replicate(), or call "
              "tensor.redistribute(placements=...) with Replicate() on that dimension")


def as_local(values: Sequence[T], group: GroupLike) -> tuple[T, ...]:
    """``values`` with every ``DTensor`` replaced by its local tensor (this rank's rows); others as they are.

    Raises:
        ValueError: a ``DTensor`` whose placements do not give this rank's rows (see the module docstring).

    Example:
        >>> import torch
        >>> as_local((torch.ones(2, 3), None), None)[0].shape  # plain tensors pass through
        torch.Size([2, 3])
    """
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:  # no DTensor can exist
        return tuple(values)
    dtensor_type = tensor_module.DTensor
    local: list[Any] = []
    for value in values:
        if isinstance(value, dtensor_type):
            _check_placements(value, _group_ranks(group))
            value = value.to_local()
        local.append(value)
    return tuple(local)


def _group_ranks(group: GroupLike) -> set[int]:
    resolved = process_group(group)
    if resolved is None:
        return set(range(get_world_size(None)))
    return set(dist.get_process_group_ranks(resolved))


def _check_placements(tensor: Any, group_ranks: set[int]) -> None:
    mesh = tensor.device_mesh
    what = f"a DTensor input of shape {tuple(tensor.shape)} with placements {tuple(tensor.placements)}"
    if mesh.get_coordinate() is None:
        raise ValueError(f"{what} lives on a device mesh without this rank ({mesh}); pass this rank's own tensor")
    names = mesh.mesh_dim_names or tuple(str(index) for index in range(mesh.ndim))
    for index, placement in enumerate(tensor.placements):
        ranks = dist.get_process_group_ranks(mesh.get_group(index))
        if len(ranks) == 1:
            continue
        where = f"mesh dimension {names[index]!r} (global ranks {ranks})"
        in_group = group_ranks.intersection(ranks)
        if placement.is_partial():
            raise ValueError(f"{what} holds pending sums (Partial) over {where}; {_REPLICATE}")
        if placement.is_replicate() and len(in_group) > 1:
            raise ValueError(
                f"{what} is replicated over {where}, and the group spans {len(in_group)} of those ranks: each row "
                "would count once per replica. Give group= the data-parallel dimension(s) of the mesh only, "
                "e.g. mesh['dp']"
            )
        split_dim = placement.dim % tensor.ndim if placement.is_shard() else None
        if split_dim is not None and (split_dim != 0 or len(in_group) < len(ranks)):
            split = "its rows" if split_dim == 0 else f"its dimension {split_dim}"
            raise ValueError(
                f"{what} splits {split} over {where}, which the group does not span: the loss needs each row "
                f"whole on one rank of the group; {_REPLICATE}"
            )
