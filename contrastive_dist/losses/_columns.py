"""The two transports of the losses: which column blocks a rank's rows meet, and where their gradients go.

A transport knows nothing of any loss. It is handed this rank's block — a tuple of tensors whose
rows are columns of the loss (keys, and what travels with them: their keys for masks, in ring
mode's backward their column state) — and a ``visit(owner, block, accumulator)`` that computes on
one block and adds into ``accumulator`` (a gradient or a state that belongs to the block's owner):

* :class:`OneBlock` (``communication="gather"``): the block already holds every rank's columns
  (gathered by :func:`~contrastive_dist.all_gather_many`); it is visited once, and its accumulator
  (the gathered keys' gradient) goes back through the gather's reduce-scatter, by autograd.
* :class:`RingBlocks` (``communication="ring"``): the block is this rank's own; every rank's block
  comes past once, one per hop (:mod:`contrastive_dist.engine._ring`), and each accumulator
  follows its block round and comes home to its owner.
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

__all__ = ["EVERY_RANK", "Columns", "OneBlock", "RingBlocks", "Transport", "Visit", "meet"]

EVERY_RANK = -1
"""The ``owner`` of gather mode's one block: it holds every rank's columns."""

Visit = Callable[[int, Block, Tensor | None], None]
NewAccumulator = Callable[[int], Tensor]
Merge = Callable[[Tensor, Tensor], object]
Merged = Callable[[Tensor], Tensor]


def _gathered(rows: Tensor, sizes: tuple[int, ...], rank: int, group: ProcessGroup | None) -> Tensor:
    """Every rank's ``rows`` in rank order (not differentiated: the kernels form their own gradients)."""
    if len(sizes) == 1:
        return rows
    if torch.compiler.is_compiling():
        return gather_compiled((rows,), 0, sizes, rank, group)[0]
    return gather_rows(rows.contiguous(), sizes, rank, group)


class OneBlock(NamedTuple):
    """Gather mode: every column in one block, this rank's own columns from ``own_start``.

    Attributes:
        own_start: where this rank's own columns start in the block.
        rank, group: this rank and its process group, for the columns' own direction (symmetric losses).
    """

    own_start: int
    rank: int = 0
    group: ProcessGroup | None = None

    def own_start_of(self, owner: int) -> int | None:
        """Where this rank's own columns start in ``owner``'s block: always at :attr:`own_start`."""
        return self.own_start

    def columns_in(self, owner: int, counts: Sequence[int]) -> int:
        """How many columns with a loss of their own the block holds: every rank's (``counts[r]`` each)."""
        return sum(counts)

    def complete_columns(self, state: Tensor, counts: Sequence[int], merged: Merged) -> Tensor:
        """Every rank's partial states of the block's columns, merged: the same on every rank.

        ``merged`` is the family's merge of a ``(W, columns, width)`` stack.

        This rank's rows met every column, but only its own rows: the columns' direction (text→image)
        needs every rank's, combined by one small exchange (``W × columns × width`` numbers).

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
        """How many columns with a loss of their own ``owner``'s block holds."""
        return counts[owner]

    def complete_columns(self, state: Tensor, counts: Sequence[int], merged: Merged) -> Tensor:
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
        tensors: gather mode: every rank's column tensors, gathered; ring mode: this rank's own.
        transport: :class:`OneBlock` or :class:`RingBlocks`.
        rows: every rank's number of columns (ring mode's receive buffers).
    """

    tensors: tuple[Tensor, ...]
    transport: Transport
    rows: tuple[int, ...]


def meet(communication: str, layout: Layout, own: Sequence[Tensor], *, per_sample: int = 1) -> Columns:
    """Set up the columns of ``own`` (this rank's ``n_r`` samples, ``per_sample`` rows each) for a mode.

    ``"gather"`` gathers every rank's ``own`` now (one collective per dtype, with the agreed sizes);
    ``"ring"`` keeps them here and lets the kernel pass them round.

    Shape:
        own: tensors of ``(n_r · per_sample, ...)``; tensors: ``(N · per_sample, ...)`` gathered in
        rank order, or ``own`` as they are.
    """
    rows = tuple(size * per_sample for size in layout.sizes)
    if communication == "gather":
        gathered = gather_agreed(own, layout._replace(sizes=rows))
        return Columns(gathered.tensors, OneBlock(layout.offset * per_sample, layout.rank, layout.group), rows)
    ring = Ring(layout.rank, layout.world_size, rows, layout.group)
    return Columns(tuple(own), RingBlocks(ring), rows)
