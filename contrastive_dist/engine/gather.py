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
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from contrastive_dist._dist import GroupLike, as_local, get_rank, get_world_size, process_group, start_offset
from contrastive_dist._validation import collect, sizes_problem
from contrastive_dist.engine._agreement import Layout, agree, debug_checks, local_problem
from contrastive_dist.engine._compiled import gather_compiled
from contrastive_dist.engine._gather_rows import gather_eager
from contrastive_dist.engine._wire_status import STATUS_BAD_ROWS

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


def all_gather(
    x: Tensor,
    dim: int = 0,
    *,
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
) -> Gathered:
    """Gather ``x`` from every rank along ``dim``; sizes along ``dim`` may differ, even be 0.

    Args:
        x: this rank's tensor. Every dimension except ``dim``, and the dtype, must match across ranks.
        dim: the dimension to gather along (negative values count from the end).
        group: a process group or a device mesh, default the world ([group][option-group]).
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
    group: GroupLike = None,
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
    group = process_group(group)
    local_tensors, dtensor_problem = collect(lambda: as_local(tuple(tensors), group))  # DTensors: this rank's rows
    tensors = tuple(tensors) if local_tensors is None else local_tensors
    world_size, rank = get_world_size(group), get_rank(group)
    problem = dtensor_problem or local_problem(tensors, dim)
    problem = problem or (None if sizes is None else sizes_problem(sizes, world_size))
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
    gathered, statuses = gather_eager(tensors, dim, known_sizes, rank, group, check_rows=True)
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
    gathered, _ = gather_eager(tensors, dim, layout.sizes, layout.rank, layout.group, check_rows=False)
    return GatheredMany(gathered, layout.sizes, layout.rank)


def raise_on_all_ranks(error: Exception, tensors: Sequence[object], *, group: GroupLike = None) -> NoReturn:
    """Raise ``error``, found on this rank only, on every rank instead of leaving the others waiting.

    For code whose other ranks are entering :func:`~contrastive_dist.engine._agreement.agree` (the
    agreement of :func:`all_gather` without ``sizes=``): this rank joins it with its problem, so all
    of them raise the same error, which names this rank's message.
    """
    agree(tensors, problem=(type(error), str(error)), group=group)
    raise error  # not reached: the agreement raises on every rank when any rank has a problem
