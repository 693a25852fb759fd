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

from contrastive_dist.losses import _epilogue as epilogue
from contrastive_dist.losses._columns import EVERY_RANK
from contrastive_dist.losses._kernel import (
    Pairs,
    RowSums,
    accumulate,
    block_logits,
    chunk_budget,
    chunks,
    first_order_only,
    formed_in_forward,
    gradients_wanted,
    grads_for,
    scaled,
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
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs,
        weights: Tensor | None, wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor]:
        want_query, want_key, want_scale, want_bias = wanted
        family, transport = pairs.family, pairs.transport
        own_start = transport.own_start_of(EVERY_RANK)
        block_keys, column_keys = with_local(keys, pairs.column_keys, pairs)
        grads = grads_for(queries, scale, want_query, want_scale, want_bias)
        key_grad = torch.zeros_like(block_keys, dtype=scale.dtype) if want_key else None
        any_grad = any(wanted)
        fast = epilogue.fused(pairs, queries, block_keys)
        budget = chunk_budget(queries, one_pass_symmetric=pairs.columns is not None)
        spans = chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget) if block_keys.shape[0] else []
        row_state = family.empty_state(queries.shape[0], scale)
        columns = transport.columns_in(EVERY_RANK, pairs.columns) if pairs.columns is not None else 0
        column_parts: list[Tensor] = []  # the columns' states over each chunk of this rank's rows
        symmetric, whole = pairs.columns is not None, len(spans) == 1
        row_indices = epilogue.row_indices(pairs, own_start, column_keys)
        kept = None
        block: Any = None  # the columns' side of a chunk: (product, their positives) fused, a ColumnBlock eager
        # The fused path's per-chunk results, joined once after the loop rather than copied chunk by chunk:
        # each launch costs the host as much as a small chunk's GPU work.
        fused_states: list[Tensor] = []
        row_sums = RowSums(grads)

        def chunk_weights(start: int, stop: int) -> Tensor | float:
            return 1.0 if weights is None else weights[start:stop]

        def finish_block(logit_grad: Tensor, start: int, grad_sums: Tensor | None) -> None:
            accumulate(logit_grad, queries[start : start + logit_grad.shape[0]], block_keys, start,
                       row_sums.grads_for(grad_sums), key_grad)  # fmt: skip

        # Pass 1: every row's state (final: the block holds every column) and the columns' partial states.
        for start, stop in spans:
            formed_now = any_grad and (not symmetric or whole)  # G now, or after the columns' exchange
            if fast:
                logits = epilogue.raw_product(queries[start:stop], block_keys)
                logit_grad = epilogue.grad_buffer(logits, queries, keep=symmetric) if formed_now else None
                if symmetric:
                    block = (logits, epilogue.column_indices(pairs, start, stop, own_start, column_keys, columns))
                    column_parts.append(epilogue.row_state(family, logits[:, :columns].T, scale, bias, block[1],
                                                           1.0, None)[0])  # fmt: skip
                indices = epilogue.chunk_of(row_indices, start, stop)
                state, grad_sums = epilogue.row_state(
                    family, logits, scale, bias, indices, chunk_weights(start, stop), logit_grad
                )
                fused_states.append(state)
            else:
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                logits = block_logits(queries[start:stop], block_keys, scale, bias)
                if symmetric:
                    block = column_block(pairs, logits, own_start, start, stop, targets, columns)
                    column_parts.append(column_state(pairs, block))
                mask = targets.positive_mask(logits)
                state = row_state[start:stop]
                state.copy_(family.block_state_(logits, targets, mask))
                row_weights = chunk_weights(start, stop)
                logit_grad = family.gradient_(logits, state, targets, mask, row_weights) if formed_now else None
                grad_sums = None
            if logit_grad is not None and not symmetric:
                finish_block(logit_grad, start, grad_sums)
            elif logit_grad is not None:  # the whole block, kept for after the exchange
                kept = (logit_grad, block)
        if fused_states:
            row_state = (fused_states[0] if whole else torch.cat(fused_states)).to(row_state.dtype)
        total = _weighted(family.finish(row_state), weights)
        if pairs.columns is not None:
            partial = family.merged(torch.stack(column_parts)) if column_parts else family.empty_state(columns, scale)
            final = transport.complete_columns(partial, pairs.columns, family.merged)
            total = total + _weighted(family.finish(transport.own_columns(final, pairs.columns)), weights)
            column_weights = 1.0 if pairs.column_weights is None else pairs.column_weights
            # Pass 2: each block's gradient, the rows' and the columns' together.
            for start, stop in spans if any_grad else []:
                if kept is not None:
                    logit_grad, block = kept
                elif fast:
                    logits = epilogue.raw_product(queries[start:stop], block_keys)
                    logit_grad = epilogue.grad_buffer(logits, queries, keep=True)
                    indices = epilogue.chunk_of(row_indices, start, stop)
                    epilogue.gradient(family, logits, scale, bias, row_state[start:stop], indices,
                                      chunk_weights(start, stop), logit_grad)  # fmt: skip
                    block = (logits, epilogue.column_indices(pairs, start, stop, own_start, column_keys, columns))
                else:
                    targets = pairs.rows.block(own_start, start, stop, column_keys)
                    logits = block_logits(queries[start:stop], block_keys, scale, bias)
                    block = column_block(pairs, logits, own_start, start, stop, targets, columns)
                    mask = targets.positive_mask(logits)
                    state = row_state[start:stop]
                    family.numerators_(logits, state, targets, mask)
                    logit_grad = family.gradient_(logits, state, targets, mask, chunk_weights(start, stop))
                if fast:
                    logits, column_positives = block
                    epilogue.gradient(family, logits[:, :columns].T, scale, bias, final, column_positives,
                                      column_weights, logit_grad[:, :columns].T, accumulate=True)  # fmt: skip
                else:
                    partial_here = partial if kept is not None else None
                    logit_grad[:, :columns] += column_gradient(pairs, block, final, column_weights, partial_here).T
                finish_block(logit_grad, start, None)
        row_sums.add()
        query_grad, scale_grad = scaled(grads, queries, scale)
        if key_grad is not None:
            key_grad = key_grad[: keys.shape[0]].mul_(scale)
        ctx.save_for_backward(query_grad, key_grad, scale_grad, grads.bias)
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype, scale.dtype)
        # A rank without rows takes plain zeros: derived from its empty state, these flags made its
        # compiled graph hang (SupCon, shards (3, 0), tests/test_compile.py).
        if spans:
            has_positive = family.has_positive(row_state)
        else:
            has_positive = torch.zeros(queries.shape[0], dtype=torch.bool, device=queries.device)
        ctx.mark_non_differentiable(has_positive)
        return total, has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*formed_in_forward(ctx, grad_total), None, None, None)


def _weighted(losses: Tensor, weights: Tensor | None) -> Tensor:
    """``Σ w ℓ`` (``w = 1`` without weights)."""
    return losses.sum() if weights is None else losses @ weights
