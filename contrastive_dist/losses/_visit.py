"""One visit of the driver: a chunk of rows against a block of columns — its product, epilogue and gradient.

A visit forms its product once. Its epilogue (:mod:`._epilogue`) turns the product into the rows' partial
state (:func:`states_of`, the driver's first pass) and, from the final states, into the logit gradient
``G`` (:func:`gradients_of`, the second); :func:`accumulate` then adds every input's gradient from ``G``:
the queries' ``G K``, the keys' ``Gᵀ Q``, the bias's ``Σ G`` (the scale's once, at the end). Every matrix
product of the losses is issued here (:func:`product`, :func:`add_product_`), in the dtypes
:mod:`._options` sets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._options import out_dtype_products, upcast
from contrastive_dist.losses._targets import Indices
from contrastive_dist.losses._transports import LOCAL, chunks

if TYPE_CHECKING:
    from contrastive_dist.losses._driver import _Run
    from contrastive_dist.losses._epilogue import Epilogue

__all__ = ["Grads", "Kept", "Side", "Visit", "accumulate", "add_product_", "block_visits", "gradients_of", "half",
           "inner", "product", "states_of"]  # fmt: skip

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


def block_visits(run: _Run, owner: int, block: tuple[Tensor, ...], column_state: Tensor | None,
             grads: Grads | None, key_grad: Tensor | None, weights: Tensor | None,
             column_weights: Tensor | float = 1.0) -> list[Visit]:  # fmt: skip
    """The chunks of a run's rows that meet ``owner``'s block (an empty block: none), each a :class:`Visit`.

    ``column_state``: pass 1's running state of the block's own columns (symmetric); ``None`` in pass 2,
    which reads their final states (ring mode: travelling with the block, their weights beside them).
    """
    rows, features, width, column_positive = run.problem.rows, block[0], 0, None
    column_keys = block[1] if len(block) > 1 and (run.columns.keys is not None or owner == LOCAL) else None
    if features.shape[0] == 0 or run.queries.shape[0] == 0:
        return []
    own_start = None if owner == LOCAL else run.transport.own_start_of(owner)
    positive, excluded = (None if index is None or own_start is None else index + own_start
                          for index in (rows.positive, rows.excluded))  # fmt: skip
    if run.symmetric and owner != LOCAL:
        width = run.transport.columns_in(owner, run.own_losses)
        column_positive = _column_positive(run, own_start, width)
        if column_state is None and run.ring:  # (contiguous once a block, as the fused ops take them)
            column_state, column_weights = block[-1][:, :-1].contiguous(), block[-1][:, -1].contiguous()
        elif column_state is None:
            column_state = run.column_state
    visits = []
    for start, stop in chunks(run.queries.shape[0], run.problem.chunk, features.shape[0], run.queries,
                              run.symmetric and run.in_forward and not run.ring):  # fmt: skip
        keys = None if rows.keys is None else rows.keys[start:stop]
        block_indices = Indices(positive, excluded, rows.keys, column_keys, rows.key_rule, width=features.shape[0])
        row_side = Side(block_indices.rows(start, stop), run.row_state[start:stop],
                        1.0 if weights is None else weights[start:stop])
        column_side = None
        if width and column_state is not None:
            own_keys = None if column_keys is None else column_keys[:width]
            column_indices = Indices(column_positive, None, own_keys, keys, rows.key_rule, start, stop - start,
                                     inside=False)  # fmt: skip
            column_side = Side(column_indices, column_state, column_weights)
        query_grad = None if grads is None or grads.query is None else grads.query[start:stop]
        visits.append(Visit(run.queries[start:stop], features, row_side, column_side, query_grad, key_grad))
    return visits


def _column_positive(run: _Run, own_start: int | None, width: int) -> Tensor | None:
    """The own columns' positive rows, placed at their columns of the block (the others': none)."""
    positive = run.problem.rows.column_positive
    if not width or positive is None or own_start is None:
        return None
    if own_start == 0 and positive.shape[0] == width:
        return positive
    placed = positive.new_full((width,), -1)
    placed[own_start : own_start + positive.shape[0]] = positive
    return placed


class Kept(NamedTuple):
    """A visit as pass 1 left it for pass 2.

    Its product (eager: numerators against ``partial``) and its column side's values (eager: numerators
    against ``column_partial``).
    """

    product: Tensor
    partial: Tensor
    column_values: Tensor | None = None
    column_partial: Tensor | None = None


def states_of(epilogue: Epilogue, visit: Visit, grads: Grads | None, kept: list[Kept] | None
              ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Pass 1 of a visit: its rows' (and column side's) partial states.

    With ``grads`` (the rows' states are final after it, no column side), ``G`` and its products too;
    ``kept``: the visit is kept for pass 2.
    """
    product = epilogue.product(visit.queries, visit.keys)
    if grads is not None:
        partial, logit_grad, sums = epilogue.state_and_gradient(product, visit.rows.indices, visit.rows.weights)
        accumulate(logit_grad, visit, grads, sums)
        return partial, None
    partial, column_partial, keep = epilogue.states(product, visit.rows.indices, visit.columns)
    if kept is not None:
        kept.append(keep)
    return partial, column_partial


def gradients_of(epilogue: Epilogue, visit: Visit, grads: Grads, kept: Kept | None) -> None:
    """Pass 2 of a visit: ``G`` from the final states (the rows', the column side's added), and its products."""
    product = kept.product if kept is not None else epilogue.product(visit.queries, visit.keys)
    logit_grad, sums = epilogue.gradients(product, visit.rows, visit.columns, kept)
    accumulate(logit_grad, visit, grads, sums)


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
    halves = half(queries, keys)
    if not halves and queries.dtype != keys.dtype:  # a block held here in another dtype (a float32 queue)
        queries, keys = upcast(queries), upcast(keys)
    factor, unscale = _rounded(logit_grad, queries.dtype) if halves else (logit_grad, None)
    for accumulator, first, second in ((visit.key_grad, factor.T, queries), (visit.query_grad, factor, keys)):
        if accumulator is None:
            continue
        if unscale is None:
            add_product_(accumulator, first, second)
        else:
            accumulator.add_(product(first, second).mul_(unscale))


INNER_ELEMENTS = 1 << 22
"""Elements of the features multiplied at once in :func:`inner` (16 MiB of float32 products)."""


def inner(features: Tensor, grad: Tensor) -> Tensor:
    """``Σ features ⊙ grad`` in ``grad``'s dtype (the core's), a bounded block of rows at a time.

    Whole, the product is a copy of the features in the core's dtype beside the gradients' accumulators:
    the largest tensor of a chunked bfloat16 call's end (SigLIP, ``chunk_size=1024``, B = 65,536: 192 MiB).

    Shape:
        features: ``(n, D)``, of ``grad``'s dtype or a narrower one; grad: ``(n, D)``; output: ``()``.
    """
    rows = max(1, INNER_ELEMENTS // max(1, features.shape[1]))
    parts = [(g * f).sum() for f, g in zip(features.split(rows), grad.split(rows), strict=True)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _rounded(logit_grad: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``G`` in a half ``dtype`` for the products, and what to multiply the products by (``None``: 1)."""
    if dtype != torch.float16:
        return logit_grad.to(dtype), None
    peak = torch.linalg.vector_norm(logit_grad, float("inf"))
    power = torch.where(peak > 0, torch.floor(torch.log2(torch.where(peak > 0, peak, 1.0))) + 1.0, 0.0)
    return torch.mul(logit_grad, torch.exp2(-power)).to(dtype), torch.exp2(power)


def half(queries: Tensor, keys: Tensor) -> bool:
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
        >>> torch.allclose(add_product_(out.clone(), a, b), out + a.float() @ b.float())
        True
    """
    if first.dtype == second.dtype and first.dtype in _HALF and out_dtype_products(first.device):
        return torch.addmm(out, first, second, out_dtype=out.dtype, out=out)
    return out.addmm_(upcast(first), upcast(second))
