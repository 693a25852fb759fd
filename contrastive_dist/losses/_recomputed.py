"""The rows' losses over every block a transport brings; backward meets every block again.

Forward merges each block's contribution into the rows' running states (and, for ring mode's
symmetric losses, into the travelling states of the block's own columns: one logit block serves
both directions). Backward forms each block's gradient from the final states, with the upstream
gradients as row weights; the keys' gradient follows its block home. Used by ring mode always, and
by gather mode for per-row losses (whose key gradient mixes every row's upstream gradient, known
only in backward).

**Kept or recomputed.** Gather mode's per-row losses keep their block when it is small enough
(``chunk_size=None`` and at most :data:`~._kernel.BLOCK_LOGITS` logits, :func:`keeps`): backward
moves the numerators onto the rows' final state (a rescaling, no product), three products in all.
Otherwise, and always in ring mode (whose memory does not grow with the number of ranks), backward
meets every block again and recomputes its logits: four. Blocks on the fused epilogue (CUDA,
:mod:`._epilogue`) are recomputed too: kept, a block's numerators cost ~57 bytes per logit of memory
traffic (SigLIP, bf16, counted by ``tests/test_traffic.py``) against ~13 recomputed, which on a GPU
outweighs the fourth product.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block
from contrastive_dist.losses import _epilogue as epilogue
from contrastive_dist.losses._columns import OneBlock
from contrastive_dist.losses._kernel import (
    BLOCK_LOGITS,
    LOCAL,
    Grads,
    Pairs,
    RowSums,
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
from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._symmetric import ColumnBlock, column_block, column_gradient
from contrastive_dist.losses._symmetric import column_state as column_state_of
from contrastive_dist.losses._targets import Targets

__all__ = ["keeps", "pair_losses"]


def pair_losses(
    queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's loss ``ℓ_i`` over every block the transport brings; gradients formed in backward.

    Returns:
        ``(rows, columns, has_positive)``: the rows' losses ``(n,)``; with :attr:`Pairs.columns`, the
        losses of this rank's own columns ``(columns[rank],)`` from the same logits (else empty);
        whether each row has a loss ``(n,)``.

    Shape:
        queries: ``(n, D)``; keys: ``(m, D)`` (the transport's block); scale, bias: ``()``.
    """
    wanted = gradients_wanted(queries, keys, scale, bias)
    return _Recomputed.apply(queries, keys, scale, bias, pairs, wanted)  # type: ignore[no-any-return]


def keeps(pairs: Pairs) -> bool:
    """Whether a call keeps its blocks for backward instead of recomputing them.

    Gather mode's per-row losses with ``chunk_size=None``, when the numerators of the largest rank's
    rows (both directions' for a symmetric loss) fit :data:`~._kernel.BLOCK_LOGITS`, as gather mode's
    one block does; never under ``torch.compile``. Ring mode never keeps: its memory does not grow with
    the number of ranks (kept, its blocks would: measured, keeping them took ring mode's CLIP loss 0.8×
    the time and 1.6–2.8× the memory per rank at W = 2 and 4).

    Example:
        >>> from contrastive_dist.losses._columns import OneBlock
        >>> from contrastive_dist.losses._kernel import SOFTMAX, Pairs
        >>> from contrastive_dist.losses._targets import RowTargets
        >>> pairs = Pairs(SOFTMAX, RowTargets(), OneBlock(0), None, key_rows=(1024, 1024, 1024, 1024))
        >>> keeps(pairs), keeps(pairs._replace(chunk=256)), keeps(pairs._replace(key_rows=(8192,) * 4))
        (True, False, False)
    """
    if pairs.chunk is not None or torch.compiler.is_compiling() or not isinstance(pairs.transport, OneBlock):
        return False
    columns = sum(pairs.key_rows) + (0 if pairs.local_keys is None else pairs.local_keys.shape[0])
    directions = 1 if pairs.columns is None else 2
    return directions * max(pairs.key_rows) * columns <= BLOCK_LOGITS


class _Kept(NamedTuple):
    """One chunk of one block, as forward left it for backward.

    Attributes:
        values: ``(c, m)`` the rows' numerators (softmax) or margins (sigmoid) against ``partial``.
        partial: ``(c, width)`` the rows' state over this chunk alone; ``None``: against the final state.
        targets, mask: the chunk's targets and positives by key.
        columns: the columns' side (symmetric losses): numerators against ``column_partial``, or logits
            (``column_partial`` ``None``).
    """

    values: Tensor
    partial: Tensor | None
    targets: Targets
    mask: SameKey | None
    columns: ColumnBlock | None = None
    column_partial: Tensor | None = None


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None, pairs: Pairs,
        wanted: tuple[bool, bool, bool, bool],
    ) -> tuple[Tensor, Tensor, Tensor]:
        family, transport = pairs.family, pairs.transport
        row_state = family.empty_state(queries.shape[0], scale)
        keep = keeps(pairs) and not epilogue.fused(pairs, queries, keys)  # the fused epilogue keeps no numerators
        kept: dict[int, tuple[Block, list[_Kept]]] = {}

        def visit(owner: int, block: Block, column_state: Tensor | None) -> None:
            block_keys, column_keys = block[0], block[1] if len(block) > 1 else None
            if block_keys.shape[0] == 0:
                return
            own_start = transport.own_start_of(owner) if owner != LOCAL else None
            parts: list[_Kept] = []
            budget = chunk_budget(queries)
            spans = chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget)
            if epilogue.fused(pairs, queries, block_keys):
                _fused_states(pairs, queries, block_keys, column_keys, scale, bias, own_start, spans, row_state,
                              column_state)  # fmt: skip
                return
            for start, stop in spans:
                logits = block_logits(queries[start:stop], block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                columns, column_partial = None, None
                if column_state is not None and column_state.shape[0]:
                    columns = column_block(pairs, logits, own_start, start, stop, targets, column_state.shape[0])
                    column_partial = column_state_of(pairs, columns)
                    family.merge_(column_state, column_partial)
                mask = targets.positive_mask(logits)
                chunk_state = family.block_state_(logits, targets, mask)
                family.merge_(row_state[start:stop], chunk_state)
                if keep:
                    parts.append(_Kept(logits, chunk_state, targets, mask, columns, column_partial))
            if keep:
                kept[owner] = (block, parts)

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
        ctx.pairs, ctx.wanted, ctx.kept = pairs, wanted, kept if keep else None
        has_positive = family.has_positive(row_state)
        ctx.mark_non_differentiable(has_positive)
        return family.finish(row_state), family.finish(own_columns), has_positive

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, row_grad: Tensor, column_grad: Tensor, _: Tensor
    ) -> tuple[Tensor | None, ...]:
        queries, keys, scale, bias, row_state, column_state = ctx.saved_tensors
        pairs, kept = ctx.pairs, ctx.kept
        ctx.kept = None  # the numerators are used up (turned into gradients) below
        want_query, want_key, want_scale, want_bias = ctx.wanted
        family, transport = pairs.family, pairs.transport
        grads = grads_for(queries, scale, want_query, want_scale, want_bias)
        symmetric = pairs.columns is not None

        def recomputed(owner: int, block: Block, columns_here: Tensor | None) -> Iterator[_Kept]:
            """The block's chunks as forward formed them, one at a time: their logits again, as numerators."""
            block_keys, column_keys = block[0], block[1] if len(block) > 1 else None
            own_start = transport.own_start_of(owner) if owner != LOCAL else None
            budget = chunk_budget(queries)
            for start, stop in chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget):
                logits = block_logits(queries[start:stop], block_keys, scale, bias)
                targets = pairs.rows.block(own_start, start, stop, column_keys)
                columns = None
                if columns_here is not None and columns_here.shape[0]:
                    columns = column_block(pairs, logits, own_start, start, stop, targets, columns_here.shape[0])
                mask = targets.positive_mask(logits)
                family.numerators_(logits, row_state[start:stop], targets, mask)
                yield _Kept(logits, None, targets, mask, columns)

        def visit(owner: int, block: Block, key_grad: Tensor | None) -> None:
            columns_here = block[-1] if symmetric and owner != LOCAL else None
            parts: Iterable[_Kept]
            if kept is not None:
                if owner not in kept:
                    return  # an empty block
                block, parts = kept[owner]
            else:
                block = block[:-1] if columns_here is not None else block
                if block[0].shape[0] == 0:
                    return
                parts = recomputed(owner, block, columns_here)
            block_keys = block[0]
            budget = chunk_budget(queries)
            spans = chunks(queries.shape[0], pairs.chunk, block_keys.shape[0], budget=budget)
            if kept is None and epilogue.fused(pairs, queries, block_keys):
                own_start = transport.own_start_of(owner) if owner != LOCAL else None
                column_keys = block[1] if len(block) > 1 else None
                _fused_gradients(pairs, queries, block_keys, column_keys, scale, bias, own_start, spans, row_state,
                                 row_grad, columns_here, grads, key_grad)  # fmt: skip
                return
            for (start, stop), part in zip(spans, parts, strict=True):
                chunk_state = row_state[start:stop]
                values = part.values if part.partial is None else family.rebase_(part.values, part.partial, chunk_state)
                logit_grad = family.gradient_(values, chunk_state, part.targets, part.mask, row_grad[start:stop])
                if part.columns is not None and columns_here is not None:
                    state, upstream = columns_here[:, :-1], columns_here[:, -1]
                    column_logit_grad = column_gradient(pairs, part.columns, state, upstream, part.column_partial)
                    logit_grad[:, : column_logit_grad.shape[0]] += column_logit_grad.T
                accumulate(logit_grad, queries[start:stop], block_keys, start, grads, key_grad)

        own: Block = () if kept is not None else own_block(keys, pairs.column_keys)
        rows = [] if kept is not None else block_rows(pairs)
        if symmetric:
            upstream = transport.block_columns(column_grad.to(column_state.dtype), pairs.columns)
            own = (*own, torch.cat((column_state, upstream[:, None]), dim=1))
            rows.append(pairs.columns)
        new_key_grad = None
        if want_key:
            key_rows = pairs.key_rows
            new_key_grad = lambda owner: scale.new_zeros(  # noqa: E731
                (keys.shape[0] if owner < 0 else key_rows[owner], keys.shape[1])
            )
        key_grad = transport.run(own, rows, visit, new_key_grad)
        if pairs.local_keys is not None:
            visit(LOCAL, own_block(pairs.local_keys.to(keys.dtype), pairs.local_column_keys), None)
        query_grad, scale_grad = scaled(grads, queries, scale)
        if key_grad is not None:  # home with every rank's contribution: scaled once
            key_grad.mul_(scale)
        return as_input(query_grad, queries), as_input(key_grad, keys), scale_grad, grads.bias, None, None


def _fused_states(
    pairs: Pairs, queries: Tensor, block_keys: Tensor, column_keys: Tensor | None, scale: Tensor, bias: Tensor | None,
    own_start: int | None, spans: list[tuple[int, int]], row_state: Tensor, column_state: Tensor | None,
) -> None:  # fmt: skip
    """One block's states on the fused epilogue, merged into the rows' (and the columns') running states.

    Each chunk's raw product gives its rows' state and its columns' partial state, one launch each;
    both are merged once per block (a merge is a dozen small launches).
    """
    family, row_indices = pairs.family, epilogue.row_indices(pairs, own_start, column_keys)
    columns = 0 if column_state is None else column_state.shape[0]
    row_parts, column_parts = [], []
    for start, stop in spans:
        product = epilogue.raw_product(queries[start:stop], block_keys)
        if columns:
            indices = epilogue.column_indices(pairs, start, stop, own_start, column_keys, columns)
            column_parts.append(epilogue.row_state(family, product[:, :columns].T, scale, bias, indices, 1.0, None)[0])
        indices = epilogue.chunk_of(row_indices, start, stop)
        row_parts.append(epilogue.row_state(family, product, scale, bias, indices, 1.0, None)[0])
    if row_parts:  # (none on a rank without rows)
        family.merge_(row_state, torch.cat(row_parts))
    if column_state is not None and column_parts:
        family.merge_(column_state, family.merged(torch.stack(column_parts)))


def _fused_gradients(
    pairs: Pairs, queries: Tensor, block_keys: Tensor, column_keys: Tensor | None, scale: Tensor, bias: Tensor | None,
    own_start: int | None, spans: list[tuple[int, int]], row_state: Tensor, row_grad: Tensor,
    columns_here: Tensor | None, grads: Grads, key_grad: Tensor | None,
) -> None:  # fmt: skip
    """One block's gradients on the fused epilogue, then its products.

    Each chunk's raw product again; ``G`` of its rows (and of the columns, added on) in one launch
    each, from their final states, the upstream gradients as row weights.
    """
    family, row_indices = pairs.family, epilogue.row_indices(pairs, own_start, column_keys)
    columns = 0 if columns_here is None else columns_here.shape[0]
    if columns_here is not None and columns:  # the columns' final states and upstream gradients, travelling
        column_state, upstream = columns_here[:, :-1].contiguous(), columns_here[:, -1].to(torch.float32).contiguous()
    row_sums = RowSums(grads)
    # The ops' row weights (float32, contiguous) once a block, not a copy per chunk: an upstream gradient
    # is often an expanded one (``loss.sum().backward()``).
    row_weights = row_grad.to(torch.float32).contiguous()
    for start, stop in spans:
        product = epilogue.raw_product(queries[start:stop], block_keys)
        logit_grad = epilogue.grad_buffer(product, queries, keep=columns > 0)
        indices = epilogue.chunk_of(row_indices, start, stop)
        grad_sums = epilogue.gradient(family, product, scale, bias, row_state[start:stop], indices,
                                      row_weights[start:stop], logit_grad)  # fmt: skip
        if columns:
            indices = epilogue.column_indices(pairs, start, stop, own_start, column_keys, columns)
            epilogue.gradient(family, product[:, :columns].T, scale, bias, column_state, indices, upstream,
                              logit_grad[:, :columns].T, accumulate=True)  # fmt: skip
        accumulate(logit_grad, queries[start:stop], block_keys, start, row_sums.grads_for(grad_sums), key_grad)
    row_sums.add()
