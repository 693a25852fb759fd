"""One block of query rows against every key column: the rows' losses and, optionally, their gradients.

The formulas and why they are arranged this way are in :mod:`contrastive_dist.losses._chunked`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Grads", "Targets", "block_rows"]


class Targets(NamedTuple):
    """What each query row must pick, and which column it must not see.

    Attributes:
        columns: ``(n,)`` the positive's column per row (CLIP, NT-Xent), or None.
        query_labels: ``(n,)`` with ``key_labels`` ``(N,)``: the positives are the columns with
            the row's label (SupCon; the target is their mean), or None. Floating-point class
            indices (exact: below 2**24 in float32).
        key_labels: see ``query_labels``.
        excluded: ``(n,)`` a column each row leaves out of its softmax (its own sample), or None.
    """

    columns: Tensor | None = None
    query_labels: Tensor | None = None
    key_labels: Tensor | None = None
    excluded: Tensor | None = None


@dataclass
class Grads:
    """Gradient accumulators of the inputs that need one (None for the others)."""

    query: Tensor | None
    key: Tensor | None
    scale: Tensor | None

    @staticmethod
    def allocate(queries: Tensor, keys: Tensor, want_query: bool, want_key: bool, want_scale: bool) -> Grads:
        """Fresh accumulators: queries' rows are written block by block, keys and scale are summed."""
        return Grads(
            torch.empty_like(queries) if want_query else None,
            torch.zeros_like(keys) if want_key else None,
            queries.new_zeros(()) if want_scale else None,
        )


def block_rows(
    queries: Tensor,
    keys: Tensor,
    scale: Tensor,
    targets: Targets,
    start: int,
    stop: int,
    weights: Tensor | None,
    grads: Grads | None,
    scratch: Tensor | None = None,
) -> Tensor:
    """``ℓ_i`` of rows ``start:stop``; adds ``w_i · ∂ℓ_i`` into ``grads`` when given (``w = 1`` if None).

    ``scratch`` (label targets only): two ``chunk × N`` buffers reused by every block, since a fresh
    large allocation per block costs page faults comparable to an elementwise pass.

    Shape:
        queries: ``(n, D)``; keys: ``(N, D)``; weights: ``(stop − start,)``; output: ``(stop − start,)``;
        scratch: ``(2, ≥ stop − start, N)``.
    """
    block = queries[start:stop]
    logits = (block * scale) @ keys.T
    columns = None if targets.columns is None else targets.columns[start:stop, None]
    if columns is not None:
        positive = logits.gather(1, columns).squeeze(1)
    else:
        # The mean positive logit from the logits themselves: no class sum minus the anchor,
        # which cancels for large features.
        if scratch is None:
            scratch = logits.new_empty(2, *logits.shape)
        mask_buffer, spare = scratch[0, : stop - start], scratch[1, : stop - start]
        positive_mask = _positive_mask(targets, start, stop, out=mask_buffer)
        # At least 1: a row without positives (weight 0 in SupCon) stays finite instead of 0 / 0.
        positive_count = positive_mask.sum(dim=1).clamp_(min=1.0)
        positive = torch.mul(positive_mask, logits, out=spare).sum(dim=1) / positive_count
    if targets.excluded is not None:
        logits.scatter_(1, targets.excluded[start:stop, None], float("-inf"))
    # amax, not max(dim) with indices: the latter costs as much as the exp pass on CPU.
    row_max = logits.amax(dim=1)
    shifted = logits.sub_(row_max[:, None])  # in place: the logits' memory serves the softmax
    if columns is not None:
        # One term left out of the sum, the positive's own: S = Σ_{j ≠ pos} exp(l_j − m), and
        # ℓ = (m − l_pos) + log1p(S + e_pos − 1), with e_pos exactly 1 when the positive is the maximum.
        positive_shift = positive - row_max
        own = torch.where(positive_shift == 0, 1.0, positive_shift.exp())
        exponentials = shifted.exp_().scatter_(1, columns, 0.0)
        others = exponentials.sum(dim=1)
        row_sum = others + own
        rows = torch.log1p(others + (own - 1.0)) - positive_shift
    else:
        # The maximum's own term (exactly 1) left out of the sum, counted instead: ties included.
        # (Comparisons written into a float tensor: several times faster than bool masks on CPU.)
        at_max = torch.eq(shifted, 0.0, out=spare)
        exponentials = shifted.exp_()
        exponentials.addcmul_(at_max, exponentials, value=-1.0)  # the maxima's terms out ...
        others = exponentials.sum(dim=1) + (at_max.sum(dim=1) - 1.0)
        row_sum = others + 1.0
        exponentials.add_(at_max)  # ... and back in, for the softmax
        # The clamp only undoes a rounding of the mean positive above the maximum.
        rows = (row_max - positive).clamp_(min=0.0) + others.log1p()
    if grads is None:
        return rows
    block_weights = torch.ones_like(rows) if weights is None else weights
    softmax_weight = block_weights / row_sum
    logit_grad = exponentials.mul_(softmax_weight[:, None])
    if columns is not None:
        # w·(p_pos − 1) = −w·S / Σ: no cancellation, whatever the positive's rank.
        logit_grad.scatter_(1, columns, (-others * softmax_weight)[:, None])
    else:
        logit_grad.addcmul_(positive_mask, (block_weights / positive_count)[:, None], value=-1.0)
    _accumulate(logit_grad, block, keys, scale, start, stop, grads)
    return rows


def _positive_mask(targets: Targets, start: int, stop: int, *, out: Tensor) -> Tensor:
    """``(stop − start, N)`` into ``out``: 1 where a column shares the row's label, else 0.

    The row's excluded column is 0 too. Labels come as floats (class indices): comparing floats into
    a float output is several times faster than comparing integers into a bool mask on CPU.
    """
    if targets.query_labels is None or targets.key_labels is None:
        raise ValueError("Targets needs columns, or query_labels with key_labels")
    mask = torch.eq(targets.query_labels[start:stop, None], targets.key_labels[None, :], out=out)
    if targets.excluded is not None:
        mask.scatter_(1, targets.excluded[start:stop, None], 0.0)
    return mask


def _accumulate(
    logit_grad: Tensor, block: Tensor, keys: Tensor, scale: Tensor, start: int, stop: int, grads: Grads
) -> None:
    """From ``G = ∂(Σ w ℓ)/∂logits``: queries ``s·G K``, keys ``s·Gᵀ Q``, scale ``Σ q⊙(G K)``."""
    if grads.key is not None:
        grads.key.addmm_(logit_grad.T, block * scale)
    if grads.query is None and grads.scale is None:
        return
    weighted_keys = logit_grad @ keys
    if grads.query is not None:
        grads.query[start:stop] = weighted_keys * scale
    if grads.scale is not None:
        grads.scale += (block * weighted_keys).sum()
