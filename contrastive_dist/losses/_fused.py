"""Gather mode's weighted sum, gradients formed in forward: every column in one block, one pass.

A row's state is complete after its one block, so the logits that gave its loss give its
gradient on the spot: three products per block (the logits, ``G K`` and ``Gᵀ Q``), the CPU floor;
backward only multiplies the stored gradients by the upstream scalar. Recomputing instead
(:mod:`._recomputed`) costs a fourth product per block and measured slower on CPU (the
``clip_chunk256_recompute`` row of ``benchmarks/losses.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

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

__all__ = ["weighted_pair_sum"]


def weighted_pair_sum(
    queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σ_i w_i ℓ_i`` over every column in one block (gather mode), gradients formed in forward.

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
        family, own_start = pairs.family, pairs.transport.own_start_of(-1)
        block_keys, column_keys = with_local(keys, pairs.column_keys, pairs)
        grads = grads_for(queries, scale, want_query, want_scale, want_bias)
        key_grad = torch.zeros_like(block_keys, dtype=scale.dtype) if want_key else None
        any_grad = any(wanted)
        rows = scale.new_zeros(queries.shape[0])
        has_positive = torch.zeros(queries.shape[0], dtype=torch.bool, device=queries.device)
        for start, stop in chunks(queries.shape[0], pairs.chunk) if block_keys.shape[0] else []:
            chunk_queries = queries[start:stop]
            logits = block_logits(chunk_queries, block_keys, scale, bias)
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
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype, scale.dtype)
        ctx.mark_non_differentiable(has_positive)
        return (rows.sum() if weights is None else rows @ weights), has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        grads = tuple(None if grad is None else (grad * grad_total).to(dtype) for grad, dtype in saved)
        return (*grads, None, None, None)


