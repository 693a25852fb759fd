"""The two transports of the losses: which column blocks a rank's rows meet, and where their gradients go.

A transport knows nothing of any loss. It is handed this rank's block — a tuple of tensors whose
rows are columns of the loss (features, and what travels with them: their keys, in a second pass
their columns' final states) — and a ``visit(owner, block, accumulator)`` that computes on one block
and adds into ``accumulator`` (a gradient or a state that belongs to the block's owner):

* :class:`OneBlock` (``communication="gather"``): the block already holds every rank's columns
  (gathered by :func:`~contrastive_dist.engine.gather.gather_agreed`); it is visited once, and its
  accumulator (the gathered features' gradient) goes back through the gather's reduce-scatter, by autograd.
* :class:`RingBlocks` (``communication="ring"``): the block is this rank's own; every rank's block
  comes past once, one per hop (:mod:`contrastive_dist.engine._ring`), and each accumulator
  follows its block round and comes home to its owner.

:func:`meet` sets up a call's :class:`Columns` for either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._agreement import Layout
from contrastive_dist.engine._compiled import gather_compiled
from contrastive_dist.engine._ring import Block, Ring, circulate
from contrastive_dist.engine._wire import gather_rows
from contrastive_dist.engine.gather import gather_agreed

__all__ = ["EVERY_RANK", "LOCAL", "Columns", "OneBlock", "RingBlocks", "Transport", "Visit", "meet"]

EVERY_RANK = -1
"""The ``owner`` of gather mode's one block: it holds every rank's columns."""
LOCAL = -2
"""The ``owner`` of the columns held here (shared negatives): no rank's block, no transfer, no gradient."""

Visit = Callable[[int, Block, Tensor | None], None]
NewAccumulator = Callable[[int], Tensor]
Merge = Callable[[Tensor, Tensor], object]
Merged = Callable[[Tensor], Tensor]


def _gathered(rows: Tensor, sizes: tuple[int, ...], rank: int, group: ProcessGroup | None) -> Tensor:
    """Every rank's ``rows`` in rank order (not differentiated: the driver forms its own gradients)."""
    if len(sizes) == 1:
        return rows
    if torch.compiler.is_compiling():
        return gather_compiled((rows,), 0, sizes, rank, group)[0]
    return gather_rows(rows.contiguous(), sizes, rank, group)


class OneBlock(NamedTuple):
    """Gather mode: every column in one block, this rank's own columns from ``own_start``.

    Attributes:
        own_start: where this rank's own columns start in the block.
        rank, group: this rank and its process group, for the exchanges of a symmetric loss's columns.
    """

    own_start: int
    rank: int = 0
    group: ProcessGroup | None = None

    def own_start_of(self, owner: int) -> int | None:
        """Where this rank's own columns start in ``owner``'s block: always at :attr:`own_start`."""
        return self.own_start

    def columns_in(self, owner: int, counts: Sequence[int]) -> int:
        """How many of the block's leading columns belong to ``counts`` (every rank's: ``counts[r]`` each)."""
        return sum(counts)

    def complete(self, state: Tensor, counts: Sequence[int], merged: Merged) -> Tensor:
        """Every rank's partial states of the block's columns, merged: the same on every rank.

        This rank's rows met every column, but only its own rows: the columns' own direction needs
        every rank's, combined by one small exchange (``W × columns × width`` numbers); ``merged`` is
        the family's merge of a ``(W, columns, width)`` stack.

        Shape:
            state: ``(Σ counts, width)`` → ``(Σ counts, width)``.
        """
        world_size = len(counts)
        if world_size == 1:
            return state
        parts = _gathered(state, (state.shape[0],) * world_size, self.rank, self.group)
        return merged(parts.view(world_size, *state.shape))

    def own_columns(self, values: Tensor, counts: Sequence[int]) -> Tensor:
        """The block's columns that are this rank's own (``counts[rank]`` rows from :attr:`own_start`)."""
        return values[self.own_start : self.own_start + counts[self.rank]]

    def block_columns(self, values: Tensor, counts: Sequence[int]) -> Tensor:
        """Values of this rank's own columns → the block's: every rank's, gathered (one small exchange)."""
        return _gathered(values, tuple(counts), self.rank, self.group)

    def run(self, block: Block, rows: Sequence[Sequence[int]], visit: Visit,
            new_accumulator: NewAccumulator | None = None, merge_: Merge = Tensor.add_) -> Tensor | None:
        """Visit the one block; return its accumulator (``rows`` is unused: nothing is received)."""
        accumulator = None if new_accumulator is None else new_accumulator(EVERY_RANK)
        visit(EVERY_RANK, block, accumulator)
        return accumulator


class RingBlocks(NamedTuple):
    """Ring mode: ``W`` blocks, one per hop; this rank's own columns are its own block, from row 0."""

    ring: Ring

    def own_start_of(self, owner: int) -> int | None:
        """0 on this rank's own block, ``None`` on another rank's."""
        return 0 if owner == self.ring.rank else None

    def columns_in(self, owner: int, counts: Sequence[int]) -> int:
        """How many of ``owner``'s block's leading columns belong to ``counts``."""
        return counts[owner]

    def complete(self, state: Tensor, counts: Sequence[int], merged: Merged) -> Tensor:
        """The own block's column state: complete already, every rank's contribution came home with it."""
        return state

    def own_columns(self, values: Tensor, counts: Sequence[int]) -> Tensor:
        """The own block's columns are this rank's own."""
        return values

    def block_columns(self, values: Tensor, counts: Sequence[int]) -> Tensor:
        """The own block's columns are this rank's own: they travel with it."""
        return values

    def run(self, block: Block, rows: Sequence[Sequence[int]], visit: Visit,
            new_accumulator: NewAccumulator | None = None, merge_: Merge = Tensor.add_) -> Tensor | None:
        """Pass every rank's block round the ring; return this rank's accumulator, home with every contribution.

        ``rows[t][owner]``: the number of rows of the block's ``t``-th tensor on rank ``owner``,
        known to every rank, so receive buffers are allocated ahead and empty ones skipped on both ends.
        """

        def new_block(owner: int) -> Block:
            return tuple(
                tensor.new_empty((counts[owner], *tensor.shape[1:])) for tensor, counts in zip(block, rows, strict=True)
            )

        contiguous = tuple(tensor.contiguous() for tensor in block)
        return circulate(self.ring, contiguous, new_block, visit, new_accumulator=new_accumulator, merge_=merge_)


Transport = OneBlock | RingBlocks


class Columns(NamedTuple):
    """The columns a rank's rows meet, and how.

    Attributes:
        features: ``(m, D)`` gather mode: every rank's, gathered; ring mode: this rank's own.
        keys: ``(k,)`` their keys (ids, labels), the block's first ``k`` columns', or ``None``.
        transport: :class:`OneBlock` or :class:`RingBlocks`.
        counts: every rank's number of columns (ring mode's receive buffers).
        key_counts: every rank's number of keys (columns past a block's keys share none with any row).
        local: ``(K, D)`` columns held here, identical on every rank (shared negatives), met by every
            row, without gradient, and their keys ``(K,)`` (or ``None``); or ``None``.
        own_losses: symmetric losses: every rank's number of leading columns with a loss of their own
            (InfoNCE's texts; negatives have none), from the same logits; ``None``: the columns have none.
        weights: gather mode's symmetric losses: ``(Σ own_losses,)`` the weights of those columns, gathered.
    """

    features: Tensor
    keys: Tensor | None
    transport: Transport
    counts: tuple[int, ...]
    key_counts: tuple[int, ...]
    local: tuple[Tensor, Tensor | None] | None = None
    own_losses: tuple[int, ...] | None = None
    weights: Tensor | None = None

    def block(self) -> Block:
        """This rank's block as it travels: the features, then their keys."""
        return (self.features,) if self.keys is None else (self.features, self.keys)

    def block_rows(self) -> list[tuple[int, ...]]:
        """Every rank's rows of each tensor of :meth:`block` (ring mode's receive buffers)."""
        return [self.counts] if self.keys is None else [self.counts, self.key_counts]


def meet(communication: str, layout: Layout, own: Sequence[Tensor], *, per_sample: int = 1) -> tuple[Tensor, ...]:
    """This rank's ``own`` columns (``n_r`` samples, ``per_sample`` rows each) as the mode meets them.

    ``"gather"`` gathers every rank's ``own`` now (one collective per dtype, with the agreed sizes);
    ``"ring"`` keeps them here and lets the driver pass them round.

    Shape:
        own: tensors of ``(n_r · per_sample, ...)``; output: ``(N · per_sample, ...)`` gathered in rank
        order, or ``own`` as they are.
    """
    if communication == "ring" or layout.world_size == 1:
        return tuple(own)
    rows = tuple(size * per_sample for size in layout.sizes)
    return gather_agreed(own, layout._replace(sizes=rows)).tensors


def transport_of(communication: str, layout: Layout, counts: tuple[int, ...], per_sample: int = 1) -> Transport:
    """The transport of ``communication`` for columns of ``counts`` rows per rank (this rank's own from its offset)."""
    if communication == "gather":
        return OneBlock(layout.offset * per_sample, layout.rank, layout.group)
    return RingBlocks(Ring(layout.rank, layout.world_size, counts, layout.group))
