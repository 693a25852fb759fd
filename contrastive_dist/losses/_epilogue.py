"""Which epilogue a block takes: a fused Triton op (:mod:`._triton`) or the family's eager chain.

A block's epilogue is everything between its product and the products of its gradient: the
logits' scale and bias, the rows' state, the logit gradient ``G``. On CUDA, for float32 or bfloat16
features, it is one fused launch that reads the raw product ``P = Q Kᵀ`` and writes ``G`` (in
bfloat16 for bfloat16 features): 6–12 bytes per logit instead of the eager chain's 40–130. Keys
(SupCon's labels, sample ids) take it too: they are compared in the kernel, tile by tile, never
formed as a mask. Every path takes it: gather mode's gradients formed in forward (:mod:`._fused`),
the recomputed path of ring mode and per-row losses (:mod:`._recomputed`: the states in forward,
``G`` in backward) and SigLIP's ring (:mod:`._sigmoid_ring`). Everything else (DCL, a float32 queue
beside half features, float16) takes the eager chain, which stays the reference: the same numbers
to float32 rounding (``tests/test_triton_epilogue.py``, ``tests/test_losses_fused_epilogue.py``).
``CONTRASTIVE_DIST_EPILOGUE`` chooses (see :data:`._triton.EPILOGUE_VARIABLE`).

float16 features keep the eager chain: their logit gradient, rounded with the row weights folded
in, needs the power-of-two scaling of :func:`._kernel.accumulate`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._kernel import DECOUPLED, SIGMOID, Family, Pairs
from contrastive_dist.losses._precision import product

__all__ = ["chunk_of", "column_indices", "fused", "grad_buffer", "gradient", "raw_product", "row_indices", "row_state"]


_EPILOGUE_VARIABLE = "CONTRASTIVE_DIST_EPILOGUE"  # read here too, so that CPU runs never import Triton


def fused(pairs: Pairs, queries: Tensor, keys: Tensor) -> bool:
    """Whether ``pairs``' blocks of ``queries`` against ``keys`` take the fused epilogue."""
    if queries.dtype != keys.dtype or pairs.family is DECOUPLED:
        return False  # a block held in another dtype (a float32 queue), DCL: the eager chain
    if queries.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not queries.is_cuda and os.environ.get(_EPILOGUE_VARIABLE) != "triton":
        return False
    from contrastive_dist.losses import _triton

    return _triton.available(queries)


def raw_product(queries: Tensor, keys: Tensor) -> Tensor:
    """``P = Q Kᵀ`` in float32, no scale: the fused epilogue forms the logits itself."""
    return product(queries, keys.T)


class Indices(NamedTuple):
    """A block's rows' targets, as the fused ops take them.

    Attributes:
        positive, excluded: ``(c,)`` int64 each row's positive and excluded column (outside the block, or
            ``None``: none).
        row_keys: ``(c,)`` the rows' keys, with ``column_keys`` ``(k,)`` those of the block's first ``k``
            columns; ``None``: no keys.
        column_keys: see ``row_keys``.
        keys_positive: pairs that share a key are positives (else they leave the row's candidates).
        positive_shift: subtracted from ``positive`` in the kernel (a chunk's first row, for the columns'
            direction): no launch per chunk to shift the indices.
    """

    positive: Tensor | None
    excluded: Tensor | None
    row_keys: Tensor | None = None
    column_keys: Tensor | None = None
    keys_positive: bool = False
    positive_shift: int = 0

    def options(self) -> dict[str, object]:
        """The ops' keyword arguments: the keys, what equal keys mean, the positives' shift."""
        shared = {"keys_positive": self.keys_positive, "positive_shift": self.positive_shift}
        if self.row_keys is None or self.column_keys is None:
            return {"row_keys": None, "column_keys": None, **shared}
        row_keys, column_keys = self.row_keys.contiguous(), self.column_keys.contiguous()  # (a column that travelled)
        return {"row_keys": row_keys, "column_keys": column_keys, **shared}


def row_indices(pairs: Pairs, own_start: int | None, column_keys: Tensor | None = None) -> Indices:
    """Every row's targets in a block whose own columns start at ``own_start`` and whose keys are ``column_keys``.

    An entry outside the block (another rank's block, ``own_start`` ``None``) is none.
    """
    rows = pairs.rows
    positive, excluded = (None if index is None or own_start is None else index + own_start
                          for index in (rows.positive, rows.excluded))  # fmt: skip
    return Indices(positive, excluded, rows.keys, column_keys, rows.key_rule == "positive")


def chunk_of(indices: Indices, start: int, stop: int) -> Indices:
    """The rows ``start:stop`` of :func:`row_indices`."""
    positive, excluded, row_keys = (None if index is None else index[start:stop] for index in indices[:3])
    return indices._replace(positive=positive, excluded=excluded, row_keys=row_keys)


def column_indices(pairs: Pairs, start: int, stop: int, own_start: int | None, column_keys: Tensor | None,
                   columns: int) -> Indices:  # fmt: skip
    """The targets of a block's first ``columns`` columns against its rows ``start:stop``, for the columns' direction.

    Each column's positive is among those rows only in this rank's own block (``own_start`` not
    ``None``; elsewhere, or outside the chunk: none), shifted by ``start`` in the kernel; a column
    excludes no row. Keys swap sides.
    """
    rows = pairs.rows
    column_positive = rows.column_positive
    positive = None if column_positive is None or own_start is None else column_positive
    row_keys = None if rows.keys is None else rows.keys[start:stop]
    keys = None if column_keys is None else column_keys[:columns]
    return Indices(positive, None, keys, row_keys, rows.key_rule == "positive", start)


def grad_buffer(logits: Tensor, queries: Tensor, *, keep: bool) -> Tensor:
    """Where the fused epilogue writes ``G``: a buffer in the features' dtype, or the float32 product.

    The product itself unless it is still needed (``keep``: the columns' direction reads it after the rows').
    """
    if queries.dtype != torch.float32 or keep:
        return logits.new_empty(logits.shape, dtype=queries.dtype)
    return logits


def row_state(
    family: Family,
    logits: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    indices: Indices,
    weights: Tensor | float,
    grad: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The rows' state over one block (``logits``: the raw product) and, with ``grad``, their logit gradient.

    ``indices``: the rows' positive and excluded columns (:func:`row_indices`). ``grad`` receives
    ``G`` weighted by ``weights`` (gather mode: the block is every column, the state final);
    ``None``: the state only. Returns the state and, for the sigmoid family, ``Σ_j G_ij``.
    """
    from contrastive_dist.losses import _triton

    positive, excluded, options = indices.positive, indices.excluded, indices.options()
    row_weights = _weights(weights)
    if family is SIGMOID:
        sums, grad_sums = _triton.sigmoid_block(logits, scale, bias, positive, excluded, row_weights, grad, **options)
        return sums[:, None], grad_sums if grad is not None else None
    if grad is None:
        return _triton.softmax_state(logits, scale, bias, positive, excluded, **options), None
    return _triton.softmax_block(logits, scale, bias, positive, excluded, row_weights, grad, **options), None


def gradient(
    family: Family,
    logits: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    state: Tensor,
    indices: Indices,
    weights: Tensor | float,
    grad: Tensor,
    *,
    accumulate: bool = False,
) -> Tensor | None:
    """``G`` of one block from the rows' final ``state``, into ``grad`` (added to it with ``accumulate``).

    Returns ``Σ_j G_ij`` for the sigmoid family (the bias's gradient), else ``None``.
    """
    from contrastive_dist.losses import _triton

    positive, excluded, options = indices.positive, indices.excluded, indices.options()
    row_weights = _weights(weights)
    if family is SIGMOID:  # a row's pair terms need no state; no columns' direction adds onto them
        return _triton.sigmoid_block(logits, scale, bias, positive, excluded, row_weights, grad, **options)[1]
    _triton.softmax_grad(logits, scale, bias, state, positive, excluded, row_weights, grad, accumulate=accumulate,
                         **options)  # fmt: skip
    return None


def _weights(weights: Tensor | float) -> Tensor | None:
    """Row weights as the ops take them: a float32 vector, or ``None`` for all 1."""
    if isinstance(weights, Tensor):
        return weights.to(torch.float32).contiguous()
    if weights == 1.0:
        return None
    raise ValueError(f"the fused epilogue takes per-row weights or 1, got {weights!r}")
