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

:func:`columns_of` sets up a call's :class:`Columns` for either; :func:`chunks` says
how many rows meet a block at once.
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

__all__ = [
    "BLOCK_LOGITS", "CUDA_BLOCK_LOGITS", "EVERY_RANK", "LOCAL", "Columns", "OneBlock", "RingBlocks", "Transport",
    "chunks", "columns_of", "meet",
]  # fmt: skip

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

    @property
    def rank(self) -> int:
        """The rank in the ring's group."""
        return self.ring.rank

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
        """The block of this rank as it travels: the features, then their keys."""
        return (self.features,) if self.keys is None else (self.features, self.keys)

    def block_rows(self) -> list[tuple[int, ...]]:
        """Every rank's rows of each tensor of :meth:`block` (ring mode's receive buffers)."""
        return [self.counts] if self.keys is None else [self.counts, self.key_counts]


def meet(communication: str, layout: Layout, own: Sequence[Tensor], *, per_sample: int = 1) -> tuple[Tensor, ...]:
    """The columns ``own`` of this rank (``n_r`` samples, ``per_sample`` rows each) as the mode meets them.

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


def columns_of(communication: str, layout: Layout, features: Tensor, keys: Tensor | None, *, per_sample: int = 1,
               weights: Tensor | None = None) -> Columns:  # fmt: skip
    """The :class:`Columns` of this rank's ``features`` and their ``keys`` (``per_sample`` rows a sample) in a mode.

    ``weights``: one per sample of a symmetric loss, whose columns have losses of their own: gather mode
    meets them with the columns (every rank's), ring mode has them travel in its second pass.
    """
    travelling = weights if communication == "gather" else None
    met = meet(communication, layout, [t for t in (features, keys, travelling) if t is not None], per_sample=per_sample)
    counts = tuple(size * per_sample for size in layout.sizes)
    if communication == "gather":
        transport: Transport = OneBlock(layout.offset * per_sample, layout.rank, layout.group)
    else:
        transport = RingBlocks(Ring(layout.rank, layout.world_size, counts, layout.group))
    return Columns(met[0], met[1] if keys is not None else None, transport, counts, counts,
                   weights=met[-1] if travelling is not None else None)  # fmt: skip


BLOCK_LOGITS = 2**24
"""The default chunk's budget for a block serving both directions of a symmetric loss in one pass off CUDA,
and what a call may keep between the driver's passes: at most this many logits (64 MiB in float32)."""
CUDA_BLOCK_LOGITS = 2**28
"""The default chunk's budget on CUDA: at most this many logits (1 GiB in float32) are formed at once.

Each chunk costs the host about half a millisecond to issue (a dozen launches and their Python), so a
chunk must hold enough work for the GPU to stay ahead of it; measured on an H200 (bfloat16, D = 768,
B = 65,536, ``benchmarks/gpu_check.py``): SigLIP took 137 ms a step in chunks of 256 rows (2²⁴ logits,
host-bound), 55 ms in 1024, 45 ms in 4096 (this budget) and 45 ms in 8192; InfoNCE 300, 88, 82 and 80 ms.
"""
CPU_BLOCK_LOGITS = 2**20
"""The default chunk's budget elsewhere on the CPU (4 MiB of float32 logits), with chunks of at least
:data:`CPU_CHUNK_ROWS` rows: blocks that stay in its caches, rows enough for its matrix products
(measured: ``benchmarks/floor.py``, where 256 rows beat both the whole block and 128 rows)."""
CPU_CHUNK_ROWS = 256


def default_chunk(rows: int, columns: int, budget: int = BLOCK_LOGITS, least: int = 64) -> int:
    """Rows a chunk when ``chunk_size=None``.

    Every row if the block holds at most ``budget`` logits, else the most rows under that, in multiples of
    64, and at least ``least``.

    Example:
        >>> default_chunk(4096, 4096), default_chunk(8192, 65536), default_chunk(10, 0)
        (4096, 256, 10)
        >>> default_chunk(4096, 8192, CPU_BLOCK_LOGITS, CPU_CHUNK_ROWS)
        256
        >>> default_chunk(8192, 65536, CUDA_BLOCK_LOGITS), default_chunk(65536, 131072, CUDA_BLOCK_LOGITS)
        (4096, 2048)
    """
    if rows * columns <= budget:
        return max(rows, 1)
    return max(least, budget // columns // 64 * 64)


def chunks(rows: int, chunk: int | None, columns: int, queries: Tensor, one_pass_symmetric: bool = False
           ) -> list[tuple[int, int]]:  # fmt: skip
    """``(start, stop)`` of each chunk of ``rows`` rows of ``queries`` meeting ``columns`` columns.

    ``chunk``: the caller's ``chunk_size``; ``None``: :func:`default_chunk` with the budget of
    :data:`CUDA_BLOCK_LOGITS` on CUDA; elsewhere :data:`BLOCK_LOGITS` for a symmetric block whose every
    visit serves both directions in one pass (in chunks it would cost a fourth product), else
    :data:`CPU_BLOCK_LOGITS` with at least :data:`CPU_CHUNK_ROWS` rows.

    Example:
        >>> import torch
        >>> chunks(5, 2, 8, torch.zeros(0)), chunks(3, None, 8, torch.zeros(0))
        ([(0, 2), (2, 4), (4, 5)], [(0, 3)])
    """
    if chunk is None:
        if queries.is_cuda:
            chunk = default_chunk(rows, columns, CUDA_BLOCK_LOGITS)
        elif one_pass_symmetric:
            chunk = default_chunk(rows, columns, BLOCK_LOGITS)
        else:
            chunk = default_chunk(rows, columns, CPU_BLOCK_LOGITS, CPU_CHUNK_ROWS)
    return [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]
