"""The rows' losses over every block a transport brings; backward meets every block again, recomputed.

Forward merges each block's contribution into the rows' running states (and, for ring mode's
symmetric losses, into the travelling states of the block's own columns: one logit block serves
both directions). Backward recomputes each block's logits and forms its gradient from the final
states, with the upstream gradients as row weights; the keys' gradient follows its block home.
Used by ring mode always, and by gather mode for per-row losses (whose key gradient mixes every
row's upstream gradient, known only in backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block
from contrastive_dist.losses._kernel import (
    LOCAL,
    Pairs,
    accumulate,
    as_input,
    block_logits,
    block_rows,
    chunk_budget,
    chunks,
    first_order_only,
    gradients_wanted,
    grads_for,
    own_block,
    scaled,
)
from contrastive_dist.losses._symmetric import column_block, column_gradient
from contrastive_dist.losses._symmetric import column_state as column_state_of

__all__ = ["pair_losses"]


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
    wanted = gradients_wanted(queries, keys, scale, bias)
    return _Recomputed.apply(queries, keys, scale, bias, pairs, wanted)  # type: ignore[no-any-return]


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs,
        wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor, Tensor]:
        family, transport = pairs.family, pairs.transport
        row_state = family.empty_state(queries.shape[0], scale)

        def visit(owner: int, block: Block, column_state: Tensor | None) -> None:
            block_keys, column_keys = block[0], block[1] if len(block) > 1 else None
            if block_keys.shape[0] == 0:
                return
            own_start = transport.own_start_of(owner) if owner != LOCAL else None
            budget = chunk_budget(queries)
            for start, stop in chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget):
                logits = block_logits(queries[start:stop], block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                if column_state is not None and column_state.shape[0]:
                    columns = column_block(pairs, logits, own_start, start, stop, targets, column_state.shape[0])
                    family.merge_(column_state, column_state_of(pairs, columns))
                chunk_state = family.block_state_(logits, targets, targets.positive_mask(logits))
                family.merge_(row_state[start:stop], chunk_state)

        own = own_block(keys, pairs.column_keys)
        new_column_state = None
        if pairs.columns is not None:
            columns = pairs.columns
            new_column_state = lambda owner: family.empty_state(transport.columns_in(owner, columns), scale)  # noqa: E731
        column_state = transport.run(own, block_rows(pairs), visit, new_column_state, family.merge_)
        if pairs.local_keys is not None:
            visit(LOCAL, own_block(pairs.local_keys.to(keys.dtype), pairs.local_column_keys), None)
        if column_state is None or pairs.columns is None:
            column_state, own_columns = family.empty_state(0, scale), family.empty_state(0, scale)
        else:
            column_state = transport.complete_columns(column_state, pairs.columns, family.merged)
            own_columns = transport.own_columns(column_state, pairs.columns)
        ctx.save_for_backward(queries, keys, scale, bias, row_state, column_state)
        ctx.pairs, ctx.wanted = pairs, wanted
        has_positive = family.has_positive(row_state)
        ctx.mark_non_differentiable(has_positive)
        return family.finish(row_state), family.finish(own_columns), has_positive

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, row_grad: Tensor, column_grad: Tensor, _: Tensor
    ) -> tuple[Tensor | None, ...]:
        queries, keys, scale, bias, row_state, column_state = ctx.saved_tensors
        pairs = ctx.pairs
        want_query, want_key, want_scale, want_bias = ctx.wanted
        family, transport = pairs.family, pairs.transport
        grads = grads_for(queries, scale, want_query, want_scale, want_bias)
        symmetric = pairs.columns is not None

        def visit(owner: int, block: Block, key_grad: Tensor | None) -> None:
            block_keys, column_keys = block[0], block[1] if len(block) > 1 + symmetric else None
            if block_keys.shape[0] == 0:
                return
            own_start = transport.own_start_of(owner) if owner != LOCAL else None
            columns_here = block[-1] if symmetric and owner != LOCAL else None
            if owner == LOCAL:
                column_keys = block[1] if len(block) > 1 else None
            budget = chunk_budget(queries)
            for start, stop in chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget):
                chunk_queries = queries[start:stop]
                logits = block_logits(chunk_queries, block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                column_logit_grad = None
                if columns_here is not None and columns_here.shape[0]:
                    state, upstream = columns_here[:, :-1], columns_here[:, -1]
                    columns = column_block(pairs, logits, own_start, start, stop, targets, columns_here.shape[0])
                    column_logit_grad = column_gradient(pairs, columns, state, upstream)
                mask = targets.positive_mask(logits)
                chunk_state = row_state[start:stop]
                family.numerators_(logits, chunk_state, targets, mask)
                logit_grad = family.gradient_(logits, chunk_state, targets, mask, row_grad[start:stop])
                if column_logit_grad is not None:
                    logit_grad[:, : column_logit_grad.shape[0]] += column_logit_grad.T
                accumulate(logit_grad, chunk_queries, block_keys, start, grads, key_grad)

        own = own_block(keys, pairs.column_keys)
        if symmetric:
            upstream = transport.block_columns(column_grad.to(column_state.dtype), pairs.columns)
            own = (*own, torch.cat((column_state, upstream[:, None]), dim=1))
        new_key_grad = None
        if want_key:
            key_rows = pairs.key_rows
            new_key_grad = lambda owner: scale.new_zeros(  # noqa: E731
                (keys.shape[0] if owner < 0 else key_rows[owner], keys.shape[1])
            )
        key_grad = transport.run(own, block_rows(pairs, with_columns=symmetric), visit, new_key_grad)
        if pairs.local_keys is not None:
            visit(LOCAL, own_block(pairs.local_keys.to(keys.dtype), pairs.local_column_keys), None)
        query_grad, scale_grad = scaled(grads, queries, scale)
        if key_grad is not None:  # home with every rank's contribution: scaled once
            key_grad.mul_(scale)
        return as_input(query_grad, queries), as_input(key_grad, keys), scale_grad, grads.bias, None, None


