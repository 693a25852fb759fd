"""The one block driver: a loss's rows against every column they meet, visit by visit, in two passes.

Every loss here is a sum over rows of a function of one row's logits ``l_ij = s · q_i·k_j (+ b)``
against many columns, and a visit's logit gradient ``G = ∂(Σ w ℓ)/∂l`` gives every input's gradient by
two products (:mod:`._visit`). The driver runs that once, for every loss, transport and epilogue:

* **what a rank meets**: the transport's blocks (:mod:`._transports`: gather mode's one block of every
  column, ring mode's one per hop, then the shared negatives held here), each cut into chunks of rows;
  or, for a Gram loss (rows that are their own columns), the pairs of tiles of its symmetric matrix
  (:mod:`._tiles`). Each chunk or pair is a :class:`~._visit.Visit`: rows against columns and, for a
  symmetric loss (InfoNCE's texts, a pair of tiles), the leading columns seen as rows, from the same logits;
* **two passes**: *states* merges each visit's partial states; *gradients* forms each visit's ``G`` from
  the final states, then its products. Where the rows' states are final after their visit (gather mode's
  one block; SigLIP, whose ``G`` needs no state) and no column waits for the other ranks' rows, one pass
  does both: three products a block, the floor. A gather-mode call may keep its logits between the
  passes instead of forming them again (:func:`_keeps`);
* **when** ``G`` **is formed**: in forward for a weighted sum (:func:`weighted_sum`: the weights are known;
  backward scales what was formed), in backward for per-row values (:func:`per_row`: the upstream
  gradients are the rows' weights). Ring mode's softmax sums take the second: in forward their blocks
  would go round twice and keep gradients the size of the features until backward;
* **the epilogue** a product goes through: eager, or the fused Triton ops on CUDA
  (:func:`~._visit.epilogue_for`, once per call).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses import _tiles
from contrastive_dist.losses._families import Family
from contrastive_dist.losses._targets import Indices, RowTargets
from contrastive_dist.losses._transports import LOCAL, Columns, OneBlock
from contrastive_dist.losses._visit import (
    BLOCK_LOGITS, Eager, Epilogue, Grads, Side, Visit, accumulate, as_input, chunks, epilogue_for, first_order_only,
    formed_in_forward, gradients_wanted, grads_for, scaled,
)  # fmt: skip

__all__ = ["Problem", "per_row", "weighted_sum"]


class Problem(NamedTuple):
    """What one call of the driver computes, besides its differentiated tensors.

    Attributes:
        family: the rows' loss family (:mod:`._families`).
        rows: where the rows' positives and excluded columns sit in their own rank's block, their keys.
        columns: what the rows meet (:class:`~._transports.Columns`; the driver's ``keys`` are its features).
        chunk: rows per visit; ``None``: chosen from the shapes (:func:`~._visit.chunks`).
        tiles: a Gram loss (its rows are its own block of the columns): every row's targets, in the
            columns' order, for its pairs of tiles where they pay (:mod:`._tiles`); else ``None``.
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
    problem = _tiles.taken(problem, queries, keys, bias, per_row=False)
    ring = not isinstance(problem.columns.transport, OneBlock)
    if ring and problem.tiles is None and (not problem.family.stateless or torch.compiler.is_compiling()):
        rows, columns, has = per_row(queries, keys, scale, bias, problem)
        total = rows + columns if problem.columns.own_losses is not None else rows
        return (total.sum() if weights is None else total @ weights), has
    wanted = gradients_wanted(queries, keys, scale, bias)
    return _Formed.apply(queries, keys, scale, bias, problem, weights, wanted)  # type: ignore[no-any-return]


def per_row(queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None,
            problem: Problem) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Each row's ``ℓ_i`` and, symmetric, each own column's; gradients formed in backward.

    Returns:
        The rows' values ``(n,)``, this rank's own columns' ``(own_losses[rank],)`` (else empty), and
        whether each row has a loss ``(n,)``.
    """
    problem = _tiles.taken(problem, queries, keys, bias, per_row=True)
    wanted = gradients_wanted(queries, keys, scale, bias)
    return _Recomputed.apply(queries, keys, scale, bias, problem, wanted)  # type: ignore[no-any-return]


class _Formed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, problem: Problem,
        weights: Tensor | None, wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor]:
        run = _Run(problem, queries, keys, scale, bias, formed_in_forward=True)
        grads = run.grads(wanted) if any(wanted) else None
        key_grad = run.states(grads, weights, want_keys=wanted[1])
        total = run.total(weights)
        if grads is not None and not run.at_once:
            column_weights = 1.0 if problem.columns.weights is None else problem.columns.weights
            key_grad = run.gradients(grads, 1.0 if weights is None else weights, column_weights, wanted[1])
        query_grad, scale_grad = run.finish(grads, key_grad)
        ctx.save_for_backward(query_grad, run.own_keys(key_grad), scale_grad, None if grads is None else grads.bias)
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype, scale.dtype)
        has_positive = run.has_positive()
        ctx.mark_non_differentiable(has_positive)
        return total, has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*formed_in_forward(ctx, grad_total), None, None, None)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, problem: Problem,
        wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor, Tensor]:
        run = _Run(problem, queries, keys, scale, bias, formed_in_forward=False)
        run.states(None, None, want_keys=False)
        ctx.save_for_backward(queries, keys, scale, bias, run.row_state, run.column_state)
        ctx.problem, ctx.wanted, ctx.kept = problem, wanted, run.kept
        has_positive = run.has_positive()
        ctx.mark_non_differentiable(has_positive)
        return problem.family.finish(run.row_state), problem.family.finish(run.own_columns()), has_positive

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, row_grad: Tensor, column_grad: Tensor, _: Tensor
    ) -> tuple[Tensor | None, ...]:
        queries, keys, scale, bias, row_state, column_state = ctx.saved_tensors
        run = _Run(ctx.problem, queries, keys, scale, bias, formed_in_forward=False)
        run.row_state, run.column_state, run.kept, ctx.kept = row_state, column_state, ctx.kept, None
        column_weights: Tensor | float = 1.0
        if run.symmetric:  # every column's upstream gradient where it is met (gather: every rank's, gathered)
            column_weights = run.transport.block_columns(column_grad.to(column_state.dtype), run.column_counts())
        grads = run.grads(ctx.wanted)
        # The rows' weights made contiguous once, not a copy a visit: an upstream gradient is often an expanded
        # one (``loss.sum().backward()``).
        row_weights = row_grad.to(row_state.dtype).contiguous()
        key_grad = run.gradients(grads, row_weights, column_weights, ctx.wanted[1])
        query_grad, scale_grad = run.finish(grads, key_grad)
        key_grad = run.own_keys(key_grad)
        return as_input(query_grad, queries), as_input(key_grad, keys), scale_grad, grads.bias, None, None


class _Run:
    """One call's passes: its inputs, epilogue and states, and what it keeps between the passes."""

    def __init__(self, problem: Problem, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, *,
                 formed_in_forward: bool) -> None:  # fmt: skip
        self.problem, self.queries, self.keys, self.scale, self.bias = problem, queries, keys, scale, bias
        self.family, self.columns, self.transport = problem.family, problem.columns, problem.columns.transport
        self.epilogue: Epilogue = epilogue_for(problem.family, queries, keys, scale, bias)
        self.ring, self.symmetric = not isinstance(self.transport, OneBlock), problem.columns.own_losses is not None
        self.formed_in_forward = formed_in_forward
        # G with the states in one pass: the rows' states are final after their one visit (or not needed).
        self.rows_final = not self.ring and problem.tiles is None
        self.at_once = formed_in_forward and (self.rows_final or self.family.stateless) and not self.symmetric
        self.row_state = self.family.empty_state(queries.shape[0], scale)
        self.column_state = self.family.empty_state(0, scale)
        self.kept: list[Any] | None = None
        self.tile_state: Tensor | None = None  # a Gram loss in gather mode: every row's final state
        self.tile_scale: Tensor | None = None  # a Gram loss: the scale's gradient, unscaled
        local = self.columns.local
        self.local = None if local is None else tuple(t for t in (local[0].to(keys.dtype), local[1]) if t is not None)
        # Gather mode meets the columns held here in its one block, after every rank's.
        self.block_keys = keys if self.ring or local is None else torch.cat((keys, local[0].to(keys.dtype)))

    def grads(self, wanted: tuple[bool, ...]) -> Grads:
        tiles = self.problem.tiles is not None  # a Gram loss's rows are its columns: one gradient, the keys'
        return grads_for(self.queries, self.scale, wanted[0] and not tiles, wanted[2] and not tiles, wanted[3])

    def column_counts(self) -> tuple[int, ...]:
        return self.columns.own_losses or ()

    def own_columns(self) -> Tensor:
        if not self.symmetric:
            return self.family.empty_state(0, self.scale)
        return self.transport.own_columns(self.column_state, self.column_counts())

    def total(self, weights: Tensor | None) -> Tensor:
        """``Σ w ℓ`` of the rows (and the own columns: their pairs' weights) from the final states."""
        total = None
        for state in (self.row_state, self.own_columns()) if self.symmetric else (self.row_state,):
            values = self.family.finish(state)
            part = values.sum() if weights is None else values @ weights
            total = part if total is None else total + part
        assert total is not None
        return total

    def has_positive(self) -> Tensor:
        # A rank without rows takes plain zeros: derived from its empty state, these flags made its compiled
        # graph hang (SupCon, shards (3, 0), tests/test_compile.py).
        if self.queries.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.queries.device)
        return self.family.has_positive(self.row_state)

    def own_keys(self, key_grad: Tensor | None) -> Tensor | None:
        """The keys' own part of a block's gradient (the columns held here take none)."""
        return None if key_grad is None else key_grad[: self.keys.shape[0]]

    def finish(self, grads: Grads | None, key_grad: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The queries' and the scale's gradients; the keys' scaled, in place."""
        if grads is None:
            return None, None
        query_grad, scale_grad = scaled(grads, self.queries, self.scale)
        if self.problem.tiles is not None:
            scale_grad = self.tile_scale
        if key_grad is not None:
            key_grad.mul_(self.scale)
        return query_grad, scale_grad

    def new_key_grad(self, owner: int) -> Tensor:
        rows = self.block_keys.shape[0] if owner < 0 else self.columns.counts[owner]
        return self.scale.new_zeros((rows, self.keys.shape[1]))

    def states(self, grads: Grads | None, weights: Tensor | None, *, want_keys: bool) -> Tensor | None:
        """Pass 1: every row's final state (and the own columns'); the one pass forms ``G`` too (``grads``).

        Returns the keys' gradient where the one pass formed it.
        """
        family, one_pass = self.family, grads is not None and self.at_once
        if self.problem.tiles is not None:
            self.row_state = _tiles.states(self, _keeps(self, grads is not None))
            return None
        self.kept = [] if not one_pass and _keeps(self, grads is not None) else None

        def visit(owner: int, block: tuple[Tensor, ...], accumulator: Tensor | None) -> None:
            column_state = accumulator if self.symmetric else None
            key_grad = accumulator if one_pass else None
            parts = [_states_of(self.epilogue, one, grads, self.kept, one_pass, self.rows_final)
                     for one in self.visits(owner, block, column_state, grads, key_grad, weights)]  # fmt: skip
            if not parts:
                return
            # Each visit's partial states joined once a block: a merge is a dozen small launches.
            rows = parts[0][0] if len(parts) == 1 else torch.cat([part[0] for part in parts])
            if self.ring or owner == LOCAL:
                family.merge_(self.row_state, rows)
            else:
                self.row_state = rows.to(self.row_state.dtype)
            column_parts = [part[1] for part in parts if part[1] is not None]
            if column_state is not None and column_parts:
                columns = family.merged(torch.stack(column_parts)) if len(column_parts) > 1 else column_parts[0]
                family.merge_(column_state, columns) if self.ring else column_state.copy_(columns)

        new_accumulator: Any = None
        if self.symmetric:
            new_accumulator = lambda owner: family.empty_state(  # noqa: E731
                self.transport.columns_in(owner, self.column_counts()), self.scale)
        elif one_pass and want_keys:
            new_accumulator = self.new_key_grad
        merge = family.merge_ if self.symmetric else torch.Tensor.add_
        result = self.transport.run(self._block(), self._block_rows(), visit, new_accumulator, merge)
        if self.ring and self.local is not None:
            visit(LOCAL, self.local, None)
        if self.symmetric and result is not None:
            self.column_state = self.transport.complete(result, self.column_counts(), family.merged)
        return result if one_pass else None

    def gradients(self, grads: Grads, row_weights: Tensor | float, column_weights: Tensor | float,
                  want_keys: bool) -> Tensor | None:  # fmt: skip
        """Pass 2: every visit's ``G`` from the final states, then its products; returns the keys' gradient."""
        if self.problem.tiles is not None:
            return _tiles.gradients(self, grads, row_weights)
        kept = iter(self.kept or ())
        weights = row_weights if isinstance(row_weights, Tensor) else None

        def visit(owner: int, block: tuple[Tensor, ...], key_grad: Tensor | None) -> None:
            for one in self.visits(owner, block, None, grads, key_grad, weights, column_weights):
                _gradients_of(self.epilogue, one, grads, next(kept, None))

        block, rows = self._block(), self._block_rows()
        if self.symmetric and self.ring:  # the own columns' final states and weights travel with their block
            upstream = torch.as_tensor(column_weights).to(self.column_state).expand(self.column_state.shape[0])
            block, rows = (*block, torch.cat((self.column_state, upstream[:, None]), dim=1)), [*rows, self.column_counts()]
        home = self.transport.run(block, rows, visit, self.new_key_grad if want_keys else None)
        if self.ring and self.local is not None:
            visit(LOCAL, self.local, None)
        return home

    def _block(self) -> tuple[Tensor, ...]:
        keys, local = self.columns.keys, self.local
        if keys is not None and not self.ring and local is not None and len(local) > 1:
            keys = torch.cat((keys, local[1].to(keys.dtype)))
        return (self.block_keys,) if keys is None else (self.block_keys, keys)

    def _block_rows(self) -> list[tuple[int, ...]]:
        return [self.columns.counts] + ([self.columns.key_counts] if self.columns.keys is not None else [])

    def visits(self, owner: int, block: tuple[Tensor, ...], column_state: Tensor | None, grads: Grads | None,
               key_grad: Tensor | None, weights: Tensor | None, column_weights: Tensor | float = 1.0
               ) -> list[Visit]:  # fmt: skip
        """The chunks of rows that meet ``owner``'s block, each a :class:`~._visit.Visit` (an empty block: none).

        ``column_state``: pass 1's running state of the block's own columns (symmetric); ``None`` in pass 2,
        which reads their final states (ring mode: travelling with the block, their weights beside them).
        """
        rows, features, width = self.problem.rows, block[0], 0
        keyed = self.columns.keys is not None or owner == LOCAL
        column_keys = block[1] if keyed and len(block) > 1 else None
        if features.shape[0] == 0 or self.queries.shape[0] == 0:
            return []
        own_start = None if owner == LOCAL else self.transport.own_start_of(owner)
        positive, excluded = (None if index is None or own_start is None else index + own_start
                              for index in (rows.positive, rows.excluded))  # fmt: skip
        column_positive = None
        if self.symmetric and owner != LOCAL:
            width = self.transport.columns_in(owner, self.column_counts())
            column_positive = self._column_positive(own_start, width)
            if column_state is None and self.ring:  # (contiguous once a block, as the fused ops take them)
                column_state, column_weights = block[-1][:, :-1].contiguous(), block[-1][:, -1].contiguous()
            elif column_state is None:
                column_state = self.column_state
        visits = []
        symmetric_at_once = self.symmetric and self.formed_in_forward and not self.ring
        for start, stop in chunks(self.queries.shape[0], self.problem.chunk, features.shape[0], self.queries,
                                  symmetric_at_once):  # fmt: skip
            keys = None if rows.keys is None else rows.keys[start:stop]
            indices = Indices(_part(positive, start, stop), _part(excluded, start, stop), keys, column_keys,
                              rows.key_rule, width=features.shape[0])  # fmt: skip
            row_side = Side(indices, self.row_state[start:stop], 1.0 if weights is None else weights[start:stop])
            column_side = None
            if width and column_state is not None:
                own_keys = None if column_keys is None else column_keys[:width]
                column_indices = Indices(column_positive, None, own_keys, keys, rows.key_rule, start, stop - start,
                                         inside=False)  # fmt: skip
                column_side = Side(column_indices, column_state, column_weights)
            query_grad = None if grads is None or grads.query is None else grads.query[start:stop]
            visits.append(Visit(self.queries[start:stop], features, row_side, column_side, query_grad, key_grad))
        return visits

    def _column_positive(self, own_start: int | None, width: int) -> Tensor | None:
        """The own columns' positive rows, placed at their columns of the block (the others': none)."""
        positive = self.problem.rows.column_positive
        if not width or positive is None or own_start is None:
            return None
        if own_start == 0 and positive.shape[0] == width:
            return positive
        placed = positive.new_full((width,), -1)
        placed[own_start : own_start + positive.shape[0]] = positive
        return placed


def _keeps(run: _Run, formed_in_forward: bool) -> bool:
    """Whether a call keeps its visits' logits between the passes instead of forming them again.

    Gather mode with ``chunk_size=None``, never under ``torch.compile``: a weighted sum when its one block
    is one visit (it holds them then anyway); per-row values on the eager epilogue when both directions'
    logits fit :data:`~._visit.BLOCK_LOGITS` (a Gram loss: twice that). Never in ring mode, whose memory
    would then grow with the number of ranks (measured: keeping took ring mode's CLIP loss 0.8× the time
    and 1.6–2.8× the memory per rank at W = 2 and 4); never the fused epilogue's numerators (~57 bytes per
    logit of memory traffic, SigLIP bf16, ``tests/test_traffic.py``, against ~13 formed again).
    """
    if run.problem.chunk is not None or run.ring or torch.compiler.is_compiling():
        return False
    columns, rows = run.block_keys.shape[0], run.queries.shape[0]
    if run.problem.tiles is not None:
        return formed_in_forward and 2 * _tiles.area(run) <= BLOCK_LOGITS
    if formed_in_forward:
        return len(chunks(rows, None, columns, run.queries, run.symmetric)) == 1
    directions = 2 if run.symmetric else 1
    return isinstance(run.epilogue, Eager) and directions * max(rows, *run.columns.counts) * columns <= BLOCK_LOGITS


class _Kept(NamedTuple):
    """A visit as pass 1 left it for pass 2: its product (eager: the numerators against ``partial``), its
    columns' values against ``column_partial``, and where the rows' states were final, their ``G`` already."""

    product: Tensor | None = None
    partial: Tensor | None = None
    column_values: Tensor | None = None
    column_partial: Tensor | None = None
    logit_grad: Tensor | None = None
    sums: Tensor | None = None


def _states_of(epilogue: Epilogue, visit: Visit, grads: Grads | None, kept: list[Any] | None, one_pass: bool,
               rows_final: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """One visit of pass 1: its rows' (and columns') partial states.

    ``one_pass``: ``G`` and its products too. A kept visit whose rows' states are final forms their ``G`` now
    (the numerators become it), to which pass 2 adds the columns'.
    """
    columns = visit.columns
    product = epilogue.product(visit.queries, visit.keys)
    column_values = column_partial = None
    if columns is not None:
        column_values = epilogue.transposed(product, columns.state.shape[0])
        column_partial = epilogue.state(column_values, columns.indices)
    if one_pass or (kept is not None and rows_final and grads is not None):
        partial, logit_grad, sums = epilogue.state_and_gradient(product, visit.rows.indices, visit.rows.weights,
                                                                keep=columns is not None)  # fmt: skip
        if one_pass:
            assert grads is not None
            accumulate(logit_grad, visit, grads, sums)
        elif kept is not None:
            kept.append(_Kept(None, None, column_values, column_partial, logit_grad, sums))
        return partial, column_partial
    partial = epilogue.state(product, visit.rows.indices)
    if kept is not None:
        kept.append(_Kept(product, partial, column_values, column_partial))
    return partial, column_partial


def _gradients_of(epilogue: Epilogue, visit: Visit, grads: Grads, kept: _Kept | None) -> None:
    """One visit of pass 2: ``G`` from the final states (the rows', then the columns' added), and its products."""
    rows, columns = visit.rows, visit.columns
    product, partial, column_values, column_partial, logit_grad, sums = kept or _Kept()
    if logit_grad is None:
        if product is None:
            product = epilogue.product(visit.queries, visit.keys)
        if columns is not None and column_values is None:
            column_values = epilogue.transposed(product, columns.state.shape[0])
        logit_grad, sums = epilogue.gradient(product, rows.indices, rows.state, rows.weights, partial,
                                             keep=columns is not None)  # fmt: skip
    if columns is not None and column_values is not None:
        epilogue.add_column_gradient(logit_grad, column_values, columns.indices, columns.state, columns.weights,
                                     column_partial)  # fmt: skip
    accumulate(logit_grad, visit, grads, sums)


def _part(index: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if index is None else index[start:stop]
