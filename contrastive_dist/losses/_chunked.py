"""The one cross-entropy every softmax loss here is built on: local rows against gathered columns.

For query rows ``q_i`` (this rank's samples), key columns ``k_j`` (the gathered global batch),
a scale ``s`` and, per row, an optional excluded column (the row's own sample), it computes each
row's loss ``ℓ_i = logsumexp_{j ≠ excluded_i}(l_ij) − Σ_j t_ij · l_ij`` with ``l_ij = s · q_i·k_j``
and a target distribution ``t_i``: one positive column (CLIP, NT-Xent) or the mean over the
columns that share the row's label (SupCon). Logits are formed one block of ``chunk_size`` rows at
a time (all rows in one block when ``chunk_size`` is None), each block against *all* columns, so
every row is exact and at most ``chunk_size × N`` logits exist at once.

**Precision.** Each row's positive is taken out inside its own row, relative to the row maximum
``m_i``, and one term of size 1 stays out of the sum so that ``log1p`` sees only the rest::

    one positive column p:  ℓ_i = (m_i − l_ip) + log1p(S_i + e_i − 1),
                            S_i = Σ_{j ≠ p} exp(l_ij − m_i),  e_i = exp(l_ip − m_i)  (exactly 1 if p is the max)
    label mask (SupCon):    ℓ_i = (m_i − mean_{p ∈ P} l_ip) + log1p(S'_i + c_i − 1),
                            S'_i the sum without the c_i terms equal to the maximum

Both parts are ≥ 0, so a row's loss is never negative, a row whose positive is its only candidate
gives exactly 0, and a small loss keeps float32's relative precision (``log1p`` of a small sum,
instead of a difference of two large, separately rounded sums). The gradient's positive entry,
``p − 1 = −S / (S + e)``, is formed without cancellation for the same reason.

The core runs in float32 (float64 stays float64) with autocast off: inputs are upcast with
differentiable casts, so their gradients come back in their own dtype. Half-precision logits,
sums and gradient accumulators would overflow (fp16) or drift by percents over many blocks (bf16).

**Speed.** With ``reduction="sum"`` the result is ``Σ_i w_i ℓ_i`` for per-row weights ``w_i``
(the caller's weights and normalisation); its upstream gradient is one scalar, so the gradients
are formed block by block during the forward pass (three matrix products per block: the logits,
``G @ K`` and ``Gᵀ @ Q``) and only multiplied by that scalar in backward. Recomputing the logits in
backward costs a fourth product per block and measured slower on CPU (the
``clip_chunk256_recompute`` row of ``benchmarks/losses.py``). With ``reduction="none"`` the result
is the vector of ``ℓ_i``: the key gradient then mixes every row's upstream gradient, which is only
known in backward (forming it in forward would keep the whole ``n × N`` softmax), so that mode
computes the rows in forward and recomputes the block in backward with the upstream gradients as
row weights.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from contrastive_dist._validation import compute_dtype
from contrastive_dist.losses._softmax_block import Grads, Targets, block_rows

__all__ = [
    "Targets",
    "contract_factor",
    "cross_entropy",
    "first_order_only",
    "full_precision",
    "upcast",
]

Backward = Callable[..., tuple[Tensor | None, ...]]


def first_order_only(backward: Backward) -> Backward:
    """Mark the ``backward`` of a Function whose gradients are formed in forward as not differentiable.

    ``once_differentiable`` alone stays silent when the incoming gradient is a constant (the usual
    ``grad(loss, x, create_graph=True)``): the second derivative would quietly miss this term. So
    a backward run with ``create_graph=True`` (grad mode on) raises instead.
    """
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx: Any, *grad_outputs: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through the contrastive losses' fused kernels is not "
                "supported: their gradients are formed in forward (once_differentiable)"
            )
        return once(ctx, *grad_outputs)

    return checked


def contract_factor(count: int, world_size: int) -> float:
    """``W / count``: turns a rank's sum of per-sample losses into its share of the global mean.

    With ``count == 0`` (an empty global batch) the factor is 0, so the loss is a zero that is
    still connected to the gathered tensors (every rank then still runs the backward collective).
    """
    return world_size / count if count > 0 else 0.0


def full_precision(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``device``: the loss core chooses its own dtype (see :func:`upcast`)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def upcast(tensor: Tensor) -> Tensor:
    """``tensor`` in the core's dtype (float64 stays, the rest becomes float32); differentiable."""
    return tensor.to(compute_dtype(tensor.dtype))


def cross_entropy(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    targets: Targets,
    *,
    chunk_size: int | None = None,
    row_weights: Tensor | None = None,
    reduction: Literal["sum", "none"] = "sum",
) -> Tensor:
    """``Σ_i w_i ℓ_i`` (``"sum"``, ``w = 1`` by default) or the rows ``ℓ_i`` (``"none"``); see the module docstring.

    Shape:
        queries: ``(n, D)``; keys: ``(N, D)``; scale: ``()``; row_weights: ``(n,)`` (no gradient);
        output: ``()`` or ``(n,)``, float32 or float64.
    """
    chunk = chunk_size if chunk_size is not None else max(queries.shape[0], 1)
    with full_precision(queries.device):
        queries, keys = upcast(queries), upcast(keys)
        scale = scale.to(queries.dtype)
        if reduction == "none":
            return _RowsRecomputedInBackward.apply(queries, keys, scale, targets, chunk)
        weights = None if row_weights is None else row_weights.detach().to(queries.dtype)
        # One flag per input: a key side without gradient skips its N × D accumulator and product.
        wanted = tuple(torch.is_grad_enabled() and t.requires_grad for t in (queries, keys, scale))
        return _SumGradInForward.apply(queries, keys, scale, targets, weights, chunk, *wanted)


def _all_blocks(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    targets: Targets,
    weights: Tensor | None,
    chunk: int,
    grads: Grads | None,
) -> Tensor:
    """Every block in turn; returns the rows ``ℓ_i`` and fills ``grads`` (weighted by ``weights``)."""
    if grads is not None and grads.query is None and grads.key is None and grads.scale is None:
        grads = None  # nothing needs a gradient (inference): the losses alone, one product per block
    rows = queries.new_empty(queries.shape[0])
    # Label targets need two more chunk × N buffers per block: allocated once, reused by every block.
    labelled = targets.columns is None and queries.shape[0] > 0
    scratch = queries.new_empty(2, min(chunk, queries.shape[0]), keys.shape[0]) if labelled else None
    for start in range(0, queries.shape[0], chunk):
        stop = min(start + chunk, queries.shape[0])
        block_weights = None if weights is None else weights[start:stop]
        rows[start:stop] = block_rows(queries, keys, scale, targets, start, stop, block_weights, grads, scratch)
    return rows


class _SumGradInForward(torch.autograd.Function):
    """``Σ_i w_i ℓ_i`` whose gradients are formed in forward and scaled in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        queries: Tensor,
        keys: Tensor,
        scale: Tensor,
        targets: Targets,
        weights: Tensor | None,
        chunk: int,
        want_query: bool,
        want_key: bool,
        want_scale: bool,
    ) -> Tensor:
        grads = Grads.allocate(queries, keys, want_query, want_key, want_scale)
        rows = _all_blocks(queries, keys, scale, targets, weights, chunk, grads)
        ctx.save_for_backward(grads.query, grads.key, grads.scale)
        return rows.sum() if weights is None else rows @ weights

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = tuple(None if grad is None else grad * grad_output for grad in ctx.saved_tensors)
        return (*grads, None, None, None, None, None, None)


class _RowsRecomputedInBackward(torch.autograd.Function):
    """The rows ``ℓ_i``; backward runs the blocks again with the upstream gradients as row weights."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, targets: Targets, chunk: int
    ) -> Tensor:
        ctx.save_for_backward(queries, keys, scale)
        ctx.targets, ctx.chunk = targets, chunk
        return _all_blocks(queries, keys, scale, targets, None, chunk, None)

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        queries, keys, scale = ctx.saved_tensors
        grads = Grads.allocate(queries, keys, *ctx.needs_input_grad[:3])
        _all_blocks(queries, keys, scale, ctx.targets, grad_rows.to(queries.dtype), ctx.chunk, grads)
        return grads.query, grads.key, grads.scale, None, None
