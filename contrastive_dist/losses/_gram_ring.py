"""Gram losses (NT-Xent, SupCon, DCL) in ring mode: each pair of tiles formed once, as the blocks go round.

The pairs are :mod:`._gram`'s, and so is what a pair gives (:func:`._gram.sides_of`,
:func:`._gram.pair_gradient`); only where the columns are differs. At ring step ``k`` a rank holds the
block of the rank ``k`` ahead of it (:mod:`contrastive_dist.engine._ring`), and :func:`._gram.tiles`
gives a pair across two ranks to the one that precedes the other by at most half the ring: so a rank
forms its pairs in the first half of the ring's steps and nothing in the second (its blocks still pass
through, for the other ranks). The states of the visiting block's rows, and in pass 2 their gradient,
are the ring's travelling accumulator: they come home to their owner with every rank's part, with no
exchange of their own. Two passes round the ring:

1. each formed pair's block gives both of its sides' partial states; each rank's rows' final state is
   its own part merged with the one that came home;
2. the blocks go round again with their rows' final states (and weights); each formed pair's block is
   formed again, ``S = G_AB + G_BAᵀ``, ``dZ_A += S Z_B`` here and ``dZ_B += Sᵀ Z_A`` into the accumulator.

Each rank forms about half of its ``n_r × N`` row block where the rows-against-columns ring
(:mod:`._recomputed`) forms all of it, twice: half the products (four per pair, on half the pairs).
Memory: one pair at a time (:data:`RING_TILE_LOGITS`), two blocks of features and a travelling accumulator:
independent of the number of ranks, as ring mode promises. Where it measured faster (:func:`._gram.worth_it`).
The weighted sum forms its gradients in forward (:func:`gram_ring_pair_sum`); per-row losses go round a
third time in backward, with the upstream gradients as the rows' weights (:func:`gram_ring_rows`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block
from contrastive_dist.losses._columns import RingBlocks
from contrastive_dist.losses._gram import GramFunction, Side, Tile, TileKeys, pair_gradient, sides_of, tile_size, tiles
from contrastive_dist.losses._kernel import (
    Grads,
    Pairs,
    accumulate,
    as_input,
    block_logits,
    first_order_only,
    gradients_wanted,
    own_block,
)
from contrastive_dist.losses._precision import upcast

__all__ = ["RING_TILE_LOGITS", "gram_ring_pair_sum", "gram_ring_rows"]

RING_TILE_LOGITS = 2**19
"""The default tile on the CPU in ring mode: 724 × 724 logits, a pair's block and its copy seen transposed
within the 2²⁰ logits of the rows-against-columns ring's default chunk, so that ring mode's memory stays
as it was. Measured (``benchmarks/losses.py --methods ntxent_ring``, n = 2048 per rank, D = 512): peak
56 / 64 MiB at W = 2 / 4 (the rows-against-columns ring: 57 / 65), against 64 / 73 with 2²⁰ logits and
80 / 88 with 2²¹ (gather mode's one-process tile), at the same time within the runs' spread."""


def gram_ring_pair_sum(
    queries: Tensor, keys: Tensor, scale: Tensor, pairs: Pairs, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σ_i w_i ℓ_i`` over this rank's rows of a Gram loss (ring mode), gradients formed in forward.

    ``queries`` and ``keys`` are this rank's own rows (the same vectors: ring mode keeps its columns
    here); :attr:`Pairs.gram` holds the positives and left-out columns of every row of the global
    matrix, the keys travel with their blocks.

    Returns:
        The weighted sum and, per row, whether it has a loss.

    Shape:
        queries, keys: ``(n, D)``; scale: ``()``; weights: ``(n,)``; outputs: ``()``, ``(n,)``.
    """
    wanted = gradients_wanted(queries, keys, scale)
    return _GramRing.apply(queries, keys, scale, pairs, weights, wanted)  # type: ignore[no-any-return]


def gram_ring_rows(queries: Tensor, keys: Tensor, scale: Tensor, pairs: Pairs) -> tuple[Tensor, Tensor]:
    """Each row's loss ``ℓ_i`` of a Gram loss (ring mode), gradients formed in backward.

    As :func:`gram_ring_pair_sum`; backward goes round the ring once more with the upstream gradients as
    the rows' weights (every rank's backward meets it, as for every ring-mode per-row loss).

    Returns:
        The rows' losses and whether each row has a loss. Shape: ``(n,)``, ``(n,)``.
    """
    wanted = gradients_wanted(queries, keys, scale)
    return _GramRingRows.apply(queries, keys, scale, pairs, wanted)  # type: ignore[no-any-return]


class _RankPairs:
    """The pairs of tiles this rank forms, grouped by the rank whose block holds their columns."""

    def __init__(self, pairs: Pairs, keys: Tensor, scale: Tensor) -> None:
        assert isinstance(pairs.transport, RingBlocks) and pairs.gram is not None
        self.pairs, self.keys, self.scale, self.every = pairs, keys, scale, pairs.gram
        self.ring = pairs.transport.ring
        counts = pairs.key_rows
        self.own = own_block(keys, pairs.column_keys)  # this rank's travelling block: its rows and their keys
        self.rows: list[tuple[int, ...]] = [counts] * len(self.own)
        self.starts = tuple(itertools.accumulate(counts, initial=0))
        size = tile_size(pairs.chunk, keys, max(counts, default=0), RING_TILE_LOGITS)
        self.by_owner: dict[int, list[Tile]] = {}
        for tile in tiles(counts, self.ring.rank, size):
            self.by_owner.setdefault(self._owner(tile.columns[0]), []).append(tile)

    def _owner(self, row: int) -> int:
        return next(rank for rank in range(len(self.starts) - 1) if row < self.starts[rank + 1])

    def _local(self, span: tuple[int, int], owner: int) -> slice:
        return slice(span[0] - self.starts[owner], span[1] - self.starts[owner])

    def of_block(self, owner: int, block: Block) -> Iterator[tuple[list[Side], slice, slice]]:
        """Each pair of ``owner``'s block: its sides (logits, then values) and its rows here and in the block."""
        own_keys, block_keys = self.pairs.column_keys, block[1] if self.pairs.column_keys is not None else None
        for tile in self.by_owner.get(owner, ()):
            rows, columns = self._local(tile.rows, self.ring.rank), self._local(tile.columns, owner)
            logits = block_logits(self.keys[rows], block[0][columns], self.scale, None)
            keys: TileKeys = None
            if own_keys is not None and block_keys is not None:
                keys = (own_keys[rows], block_keys[columns])
            yield sides_of(self.every, tile, logits, keys), rows, columns


def _states(rank_pairs: _RankPairs) -> Tensor:
    """Pass 1: this rank's rows' final states, from its pairs and every other rank's (home with their block).

    Shape: ``(n, width)``.
    """
    family, keys, scale, counts = rank_pairs.pairs.family, rank_pairs.keys, rank_pairs.scale, rank_pairs.pairs.key_rows
    state = family.empty_state(keys.shape[0], scale)

    def visit(owner: int, block: Block, travelling: Tensor | None) -> None:
        assert travelling is not None  # the partial states of the block's rows
        for sides, here, there in rank_pairs.of_block(owner, block):
            for side, target in zip(sides, (state[here], travelling[there])[: len(sides)], strict=True):
                partial = family.block_state_(side.values, side.targets, side.targets.positive_mask(side.values))
                family.merge_(target, partial)

    new_state = lambda owner: family.empty_state(counts[owner], scale)  # noqa: E731
    home = rank_pairs.pairs.transport.run(rank_pairs.own, rank_pairs.rows, visit, new_state, family.merge_)
    assert home is not None
    family.merge_(state, home)
    return state


def _gradients(rank_pairs: _RankPairs, state: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """Pass 2: the gradients of ``Σ_i w_i ℓ_i`` (``weights`` of this rank's rows; ``None``: 1) from the final states.

    Returns:
        This rank's rows' gradient, with every rank's part, ``(n, D)``; the scale's, this rank's part ``()``.
    """
    family, keys, scale, counts = rank_pairs.pairs.family, rank_pairs.keys, rank_pairs.scale, rank_pairs.pairs.key_rows
    key_grad = torch.zeros_like(keys, dtype=scale.dtype)  # this rank's rows' Σ S Z, unscaled
    grads = Grads(key_grad, None, True, True)
    own_weights = None if weights is None else weights.to(state.dtype)
    extra = (state,) if own_weights is None else (state, own_weights)  # they travel with the block
    width = len(rank_pairs.own)

    def visit(owner: int, block: Block, travelling: Tensor | None) -> None:
        assert travelling is not None  # the gradient of the block's rows
        block_state = block[width]
        block_weights = block[width + 1] if own_weights is not None else None
        for sides, here, there in rank_pairs.of_block(owner, block):
            finals = [state[here], block_state[there]][: len(sides)]
            every_weight: list[Tensor | float] = [1.0, 1.0]
            if own_weights is not None and block_weights is not None:
                every_weight = [own_weights[here], block_weights[there]]
            pair_grad = pair_gradient(family, sides, finals, every_weight[: len(sides)])
            # A diagonal tile takes G Z_A and Gᵀ Z_A apart, as in gather mode (._gram).
            accumulate(pair_grad, keys[here], block[0][there], here.start, grads, travelling[there])

    new_grad = lambda owner: scale.new_zeros((counts[owner], keys.shape[1]))  # noqa: E731
    rows = rank_pairs.rows + [counts] * len(extra)
    home = rank_pairs.pairs.transport.run((*rank_pairs.own, *extra), rows, visit, new_grad)
    assert home is not None
    # The scale's: Σ ⟨S, Z_A Z_Bᵀ⟩ over this rank's pairs, which is ⟨Z_A, S Z_B⟩: the rows' side here.
    scale_grad = (upcast(keys) * key_grad).sum()
    return key_grad.add_(home).mul_(scale), scale_grad


class _GramRing(GramFunction):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, pairs: Pairs, weights: Tensor | None,
        wanted: tuple[bool, bool, bool],
    ) -> tuple[Tensor, Tensor]:
        rank_pairs = _RankPairs(pairs, keys, scale)
        state = _states(rank_pairs)
        total = pairs.family.finish(state)
        total = total.sum() if weights is None else total @ weights
        key_grad, scale_grad = _gradients(rank_pairs, state, weights) if any(wanted) else (None, None)
        return total, GramFunction.saved(ctx, keys, scale, key_grad, scale_grad, pairs.family.has_positive(state))


class _GramRingRows(torch.autograd.Function):
    """Per-row losses: pass 1 in forward, pass 2 in backward with the upstream gradients as the rows' weights."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, pairs: Pairs, wanted: tuple[bool, bool, bool]
    ) -> tuple[Tensor, Tensor]:
        state = _states(_RankPairs(pairs, keys, scale))
        ctx.save_for_backward(keys, scale, state)
        ctx.pairs, ctx.wanted = pairs, wanted
        has_positive = pairs.family.has_positive(state)
        ctx.mark_non_differentiable(has_positive)
        return pairs.family.finish(state), has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, row_grad: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        keys, scale, state = ctx.saved_tensors
        key_grad, scale_grad = _gradients(_RankPairs(ctx.pairs, keys, scale), state, row_grad)
        want_keys = ctx.wanted[0] or ctx.wanted[1]
        return None, as_input(key_grad, keys) if want_keys else None, scale_grad if ctx.wanted[2] else None, None, None
