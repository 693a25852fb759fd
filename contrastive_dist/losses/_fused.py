"""Gather mode's weighted sum, gradients formed in forward: every column in one block.

A row's state is complete after its one block, so the logits that gave its loss give its
gradient on the spot: three products per block (the logits, ``G K`` and ``Gᵀ Q``), the floor;
backward only multiplies the stored gradients by the upstream scalar.

A symmetric loss (:attr:`Pairs.columns`: InfoNCE's texts have losses of their own) takes both
directions from the same block (:mod:`._symmetric`): each rank's rows give every column a partial
state, merged over the ranks by one small exchange, and the block's gradient is the rows' and the
columns' together, ``G_rows + G_columnsᵀ``, before its products. Formed whole (one chunk, the
default up to :data:`~._kernel.BLOCK_LOGITS` logits), the block is kept between the exchange and
its gradient: three products; in chunks, each is formed again after the exchange: four.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from contrastive_dist.losses._columns import EVERY_RANK
from contrastive_dist.losses._kernel import (
    Pairs,
    accumulate,
    block_logits,
    chunks,
    first_order_only,
    gradients_wanted,
    grads_for,
    with_local,
)
from contrastive_dist.losses._symmetric import column_block, column_gradient, column_state

__all__ = ["weighted_pair_sum"]


def weighted_pair_sum(
    queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σ_i w_i ℓ_i`` over every column in one block (gather mode), gradients formed in forward.

    With :attr:`Pairs.columns`, the sum of both directions: ``Σ_i w_i ℓ_i + Σ_j w_j ℓ'_j`` over this
    rank's rows ``i`` and its own columns ``j``.

    Returns:
        The weighted sum (``w = 1`` when ``weights`` is None) and, per row, whether it has a loss.

    Shape:
        queries: ``(n, D)``; keys: ``(N, D)``; scale, bias: ``()``; weights: ``(n,)``; outputs: ``()``, ``(n,)``.
    """
    wanted = gradients_wanted(queries, keys, scale, bias)
    return _FusedOneBlock.apply(queries, keys, scale, bias, pairs, weights, wanted)  # type: ignore[no-any-return]


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
        family, transport = pairs.family, pairs.transport
        own_start = transport.own_start_of(EVERY_RANK)
        block_keys, column_keys = with_local(keys, pairs.column_keys, pairs)
        grads = grads_for(queries, scale, want_query, want_scale, want_bias)
        key_grad = torch.zeros_like(block_keys, dtype=scale.dtype) if want_key else None
        any_grad = any(wanted)
        symmetric = pairs.columns is not None
        spans = chunks(queries.shape[0], pairs.chunk, block_keys.shape[0]) if block_keys.shape[0] else []
        row_state = family.empty_state(queries.shape[0], scale)
        columns = transport.columns_in(EVERY_RANK, pairs.columns) if pairs.columns is not None else 0
        partial = family.empty_state(columns, scale)
        kept = None
        for start, stop in spans:
            chunk_queries = queries[start:stop]
            logits = block_logits(chunk_queries, block_keys, scale, bias)
            targets = pairs.rows.block(own_start, start, stop, column_keys)
            if symmetric:
                block = column_block(pairs, logits, own_start, start, stop, targets, columns)
                family.merge_(partial, column_state(pairs, block))
            mask = targets.positive_mask(logits)
            state = row_state[start:stop]
            state.copy_(family.block_state_(logits, targets, mask))
            if any_grad:
                row_weights = 1.0 if weights is None else weights[start:stop]
                logit_grad = family.gradient_(logits, state, targets, mask, row_weights)
                if not symmetric:
                    accumulate(logit_grad, chunk_queries, block_keys, scale, start, grads, key_grad)
                elif len(spans) == 1:  # the whole block, kept for after the exchange
                    kept = (logit_grad, block)
        total = _weighted(family.finish(row_state), weights)
        if pairs.columns is not None:
            final = transport.complete_columns(partial, pairs.columns, family.merge_)
            total = total + _weighted(family.finish(transport.own_columns(final, pairs.columns)), weights)
            column_weights = 1.0 if pairs.column_weights is None else pairs.column_weights
            for start, stop in spans if any_grad else []:
                chunk_queries = queries[start:stop]
                if kept is not None:
                    logit_grad, block = kept
                    column_grad = column_gradient(pairs, block, final, column_weights, partial)
                else:
                    logits = block_logits(chunk_queries, block_keys, scale, bias)
                    targets = pairs.rows.block(own_start, start, stop, column_keys)
                    block = column_block(pairs, logits, own_start, start, stop, targets, columns)
                    column_grad = column_gradient(pairs, block, final, column_weights)
                    mask = targets.positive_mask(logits)
                    state = row_state[start:stop]
                    family.numerators_(logits, state, targets, mask)
                    row_weights = 1.0 if weights is None else weights[start:stop]
                    logit_grad = family.gradient_(logits, state, targets, mask, row_weights)
                logit_grad[:, :columns] += column_grad.T
                accumulate(logit_grad, chunk_queries, block_keys, scale, start, grads, key_grad)
        if key_grad is not None:
            key_grad = key_grad[: keys.shape[0]]
        ctx.save_for_backward(grads.query, key_grad, grads.scale, grads.bias)
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype, scale.dtype)
        has_positive = family.has_positive(row_state)
        ctx.mark_non_differentiable(has_positive)
        return total, has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        grads = tuple(None if grad is None else (grad * grad_total).to(dtype) for grad, dtype in saved)
        return (*grads, None, None, None)


def _weighted(losses: Tensor, weights: Tensor | None) -> Tensor:
    """``Σ w ℓ`` (``w = 1`` without weights)."""
    return losses.sum() if weights is None else losses @ weights
