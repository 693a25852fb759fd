"""The one cross-entropy every softmax loss here is built on: local rows against gathered columns.

For query rows ``q_i`` (this rank's samples), key columns ``k_j`` (the gathered global batch),
a scale ``s`` and, per row, an optional excluded column (the row's own sample) and a positive
key ``p_i``, it returns::

    Σ_i  [ logsumexp_{j ≠ excluded_i} (s · q_i·k_j)  −  s · q_i·p_i ]

The positive term is linear in the logits, so it never needs the ``n × N`` matrix; only the
logsumexp does. It is computed one block of ``chunk_size`` query rows at a time (all rows in
one block when ``chunk_size`` is None), each block against *all* columns, so the log-sum-exp of every row is
exact (max-subtracted over the full row, no approximation) and at most ``chunk_size × N``
logits exist at once. Because the result is a sum, its upstream gradient is one scalar: the
gradients are formed block by block during the forward pass (the same three matrix products
per block as autograd would run) and only multiplied by that scalar in backward. Recomputing
the logits in backward instead costs a fourth product per block and measured slower on CPU
(the ``clip_chunk256_recompute`` row of ``benchmarks/losses.py``, which holds that variant).

**Precision.** The core runs in float32 (float64 inputs stay float64) with autocast off: the
inputs are upcast with differentiable casts, so their gradients come back in their own dtype,
and the returned sum is float32. Half-precision logits, sums and gradient accumulators would
overflow (fp16) or drift by percents over many blocks (bf16).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.losses._checks import compute_dtype

__all__ = [
    "contract_factor",
    "first_order_only",
    "full_precision",
    "local_cross_entropy_sum",
    "sum_logsumexp",
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


def local_cross_entropy_sum(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    positive_keys: Tensor,
    *,
    excluded: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """``Σ_i [logsumexp_{j ≠ excluded_i}(s·q_i·k_j) − s·q_i·p_i]`` (see the module docstring).

    Shape:
        queries: ``(n, D)``; keys: ``(N, D)``; scale: ``()``; positive_keys: ``(n, D)``;
        excluded: ``(n,)`` column indices into ``keys``; output: ``()``, float32 or float64.
    """
    with full_precision(queries.device):
        queries, keys, positive_keys = upcast(queries), upcast(keys), upcast(positive_keys)
        positive_logits = (queries * positive_keys).sum() * scale.to(queries.dtype)
        return sum_logsumexp(queries, keys, scale, excluded=excluded, chunk_size=chunk_size) - positive_logits


def sum_logsumexp(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    *,
    excluded: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """``Σ_i logsumexp_{j ≠ excluded_i}(s · q_i·k_j)``, whole (``chunk_size=None``) or in row blocks."""
    if chunk_size is None:
        # One block of all rows: the same fused kernel, which measured faster than autograd's
        # logsumexp (one exp pass instead of two, no softmax re-materialised in backward).
        chunk_size = max(queries.shape[0], 1)
    with full_precision(queries.device):
        queries, keys = upcast(queries), upcast(keys)
        scale = scale.to(queries.dtype)
        # One flag per input: a key side without gradient skips its N × D accumulator and product.
        wanted = tuple(torch.is_grad_enabled() and t.requires_grad for t in (queries, keys, scale))
        return _LogSumExpGradInForward.apply(queries, keys, scale, excluded, chunk_size, *wanted)


def block_logits(
    queries: Tensor, keys: Tensor, scale: Tensor, excluded: Tensor | None, start: int, stop: int
) -> Tensor:
    """Logits of query rows ``start:stop`` against every key, excluded entries at ``-inf``."""
    logits = (queries[start:stop] * scale) @ keys.T
    if excluded is not None:
        logits.scatter_(1, excluded[start:stop, None], float("-inf"))
    return logits


def block_gradients(
    probabilities: Tensor,
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    start: int,
    stop: int,
    key_grad: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """For one row block with softmax ``P``: ``(P @ K, Σ q⊙(P @ K))``; adds ``s·Pᵀ q`` into ``key_grad``."""
    weighted_keys = probabilities @ keys
    block_queries = queries[start:stop]
    if key_grad is not None:
        key_grad.addmm_(probabilities.T, block_queries * scale)
    return weighted_keys, (block_queries * weighted_keys).sum()


class _LogSumExpGradInForward(torch.autograd.Function):
    """Row-block logsumexp whose gradients are formed in forward and scaled in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        queries: Tensor,
        keys: Tensor,
        scale: Tensor,
        excluded: Tensor | None,
        chunk_size: int,
        want_query: bool,
        want_key: bool,
        want_scale: bool,
    ) -> Tensor:
        total = queries.new_zeros(())
        query_grad = torch.empty_like(queries) if want_query else None
        key_grad = torch.zeros_like(keys) if want_key else None
        scale_grad = queries.new_zeros(()) if want_scale else None
        for start in range(0, queries.shape[0], chunk_size):
            stop = min(start + chunk_size, queries.shape[0])
            logits = block_logits(queries, keys, scale, excluded, start, stop)
            if not (want_query or want_key or want_scale):
                total += torch.logsumexp(logits, dim=1).sum()
                continue
            # One exp pass serves both the logsumexp and the softmax: exp(logits - row max) in
            # place, then normalise by the row sums. (logsumexp + a second exp costs two.)
            row_max = logits.amax(dim=1, keepdim=True).nan_to_num_(neginf=0.0)
            row_sum = logits.sub_(row_max).exp_().sum(dim=1, keepdim=True)
            total += (row_max + row_sum.log()).sum()
            probabilities = logits.div_(row_sum)  # reuses the logits' memory
            if not (want_query or want_scale):
                key_grad.addmm_(probabilities.T, queries[start:stop] * scale)  # type: ignore[union-attr]
                continue
            weighted_keys, scale_part = block_gradients(probabilities, queries, keys, scale, start, stop, key_grad)
            if query_grad is not None:
                query_grad[start:stop] = weighted_keys * scale
            if scale_grad is not None:
                scale_grad += scale_part
        ctx.save_for_backward(query_grad, key_grad, scale_grad)
        return total

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = tuple(None if grad is None else grad * grad_output for grad in ctx.saved_tensors)
        return (*grads, None, None, None, None, None)
