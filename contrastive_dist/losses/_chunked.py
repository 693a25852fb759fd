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
(see ``benchmarks/losses.py``); it is kept behind ``_GRADIENTS_IN_FORWARD`` for that comparison.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["contract_factor", "local_cross_entropy_sum", "sum_logsumexp"]

_GRADIENTS_IN_FORWARD = True
"""Form gradients in forward (3 products per block) rather than recompute them in backward (4)."""


def contract_factor(count: int, world_size: int) -> float:
    """``W / count``: turns a rank's sum of per-sample losses into its share of the global mean.

    With ``count == 0`` (an empty global batch) the factor is 0, so the loss is a zero that is
    still connected to the gathered tensors (every rank then still runs the backward collective).
    """
    return world_size / count if count > 0 else 0.0


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
        excluded: ``(n,)`` column indices into ``keys``; output: ``()``.
    """
    positive_logits = (queries * positive_keys).sum() * scale
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
    want_gradients = torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys, scale))
    if _GRADIENTS_IN_FORWARD:
        return _LogSumExpGradInForward.apply(queries, keys, scale, excluded, chunk_size, want_gradients)
    return _LogSumExpRecompute.apply(queries, keys, scale, excluded, chunk_size)


def _block_logits(
    queries: Tensor, keys: Tensor, scale: Tensor, excluded: Tensor | None, start: int, stop: int
) -> Tensor:
    """Logits of query rows ``start:stop`` against every key, excluded entries at ``-inf``."""
    logits = (queries[start:stop] * scale) @ keys.T
    if excluded is not None:
        logits.scatter_(1, excluded[start:stop, None], float("-inf"))
    return logits


def _block_gradients(
    probabilities: Tensor, queries: Tensor, keys: Tensor, scale: Tensor, start: int, stop: int, key_grad: Tensor
) -> tuple[Tensor, Tensor]:
    """For one row block with softmax ``P``: ``(P @ K, Σ q⊙(P @ K))``; adds ``s·Pᵀ q`` into ``key_grad``."""
    weighted_keys = probabilities @ keys
    block_queries = queries[start:stop]
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
        want_gradients: bool,
    ) -> Tensor:
        total = queries.new_zeros(())
        query_grad = torch.empty_like(queries) if want_gradients else None
        key_grad = torch.zeros_like(keys) if want_gradients else None
        scale_grad = queries.new_zeros(())
        for start in range(0, queries.shape[0], chunk_size):
            stop = min(start + chunk_size, queries.shape[0])
            logits = _block_logits(queries, keys, scale, excluded, start, stop)
            if query_grad is None or key_grad is None:
                total += torch.logsumexp(logits, dim=1).sum()
                continue
            # One exp pass serves both the logsumexp and the softmax: exp(logits - row max) in
            # place, then normalise by the row sums. (logsumexp + a second exp costs two.)
            row_max = logits.amax(dim=1, keepdim=True).nan_to_num_(neginf=0.0)
            row_sum = logits.sub_(row_max).exp_().sum(dim=1, keepdim=True)
            total += (row_max + row_sum.log()).sum()
            probabilities = logits.div_(row_sum)  # reuses the logits' memory
            weighted_keys, scale_part = _block_gradients(probabilities, queries, keys, scale, start, stop, key_grad)
            query_grad[start:stop] = weighted_keys * scale
            scale_grad += scale_part
        ctx.save_for_backward(query_grad, key_grad, scale_grad)
        ctx.scale_dtype = scale.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query_grad, key_grad, scale_grad = ctx.saved_tensors
        if query_grad is None:
            raise RuntimeError("sum_logsumexp: gradients were not formed in forward (it ran without grad mode)")
        return (
            query_grad * grad_output,
            key_grad * grad_output,
            (scale_grad * grad_output).to(ctx.scale_dtype),
            None,
            None,
            None,
        )


class _LogSumExpRecompute(torch.autograd.Function):
    """Row-block logsumexp that keeps only per-row results and recomputes the logits in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, queries: Tensor, keys: Tensor, scale: Tensor, excluded: Tensor | None, chunk_size: int
    ) -> Tensor:
        row_lse = queries.new_empty(queries.shape[0])
        for start in range(0, queries.shape[0], chunk_size):
            stop = min(start + chunk_size, queries.shape[0])
            row_lse[start:stop] = torch.logsumexp(_block_logits(queries, keys, scale, excluded, start, stop), dim=1)
        ctx.save_for_backward(queries, keys, scale, excluded, row_lse)
        ctx.chunk_size = chunk_size
        return row_lse.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        queries, keys, scale, excluded, row_lse = ctx.saved_tensors
        query_grad = torch.empty_like(queries)
        key_grad = torch.zeros_like(keys)
        scale_grad = queries.new_zeros(())
        for start in range(0, queries.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, queries.shape[0])
            logits = _block_logits(queries, keys, scale, excluded, start, stop)
            probabilities = logits.sub_(row_lse[start:stop, None]).exp_()
            weighted_keys, scale_part = _block_gradients(probabilities, queries, keys, scale, start, stop, key_grad)
            query_grad[start:stop] = weighted_keys * scale
            scale_grad += scale_part
        return query_grad * grad_output, key_grad * grad_output, scale_grad * grad_output, None, None
