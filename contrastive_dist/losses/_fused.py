"""The fused epilogue: a visit's product through one Triton op a pass (:mod:`._triton`, CUDA).

Everything between a visit's product and its gradient's products — the logits' scale and bias, the
rows' state, the logit gradient ``G`` — is one launch that reads the raw product ``P = Q Kᵀ`` and
writes ``G`` (in bfloat16 for bfloat16 features): 6–12 bytes per logit instead of the eager chain's
40–130. A visit's column side (a symmetric loss's other direction) is read from the same tiles: its
state with the rows' (``softmax_pairs``), its gradient added before ``G`` is written
(``softmax_pair_grad``). Keys (SupCon's labels, sample ids) are compared in the kernel, tile by tile, never
formed as a mask. :class:`Fused` is the driver's :class:`~._epilogue.Epilogue` on these ops; :func:`fused` says where
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
from contrastive_dist.losses._visit import Kept, Side, product

__all__ = ["Fused", "fused"]

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

    def states(self, values: Tensor, rows: Indices, columns: Side | None) -> tuple[Tensor, Tensor | None, Kept]:
        positive, excluded, options = _arguments(rows)
        if columns is None:
            if self.sigmoid:
                partial = self.ops.sigmoid_block(values, self.scale, self.bias, positive, excluded, None, None,
                                                 **options)[0][:, None]  # fmt: skip
            else:
                partial = self.ops.softmax_state(values, self.scale, self.bias, positive, excluded, **options)
            return partial, None, Kept(values, partial)
        self._softmax_only()
        column_positive, column_excluded, column_shift = _column_arguments(columns.indices)
        partial, column_partial = self.ops.softmax_pairs(
            values, self.scale, self.bias, positive, excluded, column_positive, column_excluded, len(columns.state),
            column_shift=column_shift, **options)  # fmt: skip
        return partial, column_partial, Kept(values, partial, None, column_partial)

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        positive, excluded, options = _arguments(indices)
        grad = self._buffer(values)  # both ops own whole rows
        if self.sigmoid:
            sums, grad_sums = self.ops.sigmoid_block(values, self.scale, self.bias, positive, excluded,
                                                     _weights(weights), grad, splits=1, **options)  # fmt: skip
            return sums[:, None], grad, grad_sums
        state = self.ops.softmax_block(values, self.scale, self.bias, positive, excluded, _weights(weights), grad,
                                       **options)  # fmt: skip
        return state, grad, None

    def gradients(self, values: Tensor, rows: Side, columns: Side | None, kept: Kept | None
                  ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        positive, excluded, options = _arguments(rows.indices)
        if self.sigmoid and columns is None:  # a pair's term needs no state
            grad = self._buffer(values)
            _, grad_sums = self.ops.sigmoid_block(values, self.scale, self.bias, positive, excluded,
                                                  _weights(rows.weights), grad, splits=1, **options)  # fmt: skip
            return grad, grad_sums
        if columns is None:  # a program a tile: written over the product only in float32
            grad = self._buffer(values, in_place=False)
            self.ops.softmax_grad(values, self.scale, self.bias, rows.state, positive, excluded,
                                  _weights(rows.weights), grad, **options)  # fmt: skip
            return grad, None
        self._softmax_only()
        column_positive, column_excluded, column_shift = _column_arguments(columns.indices)
        grad = self._buffer(values)  # its programs own whole rows
        self.ops.softmax_pair_grad(
            values, self.scale, self.bias, rows.state, positive, excluded, _weights(rows.weights), columns.state,
            column_positive, column_excluded, _weights(columns.weights), grad, column_shift=column_shift, **options)
        return grad, None

    def _softmax_only(self) -> None:
        if self.sigmoid:  # no sigmoid loss has a column side: its pairs' terms are one sum
            raise NotImplementedError("a sigmoid loss's column side has no fused epilogue")

    def _buffer(self, product: Tensor, *, in_place: bool = True) -> Tensor:
        """Where ``G`` goes, in the features' dtype, over the product's own storage where its op allows.

        float32: the product itself (every op reads a tile before writing it). bfloat16 with ``in_place``
        (an op whose programs own whole rows, each reading a row's columns in order before writing them):
        row ``i`` of ``G`` in the first half of row ``i``'s bytes, ``(c, m)`` with strides ``(2m, 1)``: each
        element written over the product's elements ``≤ j`` of its own row, read already. No chunk-sized
        buffer beside the product (``tests/test_traffic.py``'s peak).
        """
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


def _column_arguments(indices: Indices) -> tuple[Tensor | None, Tensor | None, int]:
    """A column side's targets as the pair ops take them: its positive and excluded rows, and their shift.

    Its keys are the rows' swapped (:func:`._visit.block_visits`): the ops take the rows' once.
    """
    positive, excluded, options = _arguments(indices)
    return positive, excluded, int(options["positive_shift"])  # type: ignore[call-overload]


def _weights(weights: Tensor | float) -> Tensor | None:
    """Row weights as the ops take them: a float32 vector, or ``None`` for all 1."""
    if isinstance(weights, Tensor):
        return weights.to(torch.float32).contiguous()
    if weights == 1.0:
        return None
    raise ValueError(f"the fused epilogue takes per-row weights or 1, got {weights!r}")
