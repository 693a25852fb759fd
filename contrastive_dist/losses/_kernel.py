"""What both kernel passes share: the families, a call's fixed parts, logits, chunks and the gradient accumulation.

A family (:mod:`._softmax`, :mod:`._sigmoid`) says what a block does to its rows' state and what
its gradient is; a transport (:mod:`._columns`) says which blocks a rank meets and where their
gradients go. This module runs one against the other, forming the logits ``s · Q Kᵀ (+ b)`` of
``chunk`` rows at a time against one block, so at most ``chunk × block`` logits exist at once:

* :func:`._recomputed.pair_losses` — the rows' losses ``ℓ_i`` (and, in ring mode's symmetric losses,
  the columns' own losses from the same logits); backward meets every block again, recomputing its
  logits, with the upstream gradients as row weights. Any transport.
* :func:`._fused.weighted_pair_sum` — ``Σ_i w_i ℓ_i`` with every column in one block (gather mode): a
  row's state is complete after its block, so the gradient is formed in forward from the same logits
  (three products per block, the CPU floor; backward only scales it).

From a block's logit gradient ``G`` one routine, :func:`accumulate`, adds the queries'
``s · G K``, the keys' ``s · Gᵀ Q``, the scale's ``Σ Q ⊙ (G K)`` and the bias's ``Σ G``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.engine._ring import Block
from contrastive_dist.losses import _decoupled, _sigmoid, _softmax
from contrastive_dist.losses._columns import Transport
from contrastive_dist.losses._precision import add_product_, full_precision, product, upcast
from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._targets import RowTargets, Targets

__all__ = [
    "DECOUPLED",
    "LOCAL",
    "SIGMOID",
    "SOFTMAX",
    "Family",
    "Grads",
    "Pairs",
    "RowSums",
    "accumulate",
    "block_rows",
    "chunk_budget",
    "chunks",
    "first_order_only",
    "formed_in_forward",
    "as_input",
    "grads_for",
    "scaled",
    "block_logits",
    "own_block",
    "transposed_copy",
    "gradients_wanted",
    "with_local",
]

LOCAL = -2
"""The ``owner`` of the columns held here (shared negatives): no rank's block, no transfer, no gradient."""


class Family(NamedTuple):
    """The functions of one loss family (see :mod:`._softmax` for their contracts)."""

    width: int
    empty_state: Callable[[int, Tensor], Tensor]
    block_state_: Callable[[Tensor, Targets, SameKey | None], Tensor]
    merge_: Callable[[Tensor, Tensor], None]
    merged: Callable[[Tensor], Tensor]
    finish: Callable[[Tensor], Tensor]
    has_positive: Callable[[Tensor], Tensor]
    numerators_: Callable[..., Tensor]
    gradient_: Callable[[Tensor, Tensor, Targets, SameKey | None, Tensor | float], Tensor]
    rebase_: Callable[[Tensor, Tensor, Tensor], Tensor]


def _family(module: Any) -> Family:
    return Family(module.WIDTH, *(getattr(module, name) for name in Family._fields[1:]))


SOFTMAX, SIGMOID = _family(_softmax), _family(_sigmoid)
DECOUPLED = SOFTMAX._replace(
    finish=_decoupled.finish, has_positive=_decoupled.has_positive, gradient_=_decoupled.gradient_
)
"""The softmax family with the positives out of the sum (DCL): see :mod:`._decoupled`."""


class Pairs(NamedTuple):
    """Everything of one kernel call that is not differentiated.

    Attributes:
        family: :data:`SOFTMAX`, :data:`DECOUPLED` or :data:`SIGMOID`.
        rows: where the rows' positives and excluded columns sit in their own rank's block, their keys.
        transport: which blocks the rows meet.
        chunk: rows per logit block; ``None``: chosen from the block's shape (:func:`default_chunk`).
        column_keys: ``(m,)`` the keys of the transport's block of columns (gather: every rank's; ring:
            this rank's), or ``None``.
        key_rows: ring mode: the number of columns in each rank's block.
        column_key_rows: ring mode: the number of keys in each rank's block of :attr:`column_keys`
            (columns past the end of a block's keys have none: they share no key with any row);
            default :attr:`key_rows`.
        columns: symmetric losses: per rank, how many of its columns have a loss of their own
            (InfoNCE's texts; negatives have none), from the same logits: the leading columns of its
            block in ring mode, of the one block (every rank's, in rank order) in gather mode;
            ``None``: the columns have no loss.
        local_keys: ``(K, D)`` extra columns held here (shared negatives), met by every row, no gradient.
        local_column_keys: ``(K,)`` their keys, or ``None``.
        column_weights: gather mode's symmetric losses: ``(Σ columns,)`` the weights of the block's
            columns with a loss (their pairs' weights, gathered), or ``None`` (all 1).
        gram: Gram losses (the rows are this rank's own block of the columns, the same vectors): the
            targets of every row of the global matrix, in the columns' order (:mod:`._gram`); else ``None``.
    """

    family: Family
    rows: RowTargets
    transport: Transport
    chunk: int | None
    column_keys: Tensor | None = None
    key_rows: tuple[int, ...] = ()
    column_key_rows: tuple[int, ...] | None = None
    columns: tuple[int, ...] | None = None
    local_keys: Tensor | None = None
    local_column_keys: Tensor | None = None
    column_weights: Tensor | None = None
    gram: RowTargets | None = None


Backward = Callable[..., tuple[Tensor | None, ...]]


def formed_in_forward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
    """A backward whose gradients were formed in forward: each saved one times the total's incoming gradient.

    ``ctx.saved_tensors`` hold the gradients of the total (``None`` where not wanted) and ``ctx.dtypes``
    their inputs' dtypes, in the same order.
    """
    saved = zip(ctx.saved_tensors, ctx.dtypes, strict=True)
    return tuple(None if grad is None else (grad * grad_total).to(dtype) for grad, dtype in saved)


def first_order_only(backward: Backward) -> Backward:
    """Mark a kernel's ``backward`` as not differentiable, and run it with autocast off.

    ``create_graph=True`` raises instead of being wrong.

    ``once_differentiable`` alone stays silent when the incoming gradient is a constant (the usual
    ``grad(loss, x, create_graph=True)``): the second derivative would quietly miss this term.
    """
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx: Any, *grad_outputs: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through the contrastive losses' kernels is not "
                "supported: their gradients are formed block by block (once_differentiable)"
            )
        # A backward called inside torch.autocast recomputes in the forward's dtype, not autocast's.
        with full_precision(grad_outputs[0].device):
            return once(ctx, *grad_outputs)

    return checked


def _half(queries: Tensor, keys: Tensor) -> bool:
    """Whether a block's products take half operands (:mod:`._precision`): both sides in one half dtype."""
    return queries.dtype == keys.dtype and queries.dtype in (torch.bfloat16, torch.float16)


def block_logits(queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """``s · Q Kᵀ (+ b)`` of one chunk of rows against one block, in the core's dtype."""
    if _half(queries, keys) or queries.dtype != keys.dtype:
        logits = product(queries, keys.T).mul_(scale)  # the scale in float32, after the product
        return logits if bias is None else logits.add_(bias)
    if bias is None:
        return (queries * scale) @ keys.T
    return torch.addmm(bias.expand(1, 1), queries * scale, keys.T)


def transposed_copy(logits: Tensor) -> Tensor:
    """A copy of ``logits``, seen transposed: the columns' rows.

    Laid out like the logits, so that adding their gradient back is a plain elementwise pass.
    """
    return logits.clone().T


BLOCK_LOGITS = 2**24
"""The default chunk's budget for a block serving both directions of a symmetric loss in one pass off
CUDA, and what a call may keep for backward: at most this many logits (64 MiB in float32)."""

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
    """Rows per block when ``chunk_size=None``, chosen from the block's shape.

    Every row if the block holds at most ``budget`` logits (formed whole), else the most rows under
    that, in multiples of 64, and at least ``least``.

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


def chunks(
    rows: int, chunk: int | None, columns: int = 0, *, budget: tuple[int, int] = (BLOCK_LOGITS, 64)
) -> list[tuple[int, int]]:
    """``(start, stop)`` of each chunk of ``rows`` rows against ``columns`` (``None``: :func:`default_chunk`).

    ``budget``: the default chunk's logits and least rows (:func:`chunk_budget`).
    """
    size = default_chunk(rows, columns, *budget) if chunk is None else chunk
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def chunk_budget(queries: Tensor, *, one_pass_symmetric: bool = False) -> tuple[int, int]:
    """The default chunk's budget for blocks of ``queries``: its logits and its least rows.

    :data:`CUDA_BLOCK_LOGITS` on CUDA; elsewhere :data:`BLOCK_LOGITS` for a symmetric block formed in one
    pass (in chunks it would cost a fourth product), else :data:`CPU_BLOCK_LOGITS` with at least
    :data:`CPU_CHUNK_ROWS` rows.
    """
    if queries.is_cuda:
        return CUDA_BLOCK_LOGITS, 64
    if one_pass_symmetric:
        return BLOCK_LOGITS, 64
    return CPU_BLOCK_LOGITS, CPU_CHUNK_ROWS


class Grads(NamedTuple):
    """Gradient accumulators of one kernel call.

    Attributes:
        query: ``(n, D)`` the queries' ``Σ G K``, unscaled (:func:`scaled` applies the scale once,
            after the last block), when the queries or the scale need a gradient; else ``None``.
        bias: ``()`` the bias's ``Σ G``, or ``None``.
        want_query, want_scale: which of the queries and the scale need a gradient.
    """

    query: Tensor | None
    bias: Tensor | None
    want_query: bool
    want_scale: bool


def accumulate(
    logit_grad: Tensor,
    queries: Tensor,
    keys: Tensor,
    start: int,
    grads: Grads,
    key_grad: Tensor | None,
) -> None:
    """From ``G = ∂(Σ w ℓ)/∂logits`` of rows ``start:`` against ``keys``: add every input's gradient, unscaled.

    The queries' ``G K`` (into ``grads.query``), the keys' ``Gᵀ Q`` (into ``key_grad``), the bias's
    ``Σ G`` (into ``grads.bias``; where the epilogue summed ``G``'s rows, :class:`RowSums` adds them).
    The logits' scale ``s`` multiplies both products: it is applied once, after the last block
    (:func:`scaled`; the keys' accumulator by its owner), which also forms the scale's gradient
    ``Σ Q ⊙ (G K)``. The accumulators are in the core's dtype; half operands multiply ``G`` rounded to
    their dtype. In float16, whose range is narrow, ``G`` is first multiplied by a power of two that
    brings its largest entry to [½, 1) and the products are divided by it: the row weights folded into
    ``G`` (upstream gradients ≈ 1/N) would otherwise push its entries below float16's smallest numbers.
    """
    if grads.bias is not None:
        grads.bias.add_(logit_grad.sum())
    half = _half(queries, keys)
    if not half and queries.dtype != keys.dtype:  # a block held here in another dtype (a float32 queue)
        queries, keys = upcast(queries), upcast(keys)
    factor, unscale = _rounded(logit_grad, queries.dtype) if half else (logit_grad, None)
    for accumulator, first, second in ((key_grad, factor.T, queries), (_rows(grads, start, queries), factor, keys)):
        if accumulator is None:
            continue
        if unscale is None:  # accumulated in the product, beta = 1
            add_product_(accumulator, first, second)
        else:
            accumulator.add_(product(first, second).mul_(unscale))


class RowSums:
    """The bias's gradient from the fused epilogue's row sums of ``G``, chunk after chunk, added in one launch.

    Summed and added chunk by chunk they would cost two launches each, and a launch costs the host as
    much as a small chunk's work on a GPU.

    Example:
        >>> import torch
        >>> grads = Grads(None, torch.zeros(()), False, False)
        >>> sums = RowSums(grads)
        >>> sums.grads_for(torch.ones(2)).bias is None, sums.grads_for(torch.ones(3)).bias is None
        (True, True)
        >>> sums.add(); grads.bias
        tensor(5.)
    """

    def __init__(self, grads: Grads) -> None:
        self.grads = grads
        self.parts: list[Tensor] = []

    def grads_for(self, grad_sums: Tensor | None) -> Grads:
        """What :func:`accumulate` takes for a block whose rows' ``Σ_j G_ij`` are ``grad_sums``.

        The sums are kept here and the bias left out; ``None``: no sums, the bias from ``G``.
        """
        if grad_sums is None:
            return self.grads
        self.parts.append(grad_sums)
        return self.grads._replace(bias=None)

    def add(self) -> None:
        """Add the kept sums to the bias's gradient (once, after the last block)."""
        if self.parts and self.grads.bias is not None:
            self.grads.bias.add_((self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)).sum())
        self.parts.clear()


def _rows(grads: Grads, start: int, queries: Tensor) -> Tensor | None:
    return None if grads.query is None else grads.query[start : start + queries.shape[0]]


def scaled(grads: Grads, queries: Tensor, scale: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The queries' gradient ``s · Σ G K`` and the scale's ``Σ Q ⊙ (Σ G K)``, from :attr:`Grads.query`."""
    if grads.query is None:
        return None, None
    scale_grad = (upcast(queries) * grads.query).sum() if grads.want_scale else None
    return (grads.query.mul_(scale) if grads.want_query else None), scale_grad


def _rounded(logit_grad: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``G`` in a half ``dtype`` for the products, and what to multiply the products by (``None``: 1).

    bfloat16 has float32's range: ``G`` is only rounded. float16's smallest normal number is 6e-5:
    ``G`` is scaled by a power of two first (exact), so that its largest entry is in [½, 1).
    """
    if dtype != torch.float16:
        return logit_grad.to(dtype), None
    peak = torch.linalg.vector_norm(logit_grad, float("inf"))
    power = torch.where(peak > 0, torch.floor(torch.log2(torch.where(peak > 0, peak, 1.0))) + 1.0, 0.0)
    return torch.mul(logit_grad, torch.exp2(-power)).to(dtype), torch.exp2(power)


def gradients_wanted(*tensors: Tensor | None) -> tuple[bool, ...]:
    return tuple(tensor is not None and torch.is_grad_enabled() and tensor.requires_grad for tensor in tensors)


def grads_for(queries: Tensor, scale: Tensor, want_query: bool, want_scale: bool, want_bias: bool) -> Grads:
    """Fresh accumulators, in the core's dtype (``scale``'s) whatever the queries' dtype."""
    query = torch.zeros_like(queries, dtype=scale.dtype) if want_query or want_scale else None
    return Grads(query, scale.new_zeros(()) if want_bias else None, want_query, want_scale)


def as_input(grad: Tensor | None, like: Tensor) -> Tensor | None:
    """A gradient handed back to an input: in the input's dtype."""
    return None if grad is None else grad.to(like.dtype)


def own_block(keys: Tensor, column_keys: Tensor | None) -> Block:
    return (keys,) if column_keys is None else (keys, column_keys)


def block_rows(pairs: Pairs, *, with_columns: bool = False) -> list[tuple[int, ...]]:
    """Ring mode's rows per rank of each tensor of a block: keys, their keys, then the columns' states."""
    rows = [pairs.key_rows]
    if pairs.column_keys is not None:
        rows.append(pairs.column_key_rows if pairs.column_key_rows is not None else pairs.key_rows)
    if with_columns:
        rows.append(pairs.columns or ())
    return rows

def with_local(keys: Tensor, column_keys: Tensor | None, pairs: Pairs) -> tuple[Tensor, Tensor | None]:
    """The one block of gather mode, with the columns held here (shared negatives) appended.

    Their keys follow the block's (which must then cover every column before them); without keys
    of their own they share none with any row.
    """
    if pairs.local_keys is None:
        return keys, column_keys
    if pairs.local_column_keys is not None and column_keys is not None:
        column_keys = torch.cat((column_keys, pairs.local_column_keys))
    return torch.cat((keys, pairs.local_keys.to(keys.dtype))), column_keys


