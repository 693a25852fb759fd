"""The fused epilogue: a visit's product through one Triton op per direction (:mod:`._triton`, CUDA).

Everything between a visit's product and its gradient's products — the logits' scale and bias, the
rows' state, the logit gradient ``G`` — is one launch that reads the raw product ``P = Q Kᵀ`` and
writes ``G`` (in bfloat16 for bfloat16 features): 6–12 bytes per logit instead of the eager chain's
40–130. Keys (SupCon's labels, sample ids) are compared in the kernel, tile by tile, never formed as a
mask. :class:`Fused` is the driver's :class:`~._visit.Epilogue` on these ops; :func:`fused` says where
it serves: CUDA features of float32 or bfloat16, the softmax and sigmoid families. DCL's family, a
float32 queue beside half features and float16 (whose logit gradient, rounded with the row weights
folded in, needs the power-of-two scaling of :func:`._visit.accumulate`) keep the eager epilogue, which
stays the reference: the same numbers to float32 rounding (``tests/test_triton_epilogue.py``,
``tests/test_losses_fused_epilogue.py``). ``CONTRASTIVE_DIST_EPILOGUE`` chooses (:data:`._epilogue.EPILOGUE_VARIABLE`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from contrastive_dist.losses._epilogue import EPILOGUE_VARIABLE, Epilogue
from contrastive_dist.losses._families import SIGMOID, SOFTMAX, Family
from contrastive_dist.losses._targets import Indices
from contrastive_dist.losses._visit import product

__all__ = ["Fused", "fused"]

SLICE_LOGITS = 2**26
"""The most logits of a pass-2 ``G`` formed at once in a buffer beside the product (256 MiB of fp32 product
rows: a quarter of the default CUDA chunk's): InfoNCE's bf16 peak 7.2 → 6.1 bytes a logit of the chunk."""


def fused(family: Family, queries: Tensor, keys: Tensor) -> bool:
    """Whether a call of ``family`` on blocks of ``queries`` against ``keys`` takes the fused epilogue."""
    if queries.dtype != keys.dtype or family not in (SOFTMAX, SIGMOID):
        return False  # a block held in another dtype (a float32 queue), DCL: the eager epilogue
    if queries.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not queries.is_cuda and os.environ.get(EPILOGUE_VARIABLE) != "triton":
        return False
    from contrastive_dist.losses import _triton

    return _triton.available(queries)


class Fused(Epilogue):
    """The driver's epilogue on the fused ops: the product raw, the logits formed in the kernels."""

    def __init__(self, family: Family, scale: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        from contrastive_dist.losses import _triton

        self.ops, self.sigmoid, self.scale, self.bias, self.dtype = _triton, family is SIGMOID, scale, bias, dtype

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        return product(queries, keys.T)  # float32, no scale: the kernels form the logits

    def transposed(self, product: Tensor, width: int) -> Tensor:
        return product[:, :width].T  # a view: the kernels read any strides

    def state(self, values: Tensor, indices: Indices) -> Tensor:
        positive, excluded, options = _arguments(indices)
        if self.sigmoid:
            return self.ops.sigmoid_block(values, self.scale, self.bias, positive, excluded, None, None,
                                          **options)[0][:, None]  # fmt: skip
        return self.ops.softmax_state(values, self.scale, self.bias, positive, excluded, **options)

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float, *, keep: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        positive, excluded, options = _arguments(indices)
        grad = self._buffer(values, keep=keep, in_place=True)  # both ops own whole rows
        if self.sigmoid:
            sums, grad_sums = self.ops.sigmoid_block(values, self.scale, self.bias, positive, excluded,
                                                     _weights(weights), grad, splits=1, **options)  # fmt: skip
            return sums[:, None], grad, grad_sums
        state = self.ops.softmax_block(values, self.scale, self.bias, positive, excluded, _weights(weights), grad,
                                       **options)  # fmt: skip
        return state, grad, None

    def gradient(self, values: Tensor, indices: Indices, state: Tensor, weights: Tensor | float,
                 partial: Tensor | None, *, keep: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        positive, excluded, options = _arguments(indices)
        grad = self._buffer(values, keep=keep, in_place=self.sigmoid)
        if self.sigmoid:  # a pair's term needs no state
            _, grad_sums = self.ops.sigmoid_block(values, self.scale, self.bias, positive, excluded,
                                                  _weights(weights), grad, splits=1, **options)  # fmt: skip
            return grad, grad_sums
        self.ops.softmax_grad(values, self.scale, self.bias, state, positive, excluded, _weights(weights), grad,
                              **options)  # fmt: skip
        return grad, None

    def add_column_gradient(self, logit_grad: Tensor, values: Tensor, indices: Indices, state: Tensor,
                            weights: Tensor | float, partial: Tensor | None) -> None:  # fmt: skip
        positive, excluded, options = _arguments(indices)
        self.ops.softmax_grad(values, self.scale, self.bias, state, positive, excluded, _weights(weights),
                              logit_grad[:, : values.shape[0]].T, accumulate=True, **options)  # fmt: skip

    def slice_rows(self, rows: int, columns: int, *, keep: bool) -> int:
        """Rows of ``G`` formed at once: a slice of :data:`SLICE_LOGITS` logits where it needs a buffer.

        A buffer beside the product (bfloat16 features, the product read again) then stays a quarter of
        the default chunk's.
        """
        if not keep or self.dtype == torch.float32:
            return rows
        return max(1, min(rows, SLICE_LOGITS // max(columns, 1)))

    def _buffer(self, product: Tensor, *, keep: bool, in_place: bool = False) -> Tensor:
        """Where ``G`` goes, in the features' dtype: the product's own storage when it is not read again, else a buffer.

        float32: the product itself. bfloat16 (``in_place``: an op whose programs own whole rows, each reading a
        row's columns in order before writing them): row ``i`` of ``G`` in the first half of row ``i``'s bytes,
        ``(c, m)`` with strides ``(2m, 1)``: each element written over the product's elements ``≤ j`` of its
        own row, read already. No chunk-sized buffer beside the product (``tests/test_traffic.py``'s peak).
        """
        if keep:
            return product.new_empty(product.shape, dtype=self.dtype)
        if self.dtype == torch.float32:
            return product
        if in_place and self.dtype == torch.bfloat16 and product.is_contiguous() and product.shape[1]:
            return product.view(self.dtype)[:, : product.shape[1]]
        return product.new_empty(product.shape, dtype=self.dtype)


def _arguments(indices: Indices) -> tuple[Tensor | None, Tensor | None, dict[str, object]]:
    """The ops' targets: the positive and excluded columns, and their keyword arguments (keys, rule, shift)."""
    excluded = indices.excluded
    if excluded is not None and indices.shift:
        excluded = excluded - indices.shift  # (the kernels shift the positives only)
    keyed = indices.row_keys is not None and indices.column_keys is not None
    options: dict[str, object] = {
        "row_keys": indices.row_keys.contiguous() if keyed else None,  # type: ignore[union-attr]
        "column_keys": indices.column_keys.contiguous() if keyed else None,  # type: ignore[union-attr]
        "keys_positive": indices.key_rule == "positive",
        "positive_shift": indices.shift,
    }
    return indices.positive, excluded, options


def _weights(weights: Tensor | float) -> Tensor | None:
    """Row weights as the ops take them: a float32 vector, or ``None`` for all 1."""
    if isinstance(weights, Tensor):
        return weights.to(torch.float32).contiguous()
    if weights == 1.0:
        return None
    raise ValueError(f"the fused epilogue takes per-row weights or 1, got {weights!r}")
