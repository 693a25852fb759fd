"""Tensor-parallel group collectives with their autograd pairs.

In tensor (model) parallelism every rank of a group holds the same activations or one slice
of them; each op below moves between those two states, and its backward is the op that
moves the gradient back:

=====================  ===============================  ===============================
op                     forward                          backward
=====================  ===============================  ===============================
``copy_to_group``      identity                         all-reduce (SUM)
``reduce_from_group``  all-reduce (SUM)                 identity
``scatter_to_group``   keep this rank's slice of ``x``  all-gather the slices
``gather_from_group``  all-gather the slices            keep this rank's slice
=====================  ===============================  ===============================

Slices follow ``torch.tensor_split``: a length ``L`` splits into ``W`` parts whose sizes
differ by at most one, the first ``L % W`` ranks holding one more; lengths need not divide.
Every op takes ``group=`` and is the identity on one rank or without a process group.

The backward passes are raw collectives, so they are marked once-differentiable: asking for a
second derivative (``create_graph=True``) raises instead of returning a wrong one.

Contrast with :func:`contrastive_dist.all_gather`, whose backward *sums* the gradient over
ranks: that is right for data parallelism, where each rank's loss differs; here the
computation after ``gather_from_group`` is replicated, so each rank keeps its own slice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from contrastive_dist._dist import GroupLike, get_rank, get_world_size, process_group
from contrastive_dist.engine._wire import all_reduce
from contrastive_dist.engine.gather import all_gather

__all__ = ["copy_to_group", "gather_from_group", "reduce_from_group", "scatter_to_group"]


def _all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    out = x.contiguous().clone()
    all_reduce(out, group, operation="tensor-parallel all-reduce")
    return out


def _split_sizes(length: int, world_size: int) -> tuple[int, ...]:
    base, extra = divmod(length, world_size)
    return tuple(base + (rank < extra) for rank in range(world_size))


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:  # type: ignore[override]
        return _all_reduce_sum(x, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:  # type: ignore[override]
        world_size, rank = get_world_size(group), get_rank(group)
        ctx.dim, ctx.group = dim, group
        ctx.sizes = _split_sizes(x.shape[dim], world_size)
        return x.tensor_split(world_size, dim=dim)[rank].contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        with torch.no_grad():
            full = all_gather(grad, ctx.dim, group=ctx.group, sizes=ctx.sizes).tensor
        return full, None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:  # type: ignore[override]
        with torch.no_grad():
            gathered = all_gather(x, dim, group=group)
        ctx.dim, ctx.start, ctx.length = dim, gathered.offset, gathered.local_size
        return gathered.tensor

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return grad.narrow(ctx.dim, ctx.start, ctx.length).contiguous(), None, None


def copy_to_group(x: Tensor, *, group: GroupLike = None) -> Tensor:
    """Identity forward; all-reduce (SUM) of the gradient in backward.

    Put it where a replicated tensor enters rank-specific computation (e.g. before a
    column-parallel linear layer), so each rank's partial gradient is summed.

    Shape:
        x: any → same.

    Example:
        >>> import torch
        >>> from contrastive_dist import copy_to_group
        >>> copy_to_group(torch.ones(2, 3)).shape
        torch.Size([2, 3])
    """
    return _across(_CopyToGroup, x, group=group)


def reduce_from_group(x: Tensor, *, group: GroupLike = None) -> Tensor:
    """All-reduce (SUM) forward; identity backward — the mirror of :func:`copy_to_group`.

    Shape:
        x: any → same.

    Example:
        >>> import torch
        >>> from contrastive_dist import reduce_from_group
        >>> reduce_from_group(torch.ones(2)).tolist()  # one process: identity
        [1.0, 1.0]
    """
    return _across(_ReduceFromGroup, x, group=group)


def scatter_to_group(x: Tensor, dim: int = -1, *, group: GroupLike = None) -> Tensor:
    """Keep this rank's ``tensor_split`` slice of ``x`` along ``dim``; backward gathers the slices.

    ``x`` must be the same on every rank of the group (replicated).

    Shape:
        x: ``(..., L, ...)`` → ``(..., L_r, ...)`` with ``L_r = L // W + (rank < L % W)``.

    Example:
        >>> import torch
        >>> from contrastive_dist import scatter_to_group
        >>> scatter_to_group(torch.arange(5), dim=0).tolist()  # one process: identity
        [0, 1, 2, 3, 4]
    """
    dim = _check_dim(x, dim)
    return _across(_ScatterToGroup, x, dim, group=group)


def gather_from_group(x: Tensor, dim: int = -1, *, group: GroupLike = None) -> Tensor:
    """Concatenate every rank's slice along ``dim``; backward keeps this rank's slice.

    The inverse of :func:`scatter_to_group`; slices may differ in length (any lengths, not
    only ``tensor_split``'s), and a mismatch in the other dimensions raises on every rank.

    Shape:
        x: ``(..., L_r, ...)`` → ``(..., Σ_r L_r, ...)``.

    Example:
        >>> import torch
        >>> from contrastive_dist import gather_from_group
        >>> gather_from_group(torch.arange(3), dim=0).tolist()  # one process: identity
        [0, 1, 2]
    """
    dim = _check_dim(x, dim)
    return _across(_GatherFromGroup, x, dim, group=group)


def _across(function: type[torch.autograd.Function], x: Tensor, *args: object, group: GroupLike) -> Tensor:
    """``function`` applied over the ranks of ``group`` (resolved here once); the identity on one rank."""
    resolved = process_group(group)
    if get_world_size(resolved) == 1:
        return x
    return function.apply(x, *args, resolved)


def _check_dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < max(x.ndim, 1):
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % max(x.ndim, 1)

