"""One driver for both loss families over both transports: rows against column blocks, chunk by chunk.

A family (:mod:`._softmax`, :mod:`._sigmoid`) says what a block does to its rows' state and what
its gradient is; a transport (:mod:`._columns`) says which blocks a rank meets and where their
gradients go. This module runs one against the other, forming the logits ``s · Q Kᵀ (+ b)`` of
``chunk`` rows at a time against one block, so at most ``chunk × block`` logits exist at once:

* :func:`pair_losses` — the rows' losses ``ℓ_i`` (and, in ring mode's symmetric losses, the
  columns' own losses from the same logits); backward meets every block again, recomputing its
  logits, with the upstream gradients as row weights. Any transport.
* :func:`weighted_pair_sum` — ``Σ_i w_i ℓ_i`` with every column in one block (gather mode): a row's
  state is complete after its block, so the gradient is formed in forward from the same logits
  (three products per block, the CPU floor; backward only scales it).

From a block's logit gradient ``G`` one routine, :func:`accumulate`, adds the queries'
``s · G K``, the keys' ``s · Gᵀ Q``, the scale's ``Σ Q ⊙ (G K)`` and the bias's ``Σ G``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block
from contrastive_dist.losses import _sigmoid, _softmax
from contrastive_dist.losses._columns import OneBlock, Transport
from contrastive_dist.losses._precision import full_precision
from contrastive_dist.losses._targets import RowTargets, Targets

__all__ = [
    "SIGMOID",
    "SOFTMAX",
    "Direction",
    "Family",
    "Pairs",
    "first_order_only",
    "mean_over_directions",
    "pair_losses",
    "weighted_pair_sum",
]

_LOCAL = -2
"""The ``owner`` of the columns held here (shared negatives): no rank's block, no transfer, no gradient."""


class Family(NamedTuple):
    """The functions of one loss family (see :mod:`._softmax` for their contracts)."""

    width: int
    empty_state: Callable[[int, Tensor], Tensor]
    block_state_: Callable[[Tensor, Targets, Tensor | None], Tensor]
    merge_: Callable[[Tensor, Tensor], None]
    finish: Callable[[Tensor], Tensor]
    has_positive: Callable[[Tensor], Tensor]
    numerators_: Callable[..., Tensor]
    gradient_: Callable[[Tensor, Tensor, Targets, Tensor | None, Tensor], Tensor]


def _family(module: Any) -> Family:
    return Family(module.WIDTH, *(getattr(module, name) for name in Family._fields[1:]))


SOFTMAX, SIGMOID = _family(_softmax), _family(_sigmoid)


class Pairs(NamedTuple):
    """Everything of one kernel call that is not differentiated.

    Attributes:
        family: :data:`SOFTMAX` or :data:`SIGMOID`.
        rows: where the rows' positives and excluded columns sit in their own rank's block, their keys.
        transport: which blocks the rows meet.
        chunk: rows per logit block.
        column_keys: ``(m,)`` the keys of the transport's block of columns (gather: every rank's; ring:
            this rank's), or ``None``.
        key_rows: ring mode: the number of columns in each rank's block.
        column_key_rows: ring mode: the number of keys in each rank's block of :attr:`column_keys`
            (columns past the end of a block's keys have none: they share no key with any row);
            default :attr:`key_rows`.
        columns: ring mode's symmetric losses: per rank, how many leading columns of its block have
            a loss of their own (InfoNCE's texts; its own negatives after them have none), from the
            same logits; ``None``: the columns have no loss.
        local_keys: ``(K, D)`` extra columns held here (shared negatives), met by every row, no gradient.
        local_column_keys: ``(K,)`` their keys, or ``None``.
    """

    family: Family
    rows: RowTargets
    transport: Transport
    chunk: int
    column_keys: Tensor | None = None
    key_rows: tuple[int, ...] = ()
    column_key_rows: tuple[int, ...] | None = None
    columns: tuple[int, ...] | None = None
    local_keys: Tensor | None = None
    local_column_keys: Tensor | None = None


Backward = Callable[..., tuple[Tensor | None, ...]]


def first_order_only(backward: Backward) -> Backward:
    """Mark a kernel's ``backward`` as not differentiable, and run it with autocast off.

    ``create_graph=True`` raises instead of being wrong.

    ``once_differentiable`` alone stays silent when the incoming gradient is a constant (the usual
    ``grad(loss, x, create_graph=True)``): the second derivative would quietly miss this term.
    """
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx: Any, *grad_outputs: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through the contrastive losses' kernels is not "
                "supported: their gradients are formed block by block (once_differentiable)"
            )
        # A backward called inside torch.autocast recomputes in the forward's dtype, not autocast's.
        with full_precision(grad_outputs[0].device):
            return once(ctx, *grad_outputs)

    return checked


def _logits(queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """``s · Q Kᵀ (+ b)`` of one chunk of rows against one block."""
    if bias is None:
        return (queries * scale) @ keys.T
    return torch.addmm(bias.expand(1, 1), queries * scale, keys.T)


def _transposed_copy(logits: Tensor) -> Tensor:
    """A copy of ``logits``, seen transposed: the columns' rows.

    Laid out like the logits, so that adding their gradient back is a plain elementwise pass.
    """
    return logits.clone().T


def _chunks(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


class Grads(NamedTuple):
    """Gradient accumulators of the inputs that need one (``None`` for the others)."""

    query: Tensor | None
    scale: Tensor | None
    bias: Tensor | None


def accumulate(
    logit_grad: Tensor, queries: Tensor, keys: Tensor, scale: Tensor, start: int, grads: Grads, key_grad: Tensor | None
) -> None:
    """From ``G = ∂(Σ w ℓ)/∂logits`` of rows ``start:`` against ``keys``: add every input's gradient.

    Queries ``s · G K``, keys ``s · Gᵀ Q`` (into ``key_grad``), scale ``Σ Q ⊙ (G K)``, bias ``Σ G``.
    """
    if key_grad is not None:
        key_grad.addmm_(logit_grad.T, queries * scale)
    if grads.bias is not None:
        grads.bias.add_(logit_grad.sum())
    if grads.query is None and grads.scale is None:
        return
    weighted_keys = logit_grad @ keys
    if grads.query is not None:
        grads.query[start : start + queries.shape[0]].add_(weighted_keys * scale)
    if grads.scale is not None:
        grads.scale.add_((queries * weighted_keys).sum())


def _wanted(*tensors: Tensor | None) -> tuple[bool, ...]:
    return tuple(tensor is not None and torch.is_grad_enabled() and tensor.requires_grad for tensor in tensors)


def _grads(queries: Tensor, want_query: bool, want_scale: bool, want_bias: bool) -> Grads:
    query = torch.zeros_like(queries) if want_query else None
    return Grads(query, queries.new_zeros(()) if want_scale else None, queries.new_zeros(()) if want_bias else None)


def weighted_pair_sum(
    queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σ_i w_i ℓ_i`` over every column in one block (gather mode), gradients formed in forward.

    Returns:
        The weighted sum (``w = 1`` when ``weights`` is None) and, per row, whether it has a loss.

    Shape:
        queries: ``(n, D)``; keys: ``(N, D)``; scale, bias: ``()``; weights: ``(n,)``; outputs: ``()``, ``(n,)``.
    """
    wanted = _wanted(queries, keys, scale, bias)
    return _FusedOneBlock.apply(queries, keys, scale, bias, pairs, weights, wanted)  # type: ignore[no-any-return]


def pair_losses(
    queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's loss ``ℓ_i`` over every block the transport brings, blocks recomputed in backward.

    Returns:
        ``(rows, columns, has_positive)``: the rows' losses ``(n,)``; with :attr:`Pairs.columns`, the
        losses of this rank's own columns ``(columns[rank],)`` from the same logits (else empty);
        whether each row has a loss ``(n,)``.

    Shape:
        queries: ``(n, D)``; keys: ``(m, D)`` (the transport's block); scale, bias: ``()``.
    """
    wanted = _wanted(queries, keys, scale, bias)
    return _Recomputed.apply(queries, keys, scale, bias, pairs, wanted)  # type: ignore[no-any-return]


class Direction(NamedTuple):
    """One kernel call of a loss: its rows (queries) against their columns (keys)."""

    queries: Tensor
    keys: Tensor
    scale: Tensor
    bias: Tensor | None
    pairs: Pairs


def mean_over_directions(
    directions: Sequence[Direction], *, weights: Tensor | None, per_row: bool
) -> tuple[Tensor, Tensor]:
    """A loss whose row loss is the mean of its directions': ``Σ_i w_i ℓ_i`` (or the ``ℓ_i`` with ``per_row``).

    The directions of a symmetric loss are gather mode's two kernel calls (image→text, text→image)
    or ring mode's one call whose columns have losses of their own (:attr:`Pairs.columns`). Gather
    mode's weighted sum forms its gradients in forward (:func:`weighted_pair_sum`); every other case
    recomputes in backward (:func:`pair_losses`).

    Returns:
        The weighted sum ``()`` or the rows ``(n,)``, and whether each row has a loss ``(n,)`` (first direction).
    """
    parts: list[Tensor] = []
    has_positive: Tensor | None = None
    for direction in directions:
        if not per_row and isinstance(direction.pairs.transport, OneBlock):
            total, has = weighted_pair_sum(*direction, weights)
            parts.append(total)
        else:
            rows, columns, has = pair_losses(*direction)
            parts += [rows] if direction.pairs.columns is None else [rows, columns]
        has_positive = has if has_positive is None else has_positive
    value = parts[0] if len(parts) == 1 else sum(parts[1:], parts[0]) * (1.0 / len(parts))
    if not per_row and value.ndim:
        value = value.sum() if weights is None else value @ weights
    assert has_positive is not None
    return value, has_positive


def _with_local(keys: Tensor, column_keys: Tensor | None, pairs: Pairs) -> tuple[Tensor, Tensor | None]:
    """The one block of gather mode, with the columns held here (shared negatives) appended.

    Their keys follow the block's (which must then cover every column before them); without keys
    of their own they share none with any row.
    """
    if pairs.local_keys is None:
        return keys, column_keys
    if pairs.local_column_keys is not None and column_keys is not None:
        column_keys = torch.cat((column_keys, pairs.local_column_keys))
    return torch.cat((keys, pairs.local_keys.to(keys.dtype))), column_keys


class _FusedOneBlock(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        queries: Tensor,
        keys: Tensor,
        scale: Tensor,
        bias: Tensor | None,
        pairs: Pairs,
        weights: Tensor | None,
        wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor]:
        want_query, want_key, want_scale, want_bias = wanted
        family, own_start = pairs.family, pairs.transport.own_start_of(-1)
        block_keys, column_keys = _with_local(keys, pairs.column_keys, pairs)
        grads = _grads(queries, want_query, want_scale, want_bias)
        key_grad = torch.zeros_like(block_keys) if want_key else None
        any_grad = any(wanted)
        rows = queries.new_zeros(queries.shape[0])
        has_positive = torch.zeros(queries.shape[0], dtype=torch.bool, device=queries.device)
        for start, stop in _chunks(queries.shape[0], pairs.chunk) if block_keys.shape[0] else []:
            chunk_queries = queries[start:stop]
            logits = _logits(chunk_queries, block_keys, scale, bias)
            targets = pairs.rows.block(own_start, start, stop, column_keys)
            positive_mask = targets.positive_mask(logits)
            state = family.block_state_(logits, targets, positive_mask)
            rows[start:stop] = family.finish(state)
            has_positive[start:stop] = family.has_positive(state)
            if any_grad:
                row_weights = torch.ones_like(rows[start:stop]) if weights is None else weights[start:stop]
                logit_grad = family.gradient_(logits, state, targets, positive_mask, row_weights)
                accumulate(logit_grad, chunk_queries, block_keys, scale, start, grads, key_grad)
        if key_grad is not None:
            key_grad = key_grad[: keys.shape[0]]
        ctx.save_for_backward(grads.query, key_grad, grads.scale, grads.bias)
        ctx.mark_non_differentiable(has_positive)
        return (rows.sum() if weights is None else rows @ weights), has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = tuple(None if grad is None else grad * grad_total for grad in ctx.saved_tensors)
        return (*grads, None, None, None)


def _column_targets(
    pairs: Pairs, own_start: int | None, start: int, stop: int, targets: Targets, columns: int
) -> Targets:
    """Ring mode's column direction of rows ``start:stop``: the block's first ``columns`` columns against them."""
    column_keys = None if targets.column_keys is None else targets.column_keys[:columns]
    return pairs.rows.columns(own_start is not None, start, stop - start, targets._replace(column_keys=column_keys))


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        queries: Tensor,
        keys: Tensor,
        scale: Tensor,
        bias: Tensor | None,
        pairs: Pairs,
        wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor, Tensor]:
        family, transport = pairs.family, pairs.transport
        row_state = family.empty_state(queries.shape[0], queries)

        def visit(owner: int, block: Block, column_state: Tensor | None) -> None:
            block_keys, column_keys = block[0], block[1] if len(block) > 1 else None
            if block_keys.shape[0] == 0:
                return
            own_start = transport.own_start_of(owner) if owner != _LOCAL else None
            for start, stop in _chunks(queries.shape[0], pairs.chunk):
                logits = _logits(queries[start:stop], block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                if column_state is not None and column_state.shape[0]:
                    columns = column_state.shape[0]
                    column_logits = _transposed_copy(logits[:, :columns])
                    column_targets = _column_targets(pairs, own_start, start, stop, targets, columns)
                    mask = column_targets.positive_mask(column_logits)
                    family.merge_(column_state, family.block_state_(column_logits, column_targets, mask))
                chunk_state = family.block_state_(logits, targets, targets.positive_mask(logits))
                family.merge_(row_state[start:stop], chunk_state)

        own = _own_block(keys, pairs.column_keys)
        new_column_state = None
        if pairs.columns is not None:
            columns = pairs.columns
            new_column_state = lambda owner: family.empty_state(columns[owner], queries)  # noqa: E731
        column_state = transport.run(own, _block_rows(pairs), visit, new_column_state)
        if pairs.local_keys is not None:
            visit(_LOCAL, _own_block(pairs.local_keys.to(keys.dtype), pairs.local_column_keys), None)
        if column_state is None:
            column_state = family.empty_state(0, queries)
        ctx.save_for_backward(queries, keys, scale, bias, row_state, column_state)
        ctx.pairs, ctx.wanted = pairs, wanted
        has_positive = family.has_positive(row_state)
        ctx.mark_non_differentiable(has_positive)
        return family.finish(row_state), family.finish(column_state), has_positive

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, row_grad: Tensor, column_grad: Tensor, _: Tensor
    ) -> tuple[Tensor | None, ...]:
        queries, keys, scale, bias, row_state, column_state = ctx.saved_tensors
        pairs = ctx.pairs
        want_query, want_key, want_scale, want_bias = ctx.wanted
        family, transport = pairs.family, pairs.transport
        grads = _grads(queries, want_query, want_scale, want_bias)
        symmetric = pairs.columns is not None

        def visit(owner: int, block: Block, key_grad: Tensor | None) -> None:
            block_keys, column_keys = block[0], block[1] if len(block) > 1 + symmetric else None
            if block_keys.shape[0] == 0:
                return
            own_start = transport.own_start_of(owner) if owner != _LOCAL else None
            columns_here = block[-1] if symmetric and owner != _LOCAL else None
            if owner == _LOCAL:
                column_keys = block[1] if len(block) > 1 else None
            for start, stop in _chunks(queries.shape[0], pairs.chunk):
                chunk_queries = queries[start:stop]
                logits = _logits(chunk_queries, block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                column_logit_grad = None
                if columns_here is not None and columns_here.shape[0]:
                    columns = columns_here.shape[0]
                    state, upstream = columns_here[:, :-1], columns_here[:, -1]
                    column_logits = _transposed_copy(logits[:, :columns])
                    column_targets = _column_targets(pairs, own_start, start, stop, targets, columns)
                    mask = column_targets.positive_mask(column_logits)
                    family.numerators_(column_logits, state, column_targets, mask)
                    column_logit_grad = family.gradient_(column_logits, state, column_targets, mask, upstream)
                mask = targets.positive_mask(logits)
                chunk_state = row_state[start:stop]
                family.numerators_(logits, chunk_state, targets, mask)
                logit_grad = family.gradient_(logits, chunk_state, targets, mask, row_grad[start:stop])
                if column_logit_grad is not None:
                    logit_grad[:, : column_logit_grad.shape[0]] += column_logit_grad.T
                accumulate(logit_grad, chunk_queries, block_keys, scale, start, grads, key_grad)

        own = _own_block(keys, pairs.column_keys)
        if symmetric:
            own = (*own, torch.cat((column_state, column_grad[:, None].to(column_state.dtype)), dim=1))
        new_key_grad = None
        if want_key:
            key_rows = pairs.key_rows
            new_key_grad = lambda owner: keys.new_zeros(  # noqa: E731
                (keys.shape[0] if owner < 0 else key_rows[owner], keys.shape[1])
            )
        key_grad = transport.run(own, _block_rows(pairs, with_columns=symmetric), visit, new_key_grad)
        if pairs.local_keys is not None:
            visit(_LOCAL, _own_block(pairs.local_keys.to(keys.dtype), pairs.local_column_keys), None)
        return grads.query, key_grad, grads.scale, grads.bias, None, None


def _own_block(keys: Tensor, column_keys: Tensor | None) -> Block:
    return (keys,) if column_keys is None else (keys, column_keys)


def _block_rows(pairs: Pairs, *, with_columns: bool = False) -> list[tuple[int, ...]]:
    """Ring mode's rows per rank of each tensor of a block: keys, their keys, then the columns' states."""
    rows = [pairs.key_rows]
    if pairs.column_keys is not None:
        rows.append(pairs.column_key_rows if pairs.column_key_rows is not None else pairs.key_rows)
    if with_columns:
        rows.append(pairs.columns or ())
    return rows
