"""Gram losses (NT-Xent, SupCon, DCL, HCL): each pair of tiles of their symmetric matrix formed once.

Their rows are also their columns: the logit matrix of the global batch ``L = s · Z Zᵀ`` is symmetric,
and its gradient is ``s (G + Gᵀ) Z`` — two products where rows against columns take three. The rows
are cut into tiles and each unordered pair of tiles ``{A, B}`` is one visit of the driver, formed by
one rank: its block ``L_AB`` gives the rows of ``A`` their state over the columns of ``B`` and, read
transposed (its column side), the rows of ``B`` theirs over ``A``; in the gradients pass
``S = G_AB + G_BAᵀ``, ``dZ_A += S Z_B``, ``dZ_B += Sᵀ Z_A`` (a diagonal tile takes ``G Z_A`` and
``Gᵀ Z_A`` apart: summed first, ``G + Gᵀ`` rounds the terms of a pair of positives that cancel,
``benchmarks/precision.py``: gradients 10–30 % less precise). Half the logits, formed twice: two
products in all, and the memory of one pair of tiles.

Which rank forms a pair: a rank's own pairs (``A ≤ B``) are its own; a pair across ranks ``r`` and
``q`` goes to the one of them that precedes the other by less than half the ring (ranks opposite each
other split their pairs by the tiles' parity), so every rank forms about as many. Gather mode: every
rank's partial states of every row are merged by one exchange, and the gradients of other ranks' rows
go home through the gather's reduce-scatter. Ring mode: at step ``k`` a rank holds the block of the rank
``k`` ahead (:mod:`contrastive_dist.engine._ring`), so it forms its pairs in the first half of the ring's
steps; the visiting block's rows' states, and in the second pass their gradient, are the ring's
travelling accumulator, home with every rank's part; the final states and weights travel with the blocks.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._options import upcast
from contrastive_dist.losses._targets import Indices, RowTargets
from contrastive_dist.losses._transports import CUDA_BLOCK_LOGITS, EVERY_RANK, OneBlock
from contrastive_dist.losses._visit import Grads, Side, Visit, gradients_of, states_of

if TYPE_CHECKING:
    from contrastive_dist.losses._driver import Problem, _Run

__all__ = ["MIN_DIM", "ONE_PROCESS", "RING_MIN_DIM", "Tile", "area", "gradients", "states",
           "taken", "tile_size", "tiles", "worth_it"]  # fmt: skip

MIN_DIM = 512
"""The smallest feature width that takes the tiles: the products they save grow with it, their extra
passes (each pair's copy seen transposed) do not. Measured (one process, CPU, ``benchmarks/floor.py``
and ``nt_xent`` / ``supcon`` at n = 2048–4096): 0.82–0.87× the rows-against-columns time at D = 512,
0.87–1.14× at D = 128 and 256."""
RING_MIN_DIM = 256
"""The same in ring mode, where the tiles save more (half of every block's products): measured
(``benchmarks/floor.py`` and ``losses.py``, two and four ranks, ``nt_xent`` / ``supcon``): 0.67–0.79× the
rows-against-columns ring's time at D = 512, 0.70–0.93× at D = 256, 0.96–1.11× at D = 128."""
ONE_PROCESS = True
"""Gather mode's tiles only without other ranks: across ranks their exchange of states is one more
collective in the middle of the forward, which measured 0.93–1.04× at best and up to 1.6× with more
threads than cores (four ranks of two threads on two cores), a common CPU setup."""
CPU_TILE_LOGITS = 2**21
"""The default tile on the CPU: 1448 × 1448 logits (8 MiB of float32). Measured (``benchmarks/floor.py``,
NT-Xent and SupCon, n = 4096): 1.29–1.32 × the floor, against 1.35–1.45 with 1024-row tiles and
1.53–1.60 with 2048 or 2896 (tiles out of cache)."""
RING_TILE_LOGITS = 2**19
"""Ring mode's default tile on the CPU: 724 × 724 logits, a pair's block and its transposed copy within
the rows-against-columns ring's default chunk, so ring mode's memory stays as it was (measured,
``benchmarks/losses.py --methods ntxent_ring``, n = 2048 a rank, D = 512: peak 56 / 64 MiB at W = 2 / 4
against 57 / 65 rows against columns, at the same time within the runs' spread)."""


def worth_it(queries: Tensor, keys: Tensor, ranks: int, *, ring: bool = False) -> bool:
    """Whether a Gram loss's blocks of ``keys`` take the tiles (on the CPU: see :data:`MIN_DIM`, :data:`ONE_PROCESS`).

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


def taken(problem: Problem, queries: Tensor, keys: Tensor, bias: Tensor | None) -> Problem:
    """``problem`` with its tiles where they pay, else without.

    Where measured faster (:func:`worth_it`), not under ``torch.compile``, with no columns held here and no
    bias; in ring mode the rows must be their own block of the columns (the same tensor).
    """
    ring = not isinstance(problem.columns.transport, OneBlock)
    fits = problem.columns.local is None and bias is None and (queries is keys or not ring)
    if fits and worth_it(queries, keys, len(problem.columns.counts), ring=ring) and not torch.compiler.is_compiling():
        return problem
    return problem._replace(tiles=None)


class Tile(NamedTuple):
    """A pair of tiles ``rows × columns`` of the global matrix (global row ranges ``[start, stop)``)."""

    rows: tuple[int, int]
    columns: tuple[int, int]


def tiles(counts: tuple[int, ...], rank: int, size: int) -> list[Tile]:
    """The pairs of tiles ``rank`` forms, its own rows' tiles first in each, for ranks of ``counts`` rows.

    Example:
        >>> [(tile.rows, tile.columns) for tile in tiles((4, 2), 0, 2)]  # two ranks: opposite, the pairs split
        [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (2, 4)), ((0, 2), (4, 6))]
        >>> [(tile.rows, tile.columns) for tile in tiles((4, 2), 1, 2)]
        [((4, 6), (4, 6)), ((4, 6), (2, 4))]
    """
    world_size, starts = len(counts), list(itertools.accumulate(counts, initial=0))

    def spans(owner: int) -> list[tuple[int, int]]:
        begin, end = starts[owner], starts[owner + 1]
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


def tile_size(chunk: int | None, queries: Tensor, columns: int, cpu_budget: int = CPU_TILE_LOGITS) -> int:
    """Rows per tile: a square of the default budget's logits, or the side that keeps ``chunk_size``'s promise.

    With ``chunk_size``, a pair's block and its transposed copy hold at most ``chunk_size × columns`` logits.

    Example:
        >>> import torch
        >>> tile_size(None, torch.zeros(0), 8192), tile_size(256, torch.zeros(0), 8192)
        (1448, 1024)
    """
    budget = (CUDA_BLOCK_LOGITS if queries.is_cuda else cpu_budget) if chunk is None else chunk * columns // 2
    return max(1, math.isqrt(budget))


class _Plan(NamedTuple):
    """The pairs a rank forms, by the rank whose block holds their columns, and where each rank's rows start."""

    by_owner: dict[int, list[Tile]]
    starts: tuple[int, ...]
    every: RowTargets


def _plan(run: _Run) -> _Plan:
    counts, rank = run.columns.counts, run.transport.rank
    starts = tuple(itertools.accumulate(counts, initial=0))
    size = tile_size(run.problem.chunk, run.keys, max(counts, default=0) if run.ring else run.keys.shape[0],
                     RING_TILE_LOGITS if run.ring else CPU_TILE_LOGITS)  # fmt: skip
    by_owner: dict[int, list[Tile]] = {}
    for tile in tiles(counts, rank, size):
        owner = -1 if not run.ring else next(r for r in range(len(counts)) if tile.columns[0] < starts[r + 1])
        by_owner.setdefault(owner, []).append(tile)
    assert run.problem.tiles is not None
    return _Plan(by_owner, starts, run.problem.tiles)


def area(run: _Run) -> int:
    """The logits of every pair this rank forms."""
    pairs = [tile for formed in _plan(run).by_owner.values() for tile in formed]
    return sum((tile.rows[1] - tile.rows[0]) * (tile.columns[1] - tile.columns[0]) for tile in pairs)


def _visits(run: _Run, plan: _Plan, owner: int, block: tuple[Tensor, ...], states: tuple[Tensor, Tensor],
            weights: tuple[Tensor | float, Tensor | float], grads: tuple[Tensor | None, Tensor | None],
            ) -> list[Visit]:  # fmt: skip
    """The pairs of ``owner``'s block (gather: of the whole matrix), each a visit.

    ``states``, ``weights``, ``grads``: where the rows' states, weights and gradients are, ``(this rank's
    rows', the block's rows')`` (gather: the whole matrix's, twice).
    """
    every, rank = plan.every, run.transport.rank
    here, there = (plan.starts[rank], plan.starts[owner]) if run.ring else (0, 0)
    keys = (run.columns.keys, block[1] if len(block) > 1 and run.columns.keys is not None else None)
    out = []
    for tile in plan.by_owner.get(owner, ()):
        a = slice(tile.rows[0] - here, tile.rows[1] - here)
        b = slice(tile.columns[0] - there, tile.columns[1] - there)

        def side(rows: tuple[int, int], columns: tuple[int, int], mine: slice, theirs: slice, first: int) -> Side:
            own_keys, other_keys = keys if first == 0 else keys[::-1]
            index = (every.positive, every.excluded)
            positive, excluded = (None if i is None else i[rows[0] : rows[1]] for i in index)
            row_keys = None if own_keys is None else own_keys[mine]
            column_keys = None if other_keys is None else other_keys[theirs]
            indices = Indices(positive, excluded, row_keys, column_keys, every.key_rule, columns[0],
                              columns[1] - columns[0], inside=False)  # fmt: skip
            weight = weights[first]
            return Side(indices, states[first][mine], weight if isinstance(weight, float) else weight[mine])

        rows_side = side(tile.rows, tile.columns, a, b, 0)
        column_side = None if tile.rows == tile.columns else side(tile.columns, tile.rows, b, a, 1)
        query_grad, key_grad = (None if g is None else g[s] for g, s in zip(grads, (a, b), strict=True))
        features = (run.keys if run.ring else block[0], block[0])
        out.append(Visit(features[0][a], features[1][b], rows_side, column_side, query_grad, key_grad))
    return out


def states(run: _Run, keep: bool) -> Tensor:
    """Pass 1: this rank's rows' final states (gather mode: every row's, kept for pass 2)."""
    family, plan, scale = run.family, _plan(run), run.scale
    run.kept = [] if keep else None
    counts = run.columns.counts
    own = family.empty_state(counts[run.transport.rank] if run.ring else run.keys.shape[0], scale)

    def visit(owner: int, block: tuple[Tensor, ...], travelling: Tensor | None) -> None:
        others = own if travelling is None else travelling
        for one in _visits(run, plan, owner, block, (own, others), (1.0, 1.0), (None, None)):
            rows, columns = states_of(run.epilogue, one, None, run.kept)
            family.merge_(one.rows.state, rows)
            if one.columns is not None and columns is not None:
                family.merge_(one.columns.state, columns)

    block = (run.keys,) if run.columns.keys is None else (run.keys, run.columns.keys)
    rows = [counts] * len(block)
    new_state = (lambda owner: family.empty_state(counts[owner], scale)) if run.ring else None  # noqa: E731
    home = run.transport.run(block, rows, visit, new_state, family.merge_)
    if run.ring:
        assert home is not None
        family.merge_(own, home)
        return own
    run.tile_state = run.transport.complete(own, counts, family.merged)
    start = run.transport.own_start_of(EVERY_RANK) or 0
    return run.tile_state[start : start + run.queries.shape[0]]


def gradients(run: _Run, grads: Grads, row_weights: Tensor | float) -> Tensor:
    """Pass 2: each pair's ``S`` from the final states and its products; the keys' gradient, unscaled.

    Sets ``run.tile_scale``, the scale's gradient (:func:`scale_gradient`).
    """
    plan, counts, kept = _plan(run), run.columns.counts, iter(run.kept or ())
    key_grad = torch.zeros_like(run.keys, dtype=run.scale.dtype)  # Σ S Z (ring: this rank's rows', its own part)
    if not run.ring:
        every_weight = row_weights if isinstance(row_weights, float) else run.transport.block_columns(
            row_weights, counts)  # fmt: skip
        assert run.tile_state is not None
        block = (run.keys,) + ((run.columns.keys,) if run.columns.keys is not None else ())
        for one in _visits(run, plan, -1, block, (run.tile_state, run.tile_state), (every_weight, every_weight),
                           (key_grad, key_grad)):  # fmt: skip
            gradients_of(run.epilogue, one, grads, next(kept, None))
        # ⟨Z, Σ S Z⟩ over this rank's pairs holds each of their logits' terms twice: the rows' side and the columns'.
        run.tile_scale = 0.5 * (upcast(run.keys) * key_grad).sum()
        return key_grad
    own_weights = None if isinstance(row_weights, float) else row_weights
    extra = (run.row_state,) if own_weights is None else (run.row_state, own_weights)
    base = (run.keys,) if run.columns.keys is None else (run.keys, run.columns.keys)

    def visit(owner: int, block: tuple[Tensor, ...], travelling: Tensor | None) -> None:
        width = len(base)
        block_weights: Tensor | float = 1.0 if own_weights is None else block[width + 1]
        states = (run.row_state, block[width])
        weights = (1.0 if own_weights is None else own_weights, block_weights)
        for one in _visits(run, plan, owner, block[:width], states, weights, (key_grad, travelling)):
            gradients_of(run.epilogue, one, grads, None)

    rows = [counts] * (len(base) + len(extra))
    new_grad = lambda owner: run.scale.new_zeros((counts[owner], run.keys.shape[1]))  # noqa: E731
    home = run.transport.run((*base, *extra), rows, visit, new_grad)
    assert home is not None
    # ⟨Z_here, Σ S Z_there⟩, the rows' side of this rank's pairs, holds each of their logits' terms once.
    run.tile_scale = (upcast(run.keys) * key_grad).sum()
    return key_grad.add_(home)
