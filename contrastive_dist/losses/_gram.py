"""Gram losses (NT-Xent, SupCon, DCL) in gather mode: each pair of tiles of their symmetric matrix formed once.

Ring mode forms the same pairs as its blocks go round (:mod:`._gram_ring`).

Their rows are also their columns: the logit matrix of the global batch ``L = s · Z Zᵀ`` is
symmetric, and its gradient is ``s (G + Gᵀ) Z`` — two products where a rows-against-columns
kernel takes three (the logits, ``G K`` and ``Gᵀ Q``). Here the rows are cut into tiles and each
unordered pair of tiles ``{A, B}`` is formed once, by one rank: its block ``L_AB`` gives the rows
of ``A`` their state over the columns of ``B`` and, read transposed, the rows of ``B`` theirs over
``A``. Every rank's partial states of every row are merged by one exchange (an ``M × 5`` array
each); then each pair's block is formed again, ``S = G_AB + G_BAᵀ`` from the final states, and
``dZ_A += S Z_B``, ``dZ_B += Sᵀ Z_A``. Half the logits, then half again and the gradient's two
halves: two products in all (and one more per diagonal tile, whose ``G`` and ``Gᵀ`` take a product
each, for precision), memory of one tile pair.

Which rank forms a pair: a rank's own pairs (``A ≤ B``) are its own; a pair across ranks ``r`` and
``q`` goes to the one of them that precedes the other by less than half the ring (ranks opposite
each other split their pairs by the tiles' parity), so that every rank forms about the same number.
The gradients of other ranks' rows go home through the gather's reduce-scatter, like every column's.

Used for the weighted sum (:func:`._reduction.mean_over_directions`, gather mode) where it measured
faster than the rows-against-columns kernel (:mod:`._fused`, which stays the reference), see
:func:`worth_it`; not under ``torch.compile``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._columns import OneBlock
from contrastive_dist.losses._kernel import (
    BLOCK_LOGITS,
    CUDA_BLOCK_LOGITS,
    Family,
    Grads,
    Pairs,
    accumulate,
    block_logits,
    first_order_only,
    formed_in_forward,
    gradients_wanted,
    transposed_copy,
)
from contrastive_dist.losses._precision import upcast
from contrastive_dist.losses._targets import RowTargets, Targets, partly_located

__all__ = [
    "GramFunction", "MIN_DIM", "ONE_PROCESS", "RING_MIN_DIM", "Side", "Tile", "TileKeys", "gram_pair_sum",
    "pair_gradient", "sides_of", "tile_size", "tiles", "worth_it",
]


MIN_DIM = 512
"""The smallest feature width that takes the tiles: the products they save grow with it, their extra
passes (each pair's copy seen transposed) do not. Measured (one process, CPU, ``benchmarks/floor.py``
and ``nt_xent`` / ``supcon`` at n = 2048–4096): 0.82–0.87× the rows-against-columns kernel's time at
D = 512, 0.87–1.14× at D = 128 and 256."""
RING_MIN_DIM = 256
"""The same in ring mode (:mod:`._gram_ring`), where the tiles save more (half of every block's products):
measured (``benchmarks/floor.py`` and ``losses.py``, two and four ranks, ``nt_xent`` / ``supcon``): 0.67–0.79× the
rows-against-columns ring's time at D = 512, 0.70–0.93× at D = 256, 0.96–1.11× at D = 128."""
ONE_PROCESS = True
"""Only without other ranks: across ranks the tiles' exchange of states is one more collective in the
middle of the forward, which measured 0.93–1.04× at best and up to 1.6× with more threads than cores
(four ranks of two threads on two cores), a common CPU setup."""


def worth_it(queries: Tensor, keys: Tensor, ranks: int, *, ring: bool = False) -> bool:
    """Whether a Gram loss's blocks of ``keys`` take the tiles (on the CPU: see :data:`MIN_DIM`, :data:`ONE_PROCESS`).

    ``ring``: ring mode (:mod:`._gram_ring`, from :data:`RING_MIN_DIM`), whose pairs need no exchange of their own.

    Example:
        >>> import torch
        >>> worth_it(torch.zeros(8, 512), torch.zeros(8, 512), 1), worth_it(torch.zeros(8, 128), torch.zeros(8, 128), 1)
        (True, False)
        >>> half = torch.zeros(8, 256)
        >>> worth_it(half, half, 1), worth_it(half, half, 4), worth_it(half, half, 4, ring=True)
        (False, False, True)
    """
    if queries.is_cuda or (ONE_PROCESS and ranks > 1 and not ring):
        return False  # (measured on the CPU only)
    return keys.shape[1] >= (RING_MIN_DIM if ring else MIN_DIM)


class Tile(NamedTuple):
    """A pair of tiles ``rows × columns`` of the global matrix (global row ranges ``[start, stop)``)."""

    rows: tuple[int, int]
    columns: tuple[int, int]

    @property
    def diagonal(self) -> bool:
        return self.rows == self.columns


def tiles(counts: tuple[int, ...], rank: int, size: int) -> list[Tile]:
    """The pairs of tiles ``rank`` forms, its own rows' tiles first in each, for ranks of ``counts`` rows.

    Example:
        >>> [(tile.rows, tile.columns) for tile in tiles((4, 2), 0, 2)]  # two ranks: opposite, the pairs split
        [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (2, 4)), ((0, 2), (4, 6))]
        >>> [(tile.rows, tile.columns) for tile in tiles((4, 2), 1, 2)]
        [((4, 6), (4, 6)), ((4, 6), (2, 4))]
    """
    world_size, starts = len(counts), [sum(counts[:r]) for r in range(len(counts))]

    def spans(owner: int) -> list[tuple[int, int]]:
        begin, end = starts[owner], starts[owner] + counts[owner]
        return [(start, min(start + size, end)) for start in range(begin, end, size)]

    own = spans(rank)
    formed = [Tile(a, b) for i, a in enumerate(own) for b in own[i:]]
    for other in range(world_size):
        ahead = (other - rank) % world_size
        if other == rank or 2 * ahead > world_size:
            continue  # the other rank forms these
        for i, a in enumerate(own):
            for j, b in enumerate(spans(other)):
                # Ranks opposite each other split their pairs: the lower rank takes those of even parity.
                if 2 * ahead < world_size or ((i + j) % 2 == 0) == (rank < other):
                    formed.append(Tile(a, b))
    return formed


CPU_TILE_LOGITS = 2**21
"""The default tile on the CPU: 1448 × 1448 logits (8 MiB of float32). Measured with
``benchmarks/floor.py`` (NT-Xent and SupCon, n = 4096): 1.29–1.32 × the floor, against 1.35–1.45 with
1024-row tiles (more tiles, smaller products) and 1.53–1.60 with 2048 or 2896 (tiles out of cache)."""


def tile_size(chunk: int | None, queries: Tensor, columns: int, cpu_budget: int = CPU_TILE_LOGITS) -> int:
    """Rows per tile: a square of the default budget's logits, or the side that keeps its promise with ``chunk_size``.

    A pair's block and its copy seen transposed then hold at most ``chunk_size × columns`` logits together.
    ``cpu_budget``: the default tile's logits on the CPU.

    Example:
        >>> import torch
        >>> tile_size(None, torch.zeros(0), 8192), tile_size(256, torch.zeros(0), 8192)
        (1448, 1024)
    """
    budget = (CUDA_BLOCK_LOGITS if queries.is_cuda else cpu_budget) if chunk is None else chunk * columns // 2
    return max(1, math.isqrt(budget))


TileKeys = tuple[Tensor, Tensor] | None
"""A pair of tiles' keys: its rows' and its columns' (labels, ids), or ``None``."""


def keys_of(every: RowTargets, tile: Tile) -> TileKeys:
    """The keys of a pair of tiles, from every row's (gather mode: the one block holds them all)."""
    keys = every.keys
    return None if keys is None else (keys[slice(*tile.rows)], keys[slice(*tile.columns)])


def tile_targets(every: RowTargets, rows: tuple[int, int], columns: tuple[int, int], keys: TileKeys) -> Targets:
    """Rows ``rows`` of the global matrix against its columns ``columns``, from every row's targets.

    ``keys``: the rows' and the columns' keys (each transport finds them where it holds them).
    """
    (row_start, row_stop), (column_start, column_stop) = rows, columns
    width = column_stop - column_start

    def located(index: Tensor | None) -> Any:
        return None if index is None else partly_located(index[row_start:row_stop] - column_start, width)

    row_keys, column_keys = (None, None) if keys is None else keys
    return Targets(located(every.positive), located(every.excluded), row_keys, column_keys, every.key_rule)


class Side(NamedTuple):
    """One side of a pair of tiles: rows ``span`` against the other tile's columns.

    Attributes:
        span: the rows, ``[start, stop)`` of the global matrix.
        values: their logits, then numerators; a copy seen transposed for the columns' side.
        targets: their targets in this block.
        partial: their state over this block alone, when ``values`` were kept from pass 1 (numerators
            against it); ``None``: ``values`` are logits.
    """

    span: tuple[int, int]
    values: Tensor
    targets: Targets
    partial: Tensor | None = None


def sides_of(every: RowTargets, tile: Tile, logits: Tensor, keys: TileKeys) -> list[Side]:
    """The tile's rows against its columns and, off the diagonal, its columns' rows against its rows.

    The columns' side is a copy seen transposed (:func:`._kernel.transposed_copy`): laid out like the
    logits, so that its gradient adds onto theirs in one plain pass.
    """
    sides = [Side(tile.rows, logits, tile_targets(every, tile.rows, tile.columns, keys))]
    if not tile.diagonal:
        swapped = None if keys is None else (keys[1], keys[0])
        sides.append(Side(tile.columns, transposed_copy(logits), tile_targets(every, tile.columns, tile.rows, swapped)))
    return sides


def gram_pair_sum(
    queries: Tensor, keys: Tensor, scale: Tensor, pairs: Pairs, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σ_i w_i ℓ_i`` over this rank's rows of a Gram loss (gather mode), gradients formed in forward.

    ``queries`` are this rank's own block of ``keys`` (the same vectors); :attr:`Pairs.gram` holds the
    targets of every row of the global matrix.

    Returns:
        The weighted sum and, per row, whether it has a loss.

    Shape:
        queries: ``(n, D)``; keys: ``(M, D)``; scale: ``()``; weights: ``(n,)``; outputs: ``()``, ``(n,)``.
    """
    wanted = gradients_wanted(queries, keys, scale)
    return _Gram.apply(queries, keys, scale, pairs, weights, wanted)  # type: ignore[no-any-return]


class GramFunction(torch.autograd.Function):
    """A Gram kernel whose gradients (the keys' and the scale's) are formed in forward, saved, scaled in backward.

    Its arguments: ``(queries, keys, scale, pairs, weights, wanted)``; its outputs ``(total, has_positive)``.
    """

    @staticmethod
    def saved(
        ctx: Any, keys: Tensor, scale: Tensor, key_grad: Tensor | None, scale_grad: Tensor | None, has_positive: Tensor
    ) -> Tensor:
        """Keep the gradients for backward; return ``has_positive``, marked not differentiable."""
        ctx.save_for_backward(key_grad, scale_grad)
        ctx.dtypes = (keys.dtype, scale.dtype)
        ctx.mark_non_differentiable(has_positive)
        return has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        key_grad, scale_grad = formed_in_forward(ctx, grad_total)
        return None, key_grad, scale_grad, None, None, None


class _Gram(GramFunction):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, pairs: Pairs, weights: Tensor | None,
        wanted: tuple[bool, bool, bool],
    ) -> tuple[Tensor, Tensor]:
        family, transport, every = pairs.family, pairs.transport, pairs.gram
        assert every is not None and isinstance(transport, OneBlock)
        counts = pairs.key_rows
        formed = tiles(counts, transport.rank, tile_size(pairs.chunk, queries, keys.shape[0]))
        # Keeping every pair's numerators for pass 2 spares forming them again, when they fit the default
        # budget (an explicit chunk_size promises at most chunk_size × N logits at once).
        area = sum((tile.rows[1] - tile.rows[0]) * (tile.columns[1] - tile.columns[0]) for tile in formed)
        keep = any(wanted) and pairs.chunk is None and 2 * area <= BLOCK_LOGITS
        def logits_of(tile: Tile) -> Tensor:
            return block_logits(keys[slice(*tile.rows)], keys[slice(*tile.columns)], scale, None)

        # Pass 1: every row's partial state over the pairs this rank forms, merged over the ranks.
        state = family.empty_state(keys.shape[0], scale)
        kept: list[list[Side]] = []
        for tile in formed:
            sides = []
            for side in sides_of(every, tile, logits_of(tile), keys_of(every, tile)):
                partial = family.block_state_(side.values, side.targets, side.targets.positive_mask(side.values))
                family.merge_(state[slice(*side.span)], partial)
                sides.append(side._replace(partial=partial))
            if keep:
                kept.append(sides)
        state = transport.complete_columns(state, counts, family.merged)
        own_state = state[transport.own_start : transport.own_start + queries.shape[0]]
        total = family.finish(own_state)
        total = total.sum() if weights is None else total @ weights

        key_grad = scale_grad = None
        if any(wanted):
            every_weight = 1.0 if weights is None else transport.block_columns(weights.to(state.dtype), counts)
            # Pass 2: each pair's S from the final states, and its products.
            key_grad = torch.zeros_like(keys, dtype=scale.dtype)  # Σ S Z, unscaled
            grads = Grads(key_grad, None, True, True)  # the rows' products add into the keys' gradient too
            for index, tile in enumerate(formed):
                sides = kept[index] if keep else sides_of(every, tile, logits_of(tile), keys_of(every, tile))
                finals = [state[slice(*side.span)] for side in sides]
                weights_of = [every_weight if isinstance(every_weight, float) else every_weight[slice(*side.span)]
                              for side in sides]  # fmt: skip
                pair_grad = pair_gradient(family, sides, finals, weights_of)
                rows, columns = keys[slice(*tile.rows)], keys[slice(*tile.columns)]
                # A diagonal tile takes G Z_A and Gᵀ Z_A apart: summed first, G + Gᵀ rounds the terms of a
                # pair of positives that cancel (benchmarks/precision.py: gradients 10–30 % less precise).
                accumulate(pair_grad, rows, columns, tile.rows[0], grads, key_grad[slice(*tile.columns)])
            # The scale's: ⟨Z, Σ S Z⟩ over this rank's pairs holds each of their logits' ⟨G, P⟩ twice.
            scale_grad = 0.5 * (upcast(keys) * key_grad).sum()
            key_grad.mul_(scale)
        return total, GramFunction.saved(ctx, keys, scale, key_grad, scale_grad, family.has_positive(own_state))


def pair_gradient(
    family: Family, sides: list[Side], finals: list[Tensor], weights: list[Tensor | float]
) -> Tensor:
    """``S`` of a pair of tiles: ``G_AB + G_BAᵀ``, or ``G_AA`` on the diagonal.

    ``finals``, ``weights``: each side's rows' final states and weights (a number: the same for all).
    """
    pair_grad = None
    for side, final, row_weights in zip(sides, finals, weights, strict=True):
        mask = side.targets.positive_mask(side.values)
        if side.partial is None:
            family.numerators_(side.values, final, side.targets, mask)
        else:
            family.rebase_(side.values, side.partial, final)
        half = family.gradient_(side.values, final, side.targets, mask, row_weights)
        pair_grad = half if pair_grad is None else pair_grad.add_(half.T)
    assert pair_grad is not None
    return pair_grad
