"""One visit of the driver: a chunk of rows against a block of columns — its product, epilogue and gradient.

A visit forms its product once; its *epilogue* turns the product into the rows' state and, from the final
states, the logit gradient ``G``; :func:`accumulate` then adds every input's gradient from ``G``: the
queries' ``G K``, the keys' ``Gᵀ Q``, the bias's ``Σ G`` (the scale's comes once, at the end:
:func:`scaled`). :class:`Eager` is the reference epilogue, the family's functions on the logits; the
fused Triton ops (:mod:`._epilogue`, CUDA) compute the same numbers from the raw product.
:func:`epilogue_for` chooses between them, once per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._families import Family
from contrastive_dist.losses._precision import add_product_, full_precision, product, upcast
from contrastive_dist.losses._targets import Indices

__all__ = [
    "BLOCK_LOGITS", "Eager", "Epilogue", "Grads", "Side", "Visit", "accumulate", "as_input", "chunks",
    "epilogue_for", "first_order_only", "formed_in_forward", "gradients_wanted", "grads_for", "scaled",
]  # fmt: skip


class Side(NamedTuple):
    """One direction of a visit: its rows' targets, state and weights.

    Attributes:
        indices: the rows' targets against the visit's columns (a column side: the columns seen as rows).
        state: ``(c, width)`` the rows' final state (the gradients pass), or their running state.
        weights: ``(c,)`` each row's weight (an upstream gradient in backward), or one number for all.
    """

    indices: Indices
    state: Tensor
    weights: Tensor | float


class Visit(NamedTuple):
    """A chunk of ``c`` rows against a block of ``m`` columns.

    Attributes:
        queries: ``(c, D)`` the rows' features; keys: ``(m, D)`` the columns'.
        rows: the rows' side; columns: the side of the block's first ``len(columns.state)`` columns seen
            as rows (a symmetric loss's columns with losses of their own, a pair of tiles), or ``None``.
        query_grad: ``(c, D)`` where ``G K`` is added (unscaled), or ``None``; key_grad: ``(m, D)`` ``Gᵀ Q``.
    """

    queries: Tensor
    keys: Tensor
    rows: Side
    columns: Side | None
    query_grad: Tensor | None
    key_grad: Tensor | None


class Epilogue:
    """What a visit's product goes through: the interface of :class:`Eager` and the fused epilogue."""

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        """The visit's one product: ``(c, m)``."""
        raise NotImplementedError

    def transposed(self, product: Tensor, width: int) -> Tensor:
        """The first ``width`` columns of ``product`` seen as rows ``(width, c)``, for a column side."""
        raise NotImplementedError

    def state(self, values: Tensor, indices: Indices) -> Tensor:
        """The rows' state over this visit alone ``(c, width)``; eager: ``values`` become numerators."""
        raise NotImplementedError

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float, *, keep: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """The state of rows complete after this visit, their ``G`` and (fused sigmoid) ``Σ_j G_ij``.

        ``keep``: ``values`` are read again afterwards (a column side).
        """
        raise NotImplementedError

    def gradient(self, values: Tensor, indices: Indices, state: Tensor, weights: Tensor | float,
                 partial: Tensor | None, *, keep: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """``G`` from the rows' final ``state`` (``partial``: ``values`` are pass 1's numerators against it).

        ``keep``: ``values`` are read again afterwards (a column side). Returns ``G`` and ``Σ_j G_ij`` or ``None``.
        """
        raise NotImplementedError

    def add_column_gradient(self, logit_grad: Tensor, values: Tensor, indices: Indices, state: Tensor,
                            weights: Tensor | float, partial: Tensor | None) -> None:  # fmt: skip
        """``G[:, :width] += G_columnsᵀ``, the column side's gradient from its final ``state``."""
        raise NotImplementedError


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
    """The epilogue of a call: the fused Triton ops where they serve (:func:`._epilogue.fused`), else :class:`Eager`."""
    if queries.is_cuda or _epilogue_variable():
        from contrastive_dist.losses import _epilogue

        if _epilogue.fused(family, queries, keys):
            return _epilogue.Fused(family, scale, bias, queries.dtype)
    return Eager(family, scale, bias)


def _epilogue_variable() -> bool:
    import os

    return os.environ.get("CONTRASTIVE_DIST_EPILOGUE") == "triton"  # CPU tensors under Triton's interpreter


def _half(queries: Tensor, keys: Tensor) -> bool:
    """Whether a visit's products take half operands: both sides in one half dtype (:mod:`._precision`)."""
    return queries.dtype == keys.dtype and queries.dtype in (torch.bfloat16, torch.float16)


BLOCK_LOGITS = 2**24
"""The default chunk's budget for a visit serving both directions of a symmetric loss in one pass off CUDA,
and what a call may keep between its passes: at most this many logits (64 MiB in float32)."""
CUDA_BLOCK_LOGITS = 2**28
"""The default chunk's budget on CUDA: at most this many logits (1 GiB in float32) are formed at once.

Each chunk costs the host about half a millisecond to issue (a dozen launches and their Python), so a
chunk must hold enough work for the GPU to stay ahead of it; measured on an H200 (bfloat16, D = 768,
B = 65,536, ``benchmarks/gpu_check.py``): SigLIP took 137 ms a step in chunks of 256 rows (2²⁴ logits,
host-bound), 55 ms in 1024, 45 ms in 4096 (this budget) and 45 ms in 8192; InfoNCE 300, 88, 82 and 80 ms.
"""
CPU_BLOCK_LOGITS = 2**20
"""The default chunk's budget elsewhere on the CPU (4 MiB of float32 logits), with chunks of at least
:data:`CPU_CHUNK_ROWS` rows: blocks that stay in its caches, rows enough for its matrix products
(measured: ``benchmarks/floor.py``, where 256 rows beat both the whole block and 128 rows)."""
CPU_CHUNK_ROWS = 256


def default_chunk(rows: int, columns: int, budget: int = BLOCK_LOGITS, least: int = 64) -> int:
    """Rows per chunk when ``chunk_size=None``: every row if the block holds at most ``budget`` logits, else
    the most rows under that, in multiples of 64, and at least ``least``.

    Example:
        >>> default_chunk(4096, 4096), default_chunk(8192, 65536), default_chunk(10, 0)
        (4096, 256, 10)
        >>> default_chunk(4096, 8192, CPU_BLOCK_LOGITS, CPU_CHUNK_ROWS)
        256
        >>> default_chunk(8192, 65536, CUDA_BLOCK_LOGITS), default_chunk(65536, 131072, CUDA_BLOCK_LOGITS)
        (4096, 2048)
    """
    if rows * columns <= budget:
        return max(rows, 1)
    return max(least, budget // columns // 64 * 64)


def chunks(rows: int, chunk: int | None, columns: int, queries: Tensor, one_pass_symmetric: bool = False
           ) -> list[tuple[int, int]]:  # fmt: skip
    """``(start, stop)`` of each chunk of ``rows`` rows against ``columns`` (``None``: :func:`default_chunk`).

    The default budget: :data:`CUDA_BLOCK_LOGITS` on CUDA; elsewhere :data:`BLOCK_LOGITS` for a symmetric
    block formed in one pass (in chunks it would cost a fourth product), else :data:`CPU_BLOCK_LOGITS` with
    at least :data:`CPU_CHUNK_ROWS` rows.
    """
    if chunk is None:
        if queries.is_cuda:
            chunk = default_chunk(rows, columns, CUDA_BLOCK_LOGITS)
        elif one_pass_symmetric:
            chunk = default_chunk(rows, columns, BLOCK_LOGITS)
        else:
            chunk = default_chunk(rows, columns, CPU_BLOCK_LOGITS, CPU_CHUNK_ROWS)
    return [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


class Grads(NamedTuple):
    """Gradient accumulators of one call, in the core's dtype.

    Attributes:
        query: ``(n, D)`` the queries' ``Σ G K``, unscaled (:func:`scaled` applies the scale once, after the
            last visit), when the queries or the scale need a gradient; else ``None``.
        bias: ``()`` the bias's ``Σ G``, or ``None``.
        want_query, want_scale: which of the queries and the scale need a gradient.
        sums: the fused epilogue's row sums of ``G`` (the bias's), added once after the last visit.
    """

    query: Tensor | None
    bias: Tensor | None
    want_query: bool
    want_scale: bool
    sums: list[Tensor]


def grads_for(queries: Tensor, scale: Tensor, want_query: bool, want_scale: bool, want_bias: bool) -> Grads:
    """Fresh accumulators, in the core's dtype (``scale``'s) whatever the queries' dtype."""
    query = torch.zeros_like(queries, dtype=scale.dtype) if want_query or want_scale else None
    return Grads(query, scale.new_zeros(()) if want_bias else None, want_query, want_scale, [])


def accumulate(logit_grad: Tensor, visit: Visit, grads: Grads, row_sums: Tensor | None = None) -> None:
    """From a visit's ``G = ∂(Σ w ℓ)/∂logits``: add every input's gradient, unscaled.

    The queries' ``G K`` (into ``visit.query_grad``), the keys' ``Gᵀ Q`` (into ``visit.key_grad``), the
    bias's ``Σ G`` (``row_sums``, the fused epilogue's, are kept and added once by :func:`scaled`). The
    logits' scale ``s`` multiplies both products: it is applied once, after the last visit. Half operands
    multiply ``G`` rounded to their dtype. In float16, whose range is narrow, ``G`` is first multiplied by a
    power of two that brings its largest entry to [½, 1) and the products are divided by it: the row
    weights folded into ``G`` (upstream gradients ≈ 1/N) would otherwise fall below float16's smallest numbers.
    """
    if grads.bias is not None:
        if row_sums is None:
            grads.bias.add_(logit_grad.sum())
        else:
            grads.sums.append(row_sums)
    queries, keys = visit.queries, visit.keys
    half = _half(queries, keys)
    if not half and queries.dtype != keys.dtype:  # a block held here in another dtype (a float32 queue)
        queries, keys = upcast(queries), upcast(keys)
    factor, unscale = _rounded(logit_grad, queries.dtype) if half else (logit_grad, None)
    for accumulator, first, second in ((visit.key_grad, factor.T, queries), (visit.query_grad, factor, keys)):
        if accumulator is None:
            continue
        if unscale is None:
            add_product_(accumulator, first, second)
        else:
            accumulator.add_(product(first, second).mul_(unscale))


def _rounded(logit_grad: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``G`` in a half ``dtype`` for the products, and what to multiply the products by (``None``: 1)."""
    if dtype != torch.float16:
        return logit_grad.to(dtype), None
    peak = torch.linalg.vector_norm(logit_grad, float("inf"))
    power = torch.where(peak > 0, torch.floor(torch.log2(torch.where(peak > 0, peak, 1.0))) + 1.0, 0.0)
    return torch.mul(logit_grad, torch.exp2(-power)).to(dtype), torch.exp2(power)


def scaled(grads: Grads, queries: Tensor, scale: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The queries' gradient ``s · Σ G K`` and the scale's ``Σ Q ⊙ (Σ G K)``; the kept row sums into the bias's."""
    if grads.sums and grads.bias is not None:
        grads.bias.add_((grads.sums[0] if len(grads.sums) == 1 else torch.cat(grads.sums)).sum())
    grads.sums.clear()
    if grads.query is None:
        return None, None
    scale_grad = (upcast(queries) * grads.query).sum() if grads.want_scale else None
    return (grads.query.mul_(scale) if grads.want_query else None), scale_grad


def gradients_wanted(*tensors: Tensor | None) -> tuple[bool, ...]:
    """Which of ``tensors`` need a gradient (none under ``no_grad``)."""
    return tuple(tensor is not None and torch.is_grad_enabled() and tensor.requires_grad for tensor in tensors)


def as_input(grad: Tensor | None, like: Tensor) -> Tensor | None:
    """A gradient handed back to an input: in the input's dtype."""
    return None if grad is None else grad.to(like.dtype)


def formed_in_forward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
    """A backward whose gradients were formed in forward: each saved one times the total's incoming gradient.

    ``ctx.saved_tensors`` hold the gradients of the total (``None`` where not wanted) and ``ctx.dtypes``
    their inputs' dtypes, in the same order.
    """
    saved = zip(ctx.saved_tensors, ctx.dtypes, strict=True)
    return tuple(None if grad is None else (grad * grad_total).to(dtype) for grad, dtype in saved)


Backward = Callable[..., tuple[Tensor | None, ...]]


def first_order_only(backward: Backward) -> Backward:
    """Mark a driver's ``backward`` as not differentiable, and run it with autocast off.

    ``create_graph=True`` raises instead of being wrong: ``once_differentiable`` alone stays silent when the
    incoming gradient is a constant (the usual ``grad(loss, x, create_graph=True)``), and the second
    derivative would quietly miss this term.
    """
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx: Any, *grad_outputs: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through the contrastive losses' kernels is not "
                "supported: their gradients are formed block by block (once_differentiable)"
            )
        with full_precision(grad_outputs[0].device):  # a backward inside autocast computes in forward's dtype
            return once(ctx, *grad_outputs)

    return checked
