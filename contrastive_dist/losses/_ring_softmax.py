"""Ring kernel of the softmax losses: per-row log-sum-exps over the global batch, keys travelling.

Query rows ``q_i`` stay on their rank; key blocks ``K_b`` travel round the ring (see
:mod:`._ring`). For the logits ``X = s · Q_r K_bᵀ`` of this rank's rows against one block it keeps:

* ``row_lse_i = logsumexp_j X_ij`` over every key of the global batch, merged across blocks with
  a log-add-exp (exact: no approximation, only the order of the merges changes rounding);
* with ``columns=True``, ``col_lse_j = logsumexp_i X_ij`` over every query of the global batch, for
  this rank's own keys: a column accumulator travels one hop behind its key block and comes
  home to the block's owner. One logit block then serves both directions of a symmetric loss
  (image→text rows, text→image columns), so each logit is computed once in all;
* with ``labels``, ``positive_sum_i = Σ_j [label_i = label_j] X_ij`` and the count of such ``j``
  (SupCon's positives; the labels travel with their keys).

With ``exclude_self`` the query and key rows are the same embeddings and each query's own key
(the diagonal of its own block) is left out. Logits are formed ``chunk_size`` rows at a time, so
at most ``chunk_size × max_b n_b`` exist at once; per-rank memory is ``O(n_r·D + chunk·max_b n_b)``,
independent of the number of ranks.

Backward recomputes each block's logits: the key block, its column log-sum-exps and their
upstream gradients travel round again with a key-gradient accumulator that comes home to the
owner; query, scale gradients stay local (their sum over ranks is the total). One product per
block forward, three backward. Storing the probabilities instead would cost ``n_r × N`` memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block, Ring, circulate
from contrastive_dist.losses._chunked import first_order_only

__all__ = ["ring_logsumexp"]


def ring_logsumexp(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    ring: Ring,
    *,
    rows_per_sample: int = 1,
    labels: Tensor | None = None,
    exclude_self: bool = False,
    columns: bool = False,
    column_sizes: tuple[int, ...] | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row (and column) log-sum-exps of ``s · Q Kᵀ`` over the global batch; see the module docstring.

    Args:
        queries: this rank's query rows (stay here).
        keys: this rank's key rows (travel); with ``exclude_self`` or ``labels``, the same rows as ``queries``.
        scale: the logit multiplier ``s``, a 0-d tensor in the queries' dtype.
        ring: this rank's place in the ring; ``ring.sizes`` counts samples.
        rows_per_sample: key rows per sample (2 for NT-Xent's two views, ``V`` for SupCon).
        labels: one integer label per key row (SupCon), or ``None``.
        exclude_self: leave out each query's own key.
        columns: also return the column log-sum-exps of this rank's keys.
        column_sizes: with ``columns``, how many leading key rows of each rank's block are columns
            (InfoNCE's texts, before the rank's own negatives, which are image→text only); default: all.
        chunk_size: query rows per logit block (``None``: all at once).

    Returns:
        ``(row_lse, col_lse, positive_sum, positive_count)``; the last three are empty when not asked for.

    Shape:
        queries, keys: ``(m_r, D)``; scale: ``()``; labels: ``(m_r,)``; outputs: ``(m_r,)``.

    Example:
        >>> import torch
        >>> from contrastive_dist.engine._ring import Ring
        >>> queries, keys = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
        >>> row_lse, col_lse, _, _ = ring_logsumexp(queries, keys, torch.tensor(2.0).double(), Ring(0, 1, (5,)),
        ...                                         columns=True, chunk_size=2)
        >>> logits = 2.0 * queries @ keys.T
        >>> torch.allclose(row_lse, logits.logsumexp(1)), torch.allclose(col_lse, logits.logsumexp(0))
        (True, True)
    """
    chunk = chunk_size or max(queries.shape[0], 1)
    wanted = tuple(torch.is_grad_enabled() and t.requires_grad for t in (queries, keys, scale))
    column_rows = None
    if columns:
        column_rows = column_sizes or tuple(size * rows_per_sample for size in ring.sizes)
    options = (ring, rows_per_sample, labels, exclude_self, column_rows, chunk, wanted)
    return _RingLogSumExp.apply(queries, keys, scale, options)  # type: ignore[no-any-return]


def _key_block(ring: Ring, owner: int, rows_per_sample: int, like: Tensor, width: int) -> Tensor:
    return like.new_empty((ring.sizes[owner] * rows_per_sample, width))


def _logits(queries: Tensor, keys: Tensor, scale: Tensor, start: int, own_diagonal: bool) -> Tensor:
    """Logits of one chunk of query rows (from ``start``) against one key block; own key at ``-inf``."""
    logits = (queries * scale) @ keys.T
    if own_diagonal:
        rows = torch.arange(queries.shape[0], device=logits.device)
        logits[rows, rows + start] = float("-inf")
    return logits


def _same_label(query_labels: Tensor, key_labels: Tensor, start: int, own_diagonal: bool) -> Tensor:
    mask = query_labels[:, None] == key_labels[None, :]
    if own_diagonal:
        rows = torch.arange(query_labels.shape[0], device=mask.device)
        mask[rows, rows + start] = False
    return mask


class _RingLogSumExp(torch.autograd.Function):
    """Ring pass forward (row/column log-sum-exps), ring pass backward (recomputed logits)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, options: tuple[Any, ...]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ring, rows_per_sample, labels, exclude_self, column_rows, chunk, _ = options
        width = keys.shape[1]
        row_lse = queries.new_full((queries.shape[0],), float("-inf"))
        positive_sum = queries.new_zeros(queries.shape[0] if labels is not None else 0)
        positive_count = torch.zeros_like(positive_sum, dtype=torch.long)

        def visit(owner: int, block: Block, column_lse: Tensor | None) -> None:
            block_keys, block_labels = block[0], block[1] if labels is not None else None
            own_diagonal = exclude_self and owner == ring.rank
            for start in range(0, queries.shape[0], chunk):
                stop = min(start + chunk, queries.shape[0])
                logits = _logits(queries[start:stop], block_keys, scale, start, own_diagonal)
                if block_labels is not None:
                    mask = _same_label(labels[start:stop], block_labels, start, own_diagonal)
                    positive_sum[start:stop] += torch.where(mask, logits, 0.0).sum(dim=1)
                    positive_count[start:stop] += mask.sum(dim=1)
                if column_lse is not None:
                    column_logits = logits[:, : column_lse.shape[0]]
                    torch.logaddexp(column_lse, torch.logsumexp(column_logits, dim=0), out=column_lse)
                torch.logaddexp(row_lse[start:stop], torch.logsumexp(logits, dim=1), out=row_lse[start:stop])

        own = (keys.contiguous(),) if labels is None else (keys.contiguous(), labels.contiguous())

        def new_block(owner: int) -> Block:
            block_keys = _key_block(ring, owner, rows_per_sample, keys, width)
            if labels is None:
                return (block_keys,)
            return block_keys, labels.new_empty(block_keys.shape[0])

        def new_column_lse(owner: int) -> Tensor:
            return queries.new_full((column_rows[owner],), float("-inf"))

        col_lse = circulate(
            ring, own, new_block, visit, new_accumulator=new_column_lse if column_rows is not None else None
        )
        if col_lse is None:
            col_lse = queries.new_zeros(0)
        ctx.save_for_backward(queries, keys, scale, row_lse, col_lse, positive_count)
        ctx.options = options
        ctx.mark_non_differentiable(positive_count)
        return row_lse, col_lse, positive_sum, positive_count

    @staticmethod
    @first_order_only
    def backward(  # type: ignore[override]
        ctx: Any, row_grad: Tensor, col_grad: Tensor, positive_grad: Tensor, _: Tensor
    ) -> tuple[Tensor | None, ...]:
        queries, keys, scale, row_lse, col_lse, _count = ctx.saved_tensors
        ring, rows_per_sample, labels, exclude_self, column_rows, chunk, wanted = ctx.options
        want_query, want_key, want_scale = wanted
        width = keys.shape[1]
        query_grad = torch.zeros_like(queries)
        scale_grad = queries.new_zeros(())
        # What the other ranks need of a block: its keys, [column lse, column grad] (symmetric),
        # labels (SupCon); the keys travel as they are (no packed copy of an n × D block).
        own_block: Block = (keys.contiguous(),)
        if column_rows is not None:
            own_block += (torch.stack((col_lse, col_grad), dim=1),)
        if labels is not None:
            own_block += (labels.contiguous(),)

        def new_block(owner: int) -> Block:
            block_keys = _key_block(ring, owner, rows_per_sample, keys, width)
            block: Block = (block_keys,)
            if column_rows is not None:
                block += (keys.new_empty(column_rows[owner], 2),)
            if labels is not None:
                block += (labels.new_empty(block_keys.shape[0]),)
            return block

        def visit(owner: int, block: Block, key_grad: Tensor | None) -> None:
            block_keys = block[0]
            own_diagonal = exclude_self and owner == ring.rank
            for start in range(0, queries.shape[0], chunk):
                stop = min(start + chunk, queries.shape[0])
                chunk_queries = queries[start:stop]
                logits = _logits(chunk_queries, block_keys, scale, start, own_diagonal)
                # d row_lse / d X = softmax over the row; d col_lse / d X = softmax over the column.
                # The row term reuses the logits' memory: two c × n_b buffers at most.
                column_term = None
                if column_rows is not None:
                    block_col_lse, block_col_grad = block[1][:, 0], block[1][:, 1]
                    column_logits = logits[:, : block_col_lse.shape[0]]
                    column_term = (column_logits - block_col_lse[None, :]).exp_().mul_(block_col_grad[None, :])
                logit_grad = logits.sub_(row_lse[start:stop, None]).exp_().mul_(row_grad[start:stop, None])
                if column_term is not None:
                    logit_grad[:, : column_term.shape[1]] += column_term
                    del column_term
                if labels is not None:
                    mask = _same_label(labels[start:stop], block[-1], start, own_diagonal)
                    logit_grad += mask * positive_grad[start:stop, None]
                if want_query or want_scale:
                    weighted_keys = logit_grad @ block_keys
                    query_grad[start:stop] += weighted_keys * scale
                    scale_grad.add_((chunk_queries * weighted_keys).sum())
                if key_grad is not None:
                    key_grad.addmm_(logit_grad.T, chunk_queries * scale)

        def new_key_grad(owner: int) -> Tensor:
            return _key_block(ring, owner, rows_per_sample, keys, width).zero_()

        # A frozen key tower (no key gradient; the same on every rank, as the size exchange checked)
        # sends no accumulator and skips its product.
        key_grad = circulate(ring, own_block, new_block, visit, new_accumulator=new_key_grad if want_key else None)
        return (
            query_grad if want_query else None,
            key_grad if want_key else None,
            scale_grad if want_scale else None,
            None,
        )
