"""SigLIP's weighted sum in ring mode, its gradient formed in forward: a pair's term needs no row state.

A softmax row's logit gradient waits for every block (its maximum and sum), so ring mode forms it in
backward, receiving every block again (:mod:`._recomputed`: four products per block). A sigmoid
pair's, ``−z·σ(−z·l)·w``, is known the moment its block is formed: here each hop's block gives its
rows' terms, ``G K`` into the rows' gradient and ``Gᵀ Q`` into the keys' accumulator, which follows
its block home (:func:`~contrastive_dist.engine._ring.circulate`). Three products per block, as in
gather mode (:mod:`._fused`), and memory still independent of the number of ranks; backward only
scales what forward formed. Per-row losses (whose row weights come in backward) and
``torch.compile`` keep the recomputed path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block
from contrastive_dist.losses import _epilogue as epilogue
from contrastive_dist.losses._kernel import (
    Pairs,
    RowSums,
    accumulate,
    block_logits,
    block_rows,
    chunk_budget,
    chunks,
    first_order_only,
    formed_in_forward,
    gradients_wanted,
    grads_for,
    own_block,
    scaled,
)

__all__ = ["sigmoid_ring_pair_sum"]


def sigmoid_ring_pair_sum(
    queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs, weights: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``Σ_i w_i ℓ_i`` of a sigmoid loss over every block of the ring, gradients formed in forward.

    Returns:
        The weighted sum and, per row, whether it has a loss (every row: its negatives' terms).

    Shape:
        queries: ``(n, D)``; keys: ``(n_r, D)`` (this rank's block); scale, bias: ``()``; weights:
        ``(n,)``; outputs: ``()``, ``(n,)``.
    """
    wanted = gradients_wanted(queries, keys, scale, bias)
    return _SigmoidRing.apply(queries, keys, scale, bias, pairs, weights, wanted)  # type: ignore[no-any-return]


class _SigmoidRing(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs,
        weights: Tensor | None, wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor]:
        family, transport = pairs.family, pairs.transport
        want_query, want_key, want_scale, want_bias = wanted
        grads = grads_for(queries, scale, want_query, want_scale, want_bias)
        row_sums = family.empty_state(queries.shape[0], scale)
        budget, any_grad = chunk_budget(queries), any(wanted)
        bias_sums = RowSums(grads)  # the fused epilogue's row sums of G, over every chunk of every block

        def visit(owner: int, block: Block, key_grad: Tensor | None) -> None:
            block_keys, column_keys = block[0], block[1] if len(block) > 1 else None
            if block_keys.shape[0] == 0:
                return
            own_start = transport.own_start_of(owner)
            fast = epilogue.fused(pairs, queries, block_keys)
            row_indices = epilogue.row_indices(pairs, own_start, column_keys)
            for start, stop in chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget):
                row_weights = 1.0 if weights is None else weights[start:stop]
                if fast:  # one launch: the rows' sums and G (the fused epilogue reads the raw product)
                    logits = epilogue.raw_product(queries[start:stop], block_keys)
                    logit_grad = epilogue.grad_buffer(logits, queries, keep=False) if any_grad else None
                    indices = epilogue.chunk_of(row_indices, start, stop)
                    sums, grad_sums = epilogue.row_state(family, logits, scale, bias, indices, row_weights, logit_grad)
                    family.merge_(row_sums[start:stop], sums)
                    if logit_grad is not None and grad_sums is not None:
                        accumulate(logit_grad, queries[start:stop], block_keys, start, bias_sums.grads_for(grad_sums),
                                   key_grad)  # fmt: skip
                    continue
                logits = block_logits(queries[start:stop], block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                mask = targets.positive_mask(logits)
                family.merge_(row_sums[start:stop], family.block_state_(logits, targets, mask))
                if any_grad:
                    logit_grad = family.gradient_(logits, row_sums[start:stop], targets, mask, row_weights)
                    accumulate(logit_grad, queries[start:stop], block_keys, start, grads, key_grad)

        new_key_grad = None
        if want_key:
            key_rows, dim = pairs.key_rows, keys.shape[1]
            new_key_grad = lambda owner: scale.new_zeros((key_rows[owner], dim))  # noqa: E731
        key_grad = transport.run(own_block(keys, pairs.column_keys), block_rows(pairs), visit, new_key_grad)
        bias_sums.add()
        rows = family.finish(row_sums)
        total = rows.sum() if weights is None else rows @ weights
        query_grad, scale_grad = scaled(grads, queries, scale)
        if key_grad is not None:  # home with every rank's contribution: scaled once
            key_grad.mul_(scale)
        ctx.save_for_backward(query_grad, key_grad, scale_grad, grads.bias)
        ctx.dtypes = (queries.dtype, keys.dtype, scale.dtype, scale.dtype)
        has_positive = family.has_positive(row_sums)
        ctx.mark_non_differentiable(has_positive)
        return total, has_positive

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_total: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (*formed_in_forward(ctx, grad_total), None, None, None)
