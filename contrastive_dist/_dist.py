"""Rank, world size and group helpers that are safe without ``init_process_group``.

Every public op reads rank and world size at call time through these helpers, so the
same code runs unchanged in one plain process, in one process of a group, or in many.

What ``group=`` accepts everywhere in the package (:data:`GroupLike`) is turned into a process
group here, once per call, by :func:`process_group`: a ``ProcessGroup``; a ``DeviceMesh`` of one
dimension (its group) or of several (its ranks flattened into one group, as
``mesh["dp_replicate", "dp_shard"]`` for HSDP); or ``None``, the default group
(:func:`set_default_group`, else the world). A process outside the group it is given gets a
``ValueError`` naming the group and the process, never a bare failure inside a collective.

**DTensor inputs** (a tensor-parallel layer's output with ``use_local_output=False``): a loss or a
gather over ``group`` needs, on each rank, whole rows that no other rank of ``group`` also holds.
:func:`as_local` takes a ``DTensor``'s local tensor when, over every dimension of its mesh with more
than one rank, it is ``Replicate()`` with at most one of the dimension's ranks in ``group`` (a
tensor-parallel dimension beside the data-parallel group; else every row would count once per replica)
or ``Shard(0)`` with all of them in ``group`` (a batch sharded by DTensor over the data-parallel
dimension); anything else (``Shard(1)``, ``Partial()``) is refused with a ``ValueError`` that says how to
make the tensor replicated there. The local tensor keeps the gradient path. Nothing is imported unless
a ``DTensor`` exists (``torch.distributed.tensor`` loaded).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, Union

import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GroupLike",
    "as_local",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "process_group",
    "set_default_group",
    "start_offset",
]

GroupLike = Union[ProcessGroup, "DeviceMesh", None]
"""What ``group=`` accepts: a ``ProcessGroup``, a ``DeviceMesh`` (1-D, or several dimensions flattened), or ``None``.

``None`` is the default group: the one given to :func:`~contrastive_dist.set_default_group`, else the world.
Under a data × tensor (× context) parallel mesh give the data-parallel part only, e.g. ``mesh["dp"]``:
the other dimensions hold the same samples ([scale out][scale-out]).

Example:
    >>> import torch
    >>> from contrastive_dist import GroupLike, info_nce
    >>> def clip_loss(image: torch.Tensor, text: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    ...     return info_nce(image, text, group=group)  # e.g. group=mesh["dp"] under tensor parallelism
    >>> clip_loss(torch.eye(3), torch.eye(3)).shape
    torch.Size([])
"""

_default: list[tuple[ProcessGroup, object]] = []
"""The default group and the world it was set in (a process group made after a re-initialisation ends it)."""


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def set_default_group(group: GroupLike) -> None:
    """Make ``group`` what ``group=None`` means in every call of the package in this process; ``None``: the world again.

    For code that cannot pass ``group=`` everywhere (a model whose loss, BatchNorm and loaders are built
    elsewhere, say): under a data × tensor parallel mesh, ``set_default_group(mesh["dp"])`` once on every
    rank makes the losses, the gather, the queue, SyncBatchNorm, the gradient cache, the sampler and the
    streams work over the data-parallel ranks. ``contrastive_dist.lightning``'s loaders do it for a trainer
    whose strategy has a device mesh. Call it on every rank alike (a mesh of several dimensions is
    flattened then, which every rank of the world joins). It lasts until it is set again or the process
    group is destroyed.

    Raises:
        TypeError / ValueError: what :func:`process_group` raises for ``group``.

    Example:
        >>> import torch
        >>> from contrastive_dist import all_gather, set_default_group
        >>> set_default_group(None)  # one process: nothing to change
        >>> all_gather(torch.ones(2, 3)).sizes
        (2,)
    """
    _default.clear()
    resolved = process_group(group)
    if resolved is not None:
        _default.append((resolved, dist.group.WORLD))


def _default_group() -> ProcessGroup | None:
    if not _default or not _initialized():
        return None
    group, world = _default[0]
    return group if world is dist.group.WORLD else None


def process_group(group: GroupLike) -> ProcessGroup | None:
    """The process group that ``group`` names (``None``: the default group, see :func:`set_default_group`).

    Raises:
        TypeError: ``group`` is none of :data:`GroupLike`.
        ValueError: this process is not one of the group's ranks (a ``DeviceMesh`` of several unnamed
            dimensions, which cannot be flattened, too).

    Example:
        >>> process_group(None) is None  # one process, no default group: the world
        True
    """
    if group is None:
        return _default_group()
    if isinstance(group, ProcessGroup):
        if _initialized() and dist.get_rank(group) < 0:
            raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the process "
                             f"group {_describe(group)} it was given; call with a group that holds this rank")
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        return _mesh_group(group)
    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"group: this process (global rank {get_rank()}) is not a member of the group it was "
                         "given: torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here, on a rank "
                         "outside the group; call with a group that holds this rank")
    raise TypeError(f"group must be a torch.distributed.ProcessGroup, a DeviceMesh or None, got {type(group).__name__}")


def _describe(group: ProcessGroup) -> str:
    try:
        return f"{group.group_name!r} (global ranks {dist.get_process_group_ranks(group)})"
    except (RuntimeError, ValueError, KeyError):  # a group this rank holds no record of
        return repr(group.group_name)


def _mesh_group(mesh: DeviceMesh) -> ProcessGroup:
    """A mesh's one group, or the group of all its ranks: its dimensions flattened, as HSDP's ``mesh._flatten()``."""
    if mesh.get_coordinate() is None:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not in the device mesh {mesh} "
                         f"(global ranks {mesh.mesh.flatten().tolist()}) it was given; call with a mesh that holds "
                         "this rank")
    if mesh.ndim == 1:
        return mesh.get_group()
    if not mesh.mesh_dim_names:
        raise ValueError(f"group: a DeviceMesh of {mesh.ndim} dimensions is flattened into one group by its "
                         f"dimension names, and {mesh} has none; give it mesh_dim_names or pass a 1-D mesh")
    # Flattened once per mesh: torch keeps the flattened mesh on the root mesh, so a later call looks it up.
    return mesh._flatten().get_group()


def is_distributed(group: GroupLike = None) -> bool:
    """Whether ``group`` spans more than one process.

    Without an initialised default process group this is ``False``, so callers fall back
    to the single-process (identity) behaviour.
    """
    resolved = process_group(group)
    return _initialized() and dist.get_world_size(resolved) > 1


def get_rank(group: GroupLike = None) -> int:
    """Rank of this process within ``group`` (0 when not distributed)."""
    resolved = process_group(group)
    return dist.get_rank(resolved) if _initialized() else 0


def get_world_size(group: GroupLike = None) -> int:
    """Number of processes in ``group`` (1 when not distributed)."""
    resolved = process_group(group)
    return dist.get_world_size(resolved) if _initialized() else 1


def start_offset(sizes: tuple[int, ...], rank: int) -> int:
    """Index of the first row owned by ``rank`` when rows are concatenated in rank order."""
    return sum(sizes[:rank])


T = TypeVar("T")

_REPLICATE = ("make it Replicate() there: give the tensor-parallel layer output_layouts=Replicate(), or call "
              "tensor.redistribute(placements=...) with Replicate() on that dimension")


def as_local(values: Sequence[T], group: GroupLike) -> tuple[T, ...]:
    """``values`` with every ``DTensor`` replaced by its local tensor (this rank's rows); others as they are.

    A named tuple stays one of its kind.

    Raises:
        ValueError: a ``DTensor`` whose placements do not give this rank's rows (see the module docstring).

    Example:
        >>> import torch
        >>> as_local((torch.ones(2, 3), None), None)[0].shape  # plain tensors pass through
        torch.Size([2, 3])
    """
    tensor_module = sys.modules.get("torch.distributed.tensor")
    local: list[Any] = list(values)
    if tensor_module is not None:  # else no DTensor can exist
        for index, value in enumerate(values):
            if isinstance(value, tensor_module.DTensor):
                _check_placements(value, _group_ranks(group))
                local[index] = value.to_local()
    return type(values)(*local) if hasattr(values, "_fields") else tuple(local)  # type: ignore[return-value]


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
