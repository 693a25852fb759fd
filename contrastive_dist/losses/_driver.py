"""The one block driver: a loss's rows against every column they meet, visit by visit, in two passes.

Every loss here is a sum over rows of a function of one row's logits ``l_ij = s · q_i·k_j (+ b)``
against many columns, and a visit's logit gradient ``G = ∂(Σ w ℓ)/∂l`` gives every input's gradient by
two products (:mod:`._visit`). The driver runs that once, for every loss, transport and epilogue:

* **what a rank meets**: the transport's blocks (:mod:`._transports`: gather mode's one block of every
  column, ring mode's one per hop, then the columns held here), each cut into chunks of rows; or, for a
  Gram loss, the pairs of tiles of its symmetric matrix (:mod:`._tiles`). Each is a visit: rows against
  columns and, for a symmetric loss, the leading columns seen as rows, from the same logits;
* **two passes**: the *states* pass merges each visit's partial states; the *gradients* pass forms each
  visit's ``G`` from the final states, then its products. Where the rows' states are final after their
  visit (gather mode's one block; SigLIP, whose ``G`` needs no state) and no column waits for the other
  ranks' rows, one pass does both: three products a block, the floor; a gather-mode call may keep its
  logits between the passes (:func:`_keeps`);
* **when** ``G`` **is formed**: in forward for a weighted sum (:func:`weighted_sum`: backward scales what was
  formed), in backward for per-row values (:func:`per_row`: the upstream gradients weigh the rows). Ring
  mode's softmax sums take the second: formed in forward, their blocks would go round twice and their
  gradients, the size of the features, would wait for backward;
* **the epilogue**: eager, or fused on CUDA (:func:`~._epilogue.epilogue_for`, once per call).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses import _tiles
from contrastive_dist.losses._autograd import distinct_input, first_order_only, wanted_gradients
from contrastive_dist.losses._epilogue import Eager, epilogue_for
from contrastive_dist.losses._families import Family
from contrastive_dist.losses._targets import RowTargets
from contrastive_dist.losses._transports import BLOCK_LOGITS, LOCAL, Columns, OneBlock, chunks
from contrastive_dist.losses._visit import Grads, Kept, block_visits, gradients_of, inner, states_of

__all__ = ["Problem", "per_row", "weighted_sum"]


class Problem(NamedTuple):
    """What one call of the driver computes, besides its differentiated tensors.

    Attributes:
        family: the rows' loss family (:mod:`._families`).
        rows: where the rows' positives and excluded columns sit in their own rank's block, their keys.
        columns: what the rows meet (:class:`~._transports.Columns`; the driver's ``keys`` are its features).
        chunk: rows per visit; ``None``: chosen from the shapes (:func:`~._transports.chunks`).
        tiles: a Gram loss (its rows are its own block of the columns): every row's targets, in the
            columns' order, for its pairs of tiles where they pay (:func:`._tiles.taken`); else ``None``.
    """

    family: Family
    rows: RowTargets
    columns: Columns
    chunk: int | None
    tiles: RowTargets | None = None


def weighted_sum(queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, problem: Problem,
                 weights: Tensor | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``Σ_i w_i ℓ_i`` over this rank's rows (symmetric: and its own columns), and whether each row has a loss.

    Shape:
        queries: ``(n, D)``; keys: ``(m, D)``, the transport's block; scale, bias: ``()``; weights: ``(n,)``
        (``None``: all 1); outputs: ``()``, ``(n,)``.
    """
    problem = problem if problem.tiles is None else _tiles.taken(problem, queries, keys, bias)
    ring = not isinstance(problem.columns.transport, OneBlock)
    if ring and problem.tiles is None and (not problem.family.stateless or torch.compiler.is_compiling()):
        rows, columns, has = per_row(queries, keys, scale, bias, problem)
        total = rows + columns if problem.columns.own_losses is not None else rows
        return (total.sum() if weights is None else total @ weights), has
    wanted, keys = wanted_gradients(queries, keys, scale, bias), distinct_input(keys, queries)
    return _Formed.apply(queries, keys, scale, bias, problem, weights, wanted)  # type: ignore[no-any-return]


def per_row(queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None,
            problem: Problem) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Each row's ``ℓ_i`` ``(n,)``, this rank's own columns' (symmetric; else empty), and whether each row has one."""
    problem = problem if problem.tiles is None else _tiles.taken(problem, queries, keys, bias)
    wanted, keys = wanted_gradients(queries, keys, scale, bias), distinct_input(keys, queries)
    return _Recomputed.apply(queries, keys, scale, bias, problem, wanted)  # type: ignore[no-any-return]


class _Formed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None,  # type: ignore[override]
                problem: Problem, weights: Tensor | None, wanted: tuple[bool, ...],
                ) -> tuple[Tensor, Tensor]:  # fmt: skip
        run = _Run(problem, queries, keys, scale, bias, in_forward=True)
        grads = run.grads(wanted) if any(wanted) else None
        key_grad = run.states(grads, weights)
        total = sum((run.family.finish(state) @ weights if weights is not None else run.family.finish(state).sum()
                     for state in run.finished()), scale.new_zeros(()))  # fmt: skip
        if grads is not None and not run.one_pass:
            column_weights = problem.columns.weights if problem.columns.weights is not None else 1.0
            key_grad = run.gradients(grads, 1.0 if weights is None else weights, column_weights)
        ctx.save_for_backward(*run.results(grads, key_grad), None if grads is None else grads.bias)
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype, scale.dtype)
        ctx.mark_non_differentiable(has := run.has_positive())
        return total, has

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # The total's gradients, formed in forward, each scaled and cast in one launch (no float32 copy beside them).
        return (*(None if grad is None else torch.mul(grad, grad_total, out=grad.new_empty(grad.shape, dtype=dtype))
                  for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)), None, None, None)  # fmt: skip


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None,  # type: ignore[override]
                problem: Problem, wanted: tuple[bool, ...]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        run = _Run(problem, queries, keys, scale, bias, in_forward=False)
        run.states(None, None)
        ctx.save_for_backward(queries, keys, scale, bias, run.row_state, run.column_state, run.tile_state)
        ctx.problem, ctx.kept, ctx.wanted = problem, run.kept, wanted
        ctx.mark_non_differentiable(has := run.has_positive())
        rows, columns = (problem.family.finish(state) for state in run.finished(own_columns=True))
        return rows, columns, has

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, row_grad: Tensor, column_grad: Tensor, _: Tensor
    ) -> tuple[Tensor | None, ...]:
        queries, keys, scale, bias, row_state, column_state, tile_state = ctx.saved_tensors
        run = _Run(ctx.problem, queries, keys, scale, bias, in_forward=False)
        run.row_state, run.column_state, run.tile_state, run.kept = row_state, column_state, tile_state, ctx.kept
        ctx.kept = None  # used up below
        column_weights: Tensor | float = 1.0
        if run.symmetric:  # every column's upstream gradient where it is met (gather: every rank's, gathered)
            column_weights = run.transport.block_columns(column_grad.to(column_state.dtype), run.own_losses)
        grads = run.grads(ctx.wanted)
        # The rows' weights contiguous once, not a copy a visit: an upstream gradient is often an expanded one.
        key_grad = run.gradients(grads, row_grad.to(row_state.dtype).contiguous(), column_weights)
        query_grad, key_grad, scale_grad = run.results(grads, key_grad)
        as_input = (None if grad is None else grad.to(like.dtype) for grad, like in ((query_grad, queries),
                                                                                   (key_grad, keys)))  # fmt: skip
        return (*as_input, scale_grad, grads.bias, None, None)


class _Run:
    """One call's passes: its inputs, epilogue and states, and what it keeps between the passes."""

    def __init__(self, problem: Problem, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, *,
                 in_forward: bool) -> None:  # fmt: skip
        self.problem, self.queries, self.keys, self.scale, self.in_forward = problem, queries, keys, scale, in_forward
        self.family, self.columns, self.transport = problem.family, problem.columns, problem.columns.transport
        self.epilogue = epilogue_for(problem.family, queries, keys, scale, bias)
        self.ring, self.own_losses = not isinstance(self.transport, OneBlock), problem.columns.own_losses or ()
        self.symmetric = problem.columns.own_losses is not None
        self.rows_final = not self.ring and problem.tiles is None  # a row's state is final after its one visit
        self.one_pass = in_forward and (self.rows_final or self.family.stateless) and not self.symmetric
        self.row_state, self.column_state = (self.family.empty_state(rows, scale) for rows in (queries.shape[0], 0))
        self.kept: list[Kept] | None = None
        self.tile_state: Tensor | None = None  # a Gram loss in gather mode: every row's final state
        self.tile_scale: Tensor | None = None  # a Gram loss: the scale's gradient, unscaled
        local = self.columns.local  # the columns held here: gather mode meets them in its one block
        self.local = () if local is None else tuple(t for t in (local[0].to(keys.dtype), local[1]) if t is not None)
        self.block_keys = torch.cat((keys, self.local[0])) if self.local and not self.ring else keys

    def grads(self, wanted: tuple[bool, ...]) -> Grads:
        """Fresh accumulators for the gradients ``wanted`` (of queries, keys, scale, bias), in the core's dtype."""
        tiles = self.problem.tiles is not None  # a Gram loss's rows are its columns: one gradient, the keys'
        want_query, want_scale = wanted[0] and not tiles, wanted[2] and not tiles
        query = torch.zeros_like(self.queries, dtype=self.scale.dtype) if want_query or want_scale else None
        bias = self.scale.new_zeros(()) if wanted[3] else None
        return Grads(query, bias, want_query, want_scale, wanted[1] or tiles, [])

    def finished(self, *, own_columns: bool = False) -> list[Tensor]:
        """The final states whose values a call returns: the rows' and (symmetric) its own columns'."""
        if not self.symmetric and not own_columns:
            return [self.row_state]
        own = self.transport.own_columns(self.column_state, self.own_losses) if self.symmetric else self.column_state
        return [self.row_state, own]

    def has_positive(self) -> Tensor:
        # No rows: plain zeros (derived from the empty state, they hung a compiled graph: SupCon, (3, 0)).
        if self.queries.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.queries.device)
        return self.family.has_positive(self.row_state)

    def results(self, grads: Grads | None, key_grad: Tensor | None) -> tuple[Tensor | None, ...]:
        """The queries', the keys' own and the scale's gradients, each scaled once."""
        if grads is None:
            return None, None, None
        if grads.sums and grads.bias is not None:  # the fused epilogue's row sums of G, added in one launch
            grads.bias.add_((grads.sums[0] if len(grads.sums) == 1 else torch.cat(grads.sums)).sum())
        query_grad, scale_grad = grads.query, self.tile_scale
        if query_grad is not None and grads.want_scale:
            scale_grad = inner(self.queries, query_grad)  # Σ Q ⊙ (Σ G K), before the scale
        query_grad = query_grad.mul_(self.scale) if query_grad is not None and grads.want_query else None
        if key_grad is not None and grads.want_key:
            key_grad = key_grad.mul_(self.scale)[: self.keys.shape[0]]  # (the columns held here take none)
        return query_grad, key_grad if grads.want_key else None, scale_grad

    def new_key_grad(self, owner: int, after: Tensor | None = None) -> Tensor:
        """A block's keys' gradient: zeros, and in backward an empty sum of ``after``, the upstream gradient."""
        # (That dependence kept a rank without rows from having this exchange moved into a compiled forward: HCL.)
        rows = self.block_keys.shape[0] if owner < 0 else self.columns.counts[owner]
        zeros = self.scale.new_zeros((rows, self.keys.shape[1]))
        return zeros if after is None else zeros.add_(after[:0].sum().to(zeros.dtype))

    def states(self, grads: Grads | None, weights: Tensor | None) -> Tensor | None:
        """Pass 1: every row's final state (symmetric: the own columns' too).

        In one pass (:attr:`one_pass`, with ``grads``), ``G`` and its products too: then the keys' gradient
        is returned.
        """
        if self.problem.tiles is not None:
            self.row_state = _tiles.states(self, _keeps(self, grads is not None))
            return None
        family, one_pass = self.family, grads is not None and self.one_pass
        self.kept = [] if not one_pass and _keeps(self, grads is not None) else None

        def visit(owner: int, block: tuple[Tensor, ...], accumulator: Tensor | None) -> None:
            column_state = accumulator if self.symmetric else None
            key_grad = accumulator if one_pass else None
            parts = [states_of(self.epilogue, one, grads if one_pass else None, self.kept)
                     for one in block_visits(self, owner, block, column_state, grads, key_grad, weights)]
            if not parts:
                return
            # Each visit's partial states joined once a block: a merge is a dozen small launches.
            rows = parts[0][0] if len(parts) == 1 else torch.cat([part[0] for part in parts])
            if self.ring or owner == LOCAL:
                family.merge_(self.row_state, rows)
            else:
                self.row_state = rows.to(self.row_state.dtype)
            columns = [part[1] for part in parts if part[1] is not None]
            if column_state is not None and columns:
                merged = family.merged(torch.stack(columns)) if len(columns) > 1 else columns[0]
                family.merge_(column_state, merged) if self.ring else column_state.copy_(merged)

        new_accumulator: Any = self.new_key_grad if one_pass and grads is not None and grads.want_key else None
        if self.symmetric:
            new_accumulator = lambda owner: family.empty_state(  # noqa: E731
                self.transport.columns_in(owner, self.own_losses), self.scale)
        merge = family.merge_ if self.symmetric else torch.Tensor.add_
        result = self.transport.run(self._block(), self._block_rows(), visit, new_accumulator, merge)
        if self.ring and self.local:
            visit(LOCAL, self.local, None)
        if self.symmetric and result is not None:
            self.column_state = self.transport.complete(result, self.own_losses, family.merged)
        return result if one_pass else None

    def gradients(self, grads: Grads, row_weights: Tensor | float, column_weights: Tensor | float) -> Tensor | None:
        """Pass 2: every visit's ``G`` from the final states, then its products; returns the keys' gradient."""
        if self.problem.tiles is not None:
            return _tiles.gradients(self, grads, row_weights)
        kept, weights = iter(self.kept or ()), row_weights if isinstance(row_weights, Tensor) else None

        def visit(owner: int, block: tuple[Tensor, ...], key_grad: Tensor | None) -> None:
            for one in block_visits(self, owner, block, None, grads, key_grad, weights, column_weights):
                gradients_of(self.epilogue, one, grads, next(kept, None))

        block, rows = self._block(), self._block_rows()
        if self.symmetric and self.ring:  # the own columns' final states and weights travel with their block
            upstream = torch.as_tensor(column_weights).to(self.column_state).expand(self.column_state.shape[0])
            block = (*block, torch.cat((self.column_state, upstream[:, None]), dim=1))
            rows = [*rows, self.own_losses]
        after = row_weights if isinstance(row_weights, Tensor) else None
        new_key_grad = functools.partial(self.new_key_grad, after=after) if grads.want_key else None
        home = self.transport.run(block, rows, visit, new_key_grad)
        if self.ring and self.local:
            visit(LOCAL, self.local, None)
        return home

    def _block(self) -> tuple[Tensor, ...]:
        keys = self.columns.keys
        if keys is not None and not self.ring and len(self.local) > 1:
            keys = torch.cat((keys, self.local[1].to(keys.dtype)))
        return (self.block_keys,) if keys is None else (self.block_keys, keys)

    def _block_rows(self) -> list[tuple[int, ...]]:
        return [self.columns.counts] + ([self.columns.key_counts] if self.columns.keys is not None else [])


def _keeps(run: _Run, in_forward: bool) -> bool:
    """Whether a call keeps its visits between the passes instead of forming their logits again.

    Gather mode with ``chunk_size=None``, not under ``torch.compile``: a weighted sum whose one block is one
    visit (it holds its logits then anyway); per-row values on the eager epilogue whose logits, both
    directions', fit :data:`~._transports.BLOCK_LOGITS`; a Gram loss's pairs, both sides, the same. Never
    ring mode, whose memory would then grow with the number of ranks (measured: keeping took ring mode's CLIP
    loss 0.8× the time and 1.6–2.8× the memory per rank at W = 2 and 4); never the fused epilogue's
    numerators (~57 bytes per logit of memory traffic, SigLIP bf16, ``tests/test_traffic.py``, against ~13).
    """
    if run.problem.chunk is not None or run.ring or torch.compiler.is_compiling():
        return False
    columns, rows = run.block_keys.shape[0], run.queries.shape[0]
    if run.problem.tiles is not None:
        return in_forward and 2 * _tiles.area(run) <= BLOCK_LOGITS
    if in_forward:
        return len(chunks(rows, None, columns, run.queries, run.symmetric)) == 1
    directions = 2 if run.symmetric else 1
    return isinstance(run.epilogue, Eager) and directions * max(rows, *run.columns.counts) * columns <= BLOCK_LOGITS
