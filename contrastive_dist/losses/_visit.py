"""One visit of the driver: a chunk of rows against a block of columns — its product, epilogue and gradient.

A visit forms its product once. Its *epilogue* turns the product into the rows' partial state
(:func:`states_of`, the driver's first pass) and, from the final states, into the logit gradient ``G``
(:func:`gradients_of`, the second); :func:`accumulate` then adds every input's gradient from ``G``: the
queries' ``G K``, the keys' ``Gᵀ Q``, the bias's ``Σ G`` (the scale's once, at the end).
:class:`Eager` is the reference epilogue, the family's functions on the logits; the fused Triton ops
(:class:`._epilogue.Fused`, CUDA) compute the same numbers from the raw product. :func:`epilogue_for`
chooses, once per call. Every matrix product of the losses is issued here (:func:`product`,
:func:`add_product_`), in the dtypes :mod:`._options` sets.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._options import out_dtype_products, upcast
from contrastive_dist.losses._targets import Indices

if TYPE_CHECKING:
    from contrastive_dist.losses._families import Family

__all__ = ["Eager", "Epilogue", "Grads", "Kept", "Side", "Visit", "accumulate", "add_product_", "epilogue_for",
           "gradients_of", "product", "states_of"]  # fmt: skip

_HALF = (torch.bfloat16, torch.float16)


class Side(NamedTuple):
    """One direction of a visit: its rows' targets, state and weights.

    Attributes:
        indices: the rows' targets against the visit's columns (a column side: the columns seen as rows).
        state: ``(c, width)`` the rows' running state (pass 1: its shape alone is read) or their final state.
        weights: ``(c,)`` each row's weight (an upstream gradient in backward), or one number for all.
    """

    indices: Indices
    state: Tensor
    weights: Tensor | float


class Visit(NamedTuple):
    """A chunk of ``c`` rows, ``queries`` ``(c, D)``, against a block of ``m`` columns, ``keys`` ``(m, D)``.

    ``columns``: the side of the block's first ``len(columns.state)`` columns seen as rows (a symmetric
    loss's columns with losses of their own, a pair of tiles), or ``None``. ``query_grad`` ``(c, D)`` and
    ``key_grad`` ``(m, D)``: where ``G K`` and ``Gᵀ Q`` are added, unscaled, or ``None``.
    """

    queries: Tensor
    keys: Tensor
    rows: Side
    columns: Side | None
    query_grad: Tensor | None
    key_grad: Tensor | None


class Epilogue:
    """What a visit's product goes through: :class:`Eager`'s interface, and the fused epilogue's."""

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        """The visit's one product ``(c, m)``."""
        raise NotImplementedError

    def transposed(self, product: Tensor, width: int) -> Tensor:
        """The first ``width`` columns of ``product`` seen as rows ``(width, c)``: a column side's values."""
        raise NotImplementedError

    def state(self, values: Tensor, indices: Indices) -> Tensor:
        """The rows' state over this visit alone ``(c, width)`` (eager: ``values`` become numerators)."""
        raise NotImplementedError

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float, *, keep: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """The state of rows complete after this visit, their ``G`` and (fused sigmoid) ``Σ_j G_ij``.

        ``keep``: ``values`` are read again afterwards (a column side).
        """
        raise NotImplementedError

    def gradient(self, values: Tensor, indices: Indices, state: Tensor, weights: Tensor | float,
                 partial: Tensor | None, *, keep: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """``G`` from the rows' final ``state``, and ``Σ_j G_ij`` or ``None``; ``partial``: ``values`` are
        pass 1's numerators against it; ``keep``: ``values`` are read again afterwards.
        """
        raise NotImplementedError

    def add_column_gradient(self, logit_grad: Tensor, values: Tensor, indices: Indices, state: Tensor,
                            weights: Tensor | float, partial: Tensor | None) -> None:  # fmt: skip
        """``G[:, :width] += G_columnsᵀ``: a column side's gradient from its final ``state``."""
        raise NotImplementedError

    def slice_rows(self, rows: int, columns: int, *, keep: bool) -> int:
        """Rows of a visit whose ``G`` is formed at once in pass 2 (``keep``: the product is read again)."""
        return rows


class Eager(Epilogue):
    """The reference epilogue: the family's functions on the logits ``s · Q Kᵀ (+ b)``, in place."""

    def __init__(self, family: Family, scale: Tensor, bias: Tensor | None) -> None:
        self.family, self.scale, self.bias = family, scale, bias

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        if _half(queries, keys) or queries.dtype != keys.dtype:
            logits = product(queries, keys.T).mul_(self.scale)  # the scale in float32, after the product
            return logits if self.bias is None else logits.add_(self.bias)
        if self.bias is None:  # the scale folded into the smaller operand: no pass over the logits
            return (queries * self.scale) @ keys.T
        return torch.addmm(self.bias.expand(1, 1), queries * self.scale, keys.T)

    def transposed(self, product: Tensor, width: int) -> Tensor:
        # A copy laid out like the logits: its gradient adds back onto theirs in one plain pass.
        return product[:, :width].clone().T

    def state(self, values: Tensor, indices: Indices) -> Tensor:
        targets = indices.targets()
        return self.family.block_state_(values, targets, targets.positive_mask(values))

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float, *, keep: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        targets = indices.targets()
        mask = targets.positive_mask(values)
        state = self.family.block_state_(values, targets, mask)
        return state, self.family.gradient_(values, state, targets, mask, weights), None

    def gradient(self, values: Tensor, indices: Indices, state: Tensor, weights: Tensor | float,
                 partial: Tensor | None, *, keep: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        targets = indices.targets()
        mask = targets.positive_mask(values)
        if partial is None:
            self.family.numerators_(values, state, targets, mask)
        else:
            self.family.rebase_(values, partial, state)
        return self.family.gradient_(values, state, targets, mask, weights), None

    def add_column_gradient(self, logit_grad: Tensor, values: Tensor, indices: Indices, state: Tensor,
                            weights: Tensor | float, partial: Tensor | None) -> None:  # fmt: skip
        column_grad, _ = self.gradient(values, indices, state, weights, partial, keep=False)
        logit_grad[:, : column_grad.shape[0]] += column_grad.T


def epilogue_for(family: Family, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None) -> Epilogue:
    """The epilogue of a call: the fused Triton ops where they serve (:func:`._epilogue.fused`), else :class:`Eager`.

    The one place the fast or eager choice is made; CPU tensors take Triton's interpreter only when asked.
    """
    if queries.is_cuda or os.environ.get("CONTRASTIVE_DIST_EPILOGUE") == "triton":
        from contrastive_dist.losses import _epilogue

        if _epilogue.fused(family, queries, keys):
            return _epilogue.Fused(family, scale, bias, queries.dtype)
    return Eager(family, scale, bias)


class Kept(NamedTuple):
    """A visit as pass 1 left it for pass 2: its product (eager: numerators against ``partial``) and its
    column side's values (eager: numerators against ``column_partial``).
    """

    product: Tensor
    partial: Tensor
    column_values: Tensor | None = None
    column_partial: Tensor | None = None


def states_of(epilogue: Epilogue, visit: Visit, grads: Grads | None, kept: list[Kept] | None
              ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Pass 1 of a visit: its rows' (and column side's) partial states; with ``grads`` (the rows' states are
    final after it, no column side), ``G`` and its products too; ``kept``: the visit is kept for pass 2.
    """
    columns = visit.columns
    product = epilogue.product(visit.queries, visit.keys)
    column_values = column_partial = None
    if columns is not None:
        column_values = epilogue.transposed(product, columns.state.shape[0])
        column_partial = epilogue.state(column_values, columns.indices)
    if grads is not None:
        partial, logit_grad, sums = epilogue.state_and_gradient(product, visit.rows.indices, visit.rows.weights)
        accumulate(logit_grad, visit, grads, sums)
        return partial, None
    partial = epilogue.state(product, visit.rows.indices)
    if kept is not None:
        kept.append(Kept(product, partial, column_values, column_partial))
    return partial, column_partial


def gradients_of(epilogue: Epilogue, visit: Visit, grads: Grads, kept: Kept | None) -> None:
    """Pass 2 of a visit: ``G`` from the final states (the rows', then the column side's added), and its products.

    Where ``G`` needs a buffer of its own beside the product (:meth:`Epilogue.slice_rows`), it is formed and
    used a slice of the visit's rows at a time, in one buffer's worth of memory.
    """
    product = kept.product if kept is not None else epilogue.product(visit.queries, visit.keys)
    columns = visit.columns
    column_values = None if columns is None else (kept.column_values if kept is not None and kept.column_values
                                                  is not None else epilogue.transposed(product, len(columns.state)))
    rows = visit.queries.shape[0]
    step = epilogue.slice_rows(rows, product.shape[1], keep=columns is not None)
    for start in range(0, rows, step):
        part = visit if step >= rows else _rows_of(visit, start, start + step)
        values = product if step >= rows else product[start : start + step]
        logit_grad, sums = epilogue.gradient(values, part.rows.indices, part.rows.state, part.rows.weights,
                                             None if kept is None else kept.partial, keep=columns is not None)
        if part.columns is not None and column_values is not None:
            own = column_values if step >= rows else column_values[:, start : start + step]
            epilogue.add_column_gradient(logit_grad, own, part.columns.indices, part.columns.state,
                                         part.columns.weights, None if kept is None else kept.column_partial)
        accumulate(logit_grad, part, grads, sums)


def _rows_of(visit: Visit, start: int, stop: int) -> Visit:
    """The visit of its rows ``start:stop`` alone, against the same columns."""
    rows, columns = visit.rows, visit.columns
    weights = rows.weights[start:stop] if isinstance(rows.weights, Tensor) else rows.weights
    row_side = Side(rows.indices.rows(start, stop), rows.state[start:stop], weights)
    column_side = None if columns is None else columns._replace(indices=columns.indices.columns(start, stop))
    query_grad = None if visit.query_grad is None else visit.query_grad[start:stop]
    return Visit(visit.queries[start:stop], visit.keys, row_side, column_side, query_grad, visit.key_grad)


class Grads(NamedTuple):
    """A call's gradient accumulators, in the core's dtype.

    Attributes:
        query: ``(n, D)`` the queries' ``Σ G K``, unscaled (the scale applies once, after the last visit), when
            the queries or the scale need a gradient; else ``None``.
        bias: ``()`` the bias's ``Σ G``, or ``None``.
        want_query, want_scale, want_key: which of the queries, the scale and the keys need a gradient.
        sums: the fused epilogue's row sums of ``G``, added to the bias's once, after the last visit.
    """

    query: Tensor | None
    bias: Tensor | None
    want_query: bool
    want_scale: bool
    want_key: bool
    sums: list[Tensor]


def accumulate(logit_grad: Tensor, visit: Visit, grads: Grads, row_sums: Tensor | None = None) -> None:
    """From a visit's ``G = ∂(Σ w ℓ)/∂logits``, add every input's gradient, unscaled: one ``addmm_`` each.

    The logits' scale ``s`` multiplies both products: it is applied once, after the last visit. Half operands
    multiply ``G`` rounded to their dtype. In float16, whose range is narrow, ``G`` is first multiplied by a
    power of two that brings its largest entry to [½, 1) and the products are divided by it: the row weights
    folded into ``G`` (upstream gradients ≈ 1/N) would otherwise fall below float16's smallest numbers.
    """
    if grads.bias is not None:
        if row_sums is None:
            grads.bias.add_(logit_grad.sum())
        else:  # each costs a launch, as much as a small chunk's work on a GPU: added once at the end
            grads.sums.append(row_sums)
    queries, keys = visit.queries, visit.keys
    half = _half(queries, keys)
    if not half and queries.dtype != keys.dtype:  # a block held here in another dtype (a float32 queue)
        queries, keys = upcast(queries), upcast(keys)
    factor, unscale = _rounded(logit_grad, queries.dtype) if half else (logit_grad, None)
    for accumulator, first, second in ((visit.key_grad, factor.T, queries), (visit.query_grad, factor, keys)):
        if accumulator is not None and unscale is None:
            add_product_(accumulator, first, second)
        elif accumulator is not None:
            accumulator.add_(product(first, second).mul_(unscale))


def _rounded(logit_grad: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``G`` in a half ``dtype`` for the products, and what to multiply the products by (``None``: 1)."""
    if dtype != torch.float16:
        return logit_grad.to(dtype), None
    peak = torch.linalg.vector_norm(logit_grad, float("inf"))
    power = torch.where(peak > 0, torch.floor(torch.log2(torch.where(peak > 0, peak, 1.0))) + 1.0, 0.0)
    return torch.mul(logit_grad, torch.exp2(-power)).to(dtype), torch.exp2(power)


def _half(queries: Tensor, keys: Tensor) -> bool:
    """Whether a visit's products take half operands: both sides in one half dtype (see :mod:`._options`)."""
    return queries.dtype == keys.dtype and queries.dtype in _HALF


def product(first: Tensor, second: Tensor) -> Tensor:
    """``first @ second`` in the core's dtype; operands of one half dtype are multiplied as they are.

    On CUDA two bf16/fp16 operands take the tensor cores with a float32 result (on the meta device the same
    overload, for counting); elsewhere, on a torch without that overload, or when the dtypes differ, both
    are upcast first.

    Shape:
        first: ``(a, k)``; second: ``(k, b)``; output: ``(a, b)``, float32 (float64 for float64 operands).

    Example:
        >>> import torch
        >>> a, b = torch.randn(2, 3).bfloat16(), torch.randn(3, 4).bfloat16()
        >>> product(a, b).dtype, torch.equal(product(a, b), a.float() @ b.float())
        (torch.float32, True)
    """
    if first.dtype == second.dtype and first.dtype in _HALF and out_dtype_products(first.device):
        return torch.mm(first, second, out_dtype=torch.float32)
    return upcast(first) @ upcast(second)


def add_product_(out: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """``out += first @ second`` in place, in ``out``'s dtype (the core's): no temporary of the product.

    Two half operands on CUDA accumulate on the tensor cores straight into the float32 ``out`` (``addmm``
    with ``out_dtype``); elsewhere both are upcast first, like :func:`product`.

    Shape:
        out: ``(a, b)``; first: ``(a, k)``; second: ``(k, b)``.

    Example:
        >>> import torch
        >>> out, a, b = torch.ones(2, 4), torch.randn(2, 3).bfloat16(), torch.randn(3, 4).bfloat16()
        >>> torch.equal(add_product_(out.clone(), a, b), out + a.float() @ b.float())
        True
    """
    if first.dtype == second.dtype and first.dtype in _HALF and out_dtype_products(first.device):
        return torch.addmm(out, first, second, out_dtype=out.dtype, out=out)
    return out.addmm_(upcast(first), upcast(second))
