"""Differentiable, variable-size all-gather: the engine every loss stands on.

Forward: every rank receives the rows of every rank, concatenated in rank order. Ranks may
hold different numbers of rows, including none.

Backward: **reduce-scatter with SUM**. Rank ``r`` receives ``Σ_k ∂L_k/∂x_r``: the gradient
that *every* rank's loss sends to rank ``r``'s rows. This is what a loss computed on local
rows against gathered columns needs (the [gradient contract][gradient-contract]); returning only
the local slice of the incoming gradient, as many hand-written ``GatherLayer``s do, drops the
part contributed by the other ranks' losses.

One collective moves the data each way, with no padding on the wire. Before it, one small
exchange shares sizes, dtype and trailing shape, so that a mismatch raises the same clear
error on every rank instead of hanging or aborting the transport. Pass ``sizes=`` to skip it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import torch
from einops import rearrange, unpack
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_rank, get_world_size, start_offset
from contrastive_dist._validation import sizes_problem
from contrastive_dist.engine._agreement import Layout, agree, debug_checks, local_problem
from contrastive_dist.engine._compiled import gather_compiled
from contrastive_dist.engine._wire import (
    STATUS_BAD_ROWS,
    STATUS_OK,
    STATUS_OK_WITH_GRAD,
    gather_rows,
    gather_rows_with_status,
    reduce_scatter_rows,
)

__all__ = ["Gathered", "GatheredMany", "all_gather", "all_gather_many", "gather_agreed", "raise_on_all_ranks"]


class Gathered(NamedTuple):
    """Result of :func:`all_gather`.

    Attributes:
        tensor: the rows of every rank, concatenated along ``dim`` in rank order.
        sizes: rows contributed by each rank, one Python int per rank.
        rank: this process's rank in the group.

    Example:
        >>> import torch
        >>> from contrastive_dist import all_gather
        >>> gathered = all_gather(torch.randn(3, 8))  # on rank 1 of sizes (2, 3, 0): offset 2, local_size 3
        >>> gathered.sizes, gathered.rank, gathered.offset, gathered.local_size
        ((3,), 0, 0, 3)
        >>> mine = gathered.tensor[gathered.offset : gathered.offset + gathered.local_size]  # this rank's rows
    """

    tensor: Tensor
    sizes: tuple[int, ...]
    rank: int

    @property
    def offset(self) -> int:
        """Index of this rank's first row in :attr:`tensor`."""
        return start_offset(self.sizes, self.rank)

    @property
    def local_size(self) -> int:
        """Number of rows this rank contributed."""
        return self.sizes[self.rank]


class GatheredMany(NamedTuple):
    """Result of :func:`all_gather_many`: like :class:`Gathered`, for several tensors at once.

    Attributes:
        tensors: for each input, the rows of every rank, concatenated along ``dim`` in rank order.
        sizes: rows contributed by each rank, one Python int per rank.
        rank: this process's rank in the group.

    Example:
        >>> import torch
        >>> from contrastive_dist import all_gather_many
        >>> images, texts = all_gather_many((torch.randn(3, 8), torch.randn(3, 4))).tensors
        >>> images.shape, texts.shape
        (torch.Size([3, 8]), torch.Size([3, 4]))
    """

    tensors: tuple[Tensor, ...]
    sizes: tuple[int, ...]
    rank: int

    @property
    def offset(self) -> int:
        """Index of this rank's first row in each of :attr:`tensors`."""
        return start_offset(self.sizes, self.rank)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 whose backward is the matching reduce-scatter (SUM)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        sizes: tuple[int, ...],
        rank: int,
        group: ProcessGroup | None,
        statuses: list[int] | None,
    ) -> Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        if statuses is None:
            return gather_rows(x, sizes, rank, group)
        # Caller-given sizes: ``statuses`` holds this rank's status code on the way in and every
        # rank's on the way out (carried by the same transfers), so the caller can check them.
        gathered, statuses[:] = gather_rows_with_status(x, sizes, rank, group, statuses[0])
        return gathered

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # The reduce-scatter is a raw collective autograd cannot differentiate again; marking
        # the backward makes ``create_graph=True`` raise instead of returning wrong results.
        return reduce_scatter_rows(grad, ctx.sizes, ctx.rank, ctx.group), None, None, None, None


def all_gather(
    x: Tensor,
    dim: int = 0,
    *,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
) -> Gathered:
    """Gather ``x`` from every rank along ``dim``; sizes along ``dim`` may differ, even be 0.

    Args:
        x: this rank's tensor. Every dimension except ``dim``, and the dtype, must match across ranks.
        dim: the dimension to gather along (negative values count from the end).
        group: the process group, default the world ([group][option-group]).
        sizes: every rank's size along ``dim``, the same sequence on every rank, if already known:
            skips the size exchange; dtype and trailing shape must then match as promised, and
            ``sizes=`` that differ between ranks abort or hang the transport unless
            ``CONTRASTIVE_DIST_DEBUG=1`` ([sizes][option-sizes]).

    Returns:
        :class:`Gathered` ``(tensor, sizes, rank)``. Without an initialised process group, or
        with one rank, ``tensor`` is ``x`` itself and ``sizes == (x.shape[dim],)``.

    Raises:
        ValueError / TypeError: on every rank, when the ranks' inputs do not agree or are invalid.

    Shape:
        x: ``(..., n_r, ...)`` → tensor: ``(..., Σ_r n_r, ...)`` with ``n_r`` at position ``dim``.

    Example:
        >>> import torch
        >>> from contrastive_dist import all_gather
        >>> x = torch.randn(3, 8, requires_grad=True)
        >>> gathered = all_gather(x)  # one process: the identity
        >>> gathered.tensor.shape, gathered.sizes, gathered.offset
        (torch.Size([3, 8]), (3,), 0)
        >>> gathered.tensor.sum().backward()
    """
    many = all_gather_many((x,), dim, group=group, sizes=sizes)
    return Gathered(many.tensors[0], many.sizes, many.rank)


def all_gather_many(
    tensors: Sequence[Tensor],
    dim: int = 0,
    *,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
) -> GatheredMany:
    """Gather several tensors with the same size along ``dim`` in one collective.

    Tensors of the same dtype are packed into one buffer, so gathering image and text
    features together costs one collective instead of two. Arguments and results are those
    of :func:`all_gather`, with ``tensors`` a sequence.

    Example:
        >>> import torch
        >>> from contrastive_dist import all_gather_many
        >>> image, text = torch.randn(4, 8), torch.randn(4, 8)
        >>> gathered = all_gather_many((image, text))
        >>> [t.shape for t in gathered.tensors], gathered.sizes
        ([torch.Size([4, 8]), torch.Size([4, 8])], (4,))
    """
    if isinstance(tensors, Tensor):
        raise TypeError("all_gather_many expects a sequence of tensors; use all_gather for one tensor")
    tensors = tuple(tensors)
    world_size, rank = get_world_size(group), get_rank(group)
    problem = local_problem(tensors, dim) or (None if sizes is None else sizes_problem(sizes, world_size))
    if world_size == 1 or torch.compiler.is_compiling() or sizes is None or debug_checks():
        # The agreement exchange (nothing is exchanged for one rank or under torch.compile, where
        # given sizes are trusted); CONTRASTIVE_DIST_DEBUG=1 runs it for caller-given sizes too.
        layout = agree(tensors, problem=problem, group=group, dim=dim, sizes=sizes)
        return gather_agreed(tensors, layout, dim)
    if problem is not None:
        # This rank cannot build a buffer of the promised shape; the others will time out
        # in their collective. (Validate inputs before promising sizes.)
        raise problem[0](f"all_gather: {problem[1]}")
    known_sizes = tuple(sizes)
    gathered, statuses = _gather_eager(tensors, dim, known_sizes, rank, group, check_rows=True)
    if STATUS_BAD_ROWS in statuses or len(set(statuses)) > 1:
        # Every rank learnt it from the statuses: they all join one exchange that raises everywhere.
        local = tensors[0].shape[dim]
        if local != known_sizes[rank]:
            problem = (ValueError, f"sizes[{rank}]={known_sizes[rank]} was given, but the input has {local} rows "
                       f"along dim={dim}")
        agree(tensors, problem=problem, group=group, dim=dim)
        raise RuntimeError("all_gather: the ranks' statuses disagreed, but their inputs agree")  # not reached
    return GatheredMany(gathered, known_sizes, rank)


def gather_agreed(tensors: Sequence[Tensor], layout: Layout, dim: int = 0) -> GatheredMany:
    """Gather ``tensors`` with the sizes every rank agreed on (:func:`~contrastive_dist.engine._agreement.agree`).

    No exchange of its own: the layout says everything. Under ``torch.compile`` the traceable route.
    """
    tensors = tuple(tensors)
    if layout.world_size == 1:
        return GatheredMany(tensors, layout.sizes, layout.rank)
    if torch.compiler.is_compiling():
        gathered = gather_compiled(tensors, dim, layout.sizes, layout.rank, layout.group)
        return GatheredMany(gathered, layout.sizes, layout.rank)
    gathered, _ = _gather_eager(tensors, dim, layout.sizes, layout.rank, layout.group, check_rows=False)
    return GatheredMany(gathered, layout.sizes, layout.rank)


def raise_on_all_ranks(error: Exception, tensors: Sequence[object], *, group: ProcessGroup | None = None) -> NoReturn:
    """Raise ``error``, found on this rank only, on every rank instead of leaving the others waiting.

    For code whose other ranks are entering :func:`~contrastive_dist.engine._agreement.agree` (the
    agreement of :func:`all_gather` without ``sizes=``): this rank joins it with its problem, so all
    of them raise the same error, which names this rank's message.
    """
    agree(tensors, problem=(type(error), str(error)), group=group)
    raise error  # not reached: the agreement raises on every rank when any rank has a problem


def _gather_eager(
    tensors: tuple[Tensor, ...],
    dim: int,
    sizes: tuple[int, ...],
    rank: int,
    group: ProcessGroup | None,
    *,
    check_rows: bool,
) -> tuple[tuple[Tensor, ...], list[int]]:
    """One collective per dtype.

    With ``check_rows`` (caller-given sizes) each collective also carries every rank's status:
    whether its row count matches ``sizes`` and whether autograd tracks its rows. Returns the
    gathered tensors and the statuses (stopping at the first collective where they disagree).
    """
    rows = [tensor.movedim(dim, 0) for tensor in tensors]
    results: list[Tensor] = list(rows)
    statuses: list[int] = []
    rows_match = rows[0].shape[0] == sizes[rank]
    for indices in _indices_by_dtype(rows):
        members = [rows[i] for i in indices]
        packed = _pack(members)
        exchange: list[int] | None = None
        if check_rows:
            tracked = torch.is_grad_enabled() and any(member.requires_grad for member in members)
            code = STATUS_OK_WITH_GRAD if tracked else STATUS_OK
            exchange = [code if rows_match else STATUS_BAD_ROWS]
        gathered = _GatherRows.apply(packed, sizes, rank, group, exchange)
        if exchange is not None:
            statuses = exchange
            if STATUS_BAD_ROWS in statuses or len(set(statuses)) > 1:
                return tuple(results), statuses  # the caller raises on every rank
        for index, piece in zip(indices, _unpack(gathered, members)):
            results[index] = piece.movedim(0, dim)
    return tuple(results), statuses


def _indices_by_dtype(rows: list[Tensor]) -> list[list[int]]:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, row in enumerate(rows):
        by_dtype.setdefault(row.dtype, []).append(index)
    return list(by_dtype.values())


def _pack(members: list[Tensor]) -> Tensor:
    """One ``(n, Σ row_numel)`` buffer for tensors of one dtype (the tensor itself if alone).

    Not ``einops.pack``: it flattens with a ``-1``, which torch cannot resolve for an empty
    rank's ``(0, ...)`` rows; naming the flattened axes always works.
    """
    if len(members) == 1:
        return members[0]
    return torch.cat([rearrange(member, "n ... -> n (...)") for member in members], dim=1)


def _unpack(gathered: Tensor, members: list[Tensor]) -> list[Tensor]:
    """Inverse of :func:`_pack` on the gathered rows (views, no copy)."""
    if len(members) == 1:
        return [gathered]
    return unpack(gathered, [member.shape[1:] for member in members], "n *")
