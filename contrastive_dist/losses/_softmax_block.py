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
            the row's label (SupCon; the target is their mean), or None.
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
) -> Tensor:
    """``ℓ_i`` of rows ``start:stop``; adds ``w_i · ∂ℓ_i`` into ``grads`` when given (``w = 1`` if None).

    Shape:
        queries: ``(n, D)``; keys: ``(N, D)``; weights: ``(stop − start,)``; output: ``(stop − start,)``.
    """
    block = queries[start:stop]
    logits = (block * scale) @ keys.T
    positive_mask = _positive_mask(targets, start, stop)
    if positive_mask is None:
        columns = targets.columns[start:stop, None]  # type: ignore[index]
        positive = logits.gather(1, columns).squeeze(1)
    else:
        # The mean positive logit from the logits themselves: no class sum minus the anchor,
        # which cancels for large features.
        positive_count = positive_mask.sum(dim=1).to(logits.dtype)
        positive = torch.where(positive_mask, logits, 0.0).sum(dim=1) / positive_count
    if targets.excluded is not None:
        logits.scatter_(1, targets.excluded[start:stop, None], float("-inf"))
    row_max, argmax = logits.max(dim=1)
    # One exp pass serves the loss and the softmax, in place in the logits' memory. The maximum's
    # own term (exactly 1) stays out of the sum, so that log1p keeps a small sum's precision.
    exponentials = logits.sub_(row_max[:, None]).exp_().scatter_(1, argmax[:, None], 0.0)
    others = exponentials.sum(dim=1)
    # Each part is >= 0; the clamp only undoes a rounding of the mean positive above the maximum.
    rows = (row_max - positive).clamp_(min=0.0) + others.log1p()
    if grads is None:
        return rows
    ones = torch.ones_like(others)
    block_weights = ones if weights is None else weights
    softmax_weight = block_weights / (1.0 + others)
    logit_grad = exponentials.scatter_(1, argmax[:, None], ones[:, None]).mul_(softmax_weight[:, None])
    if positive_mask is None:
        columns = targets.columns[start:stop, None]  # type: ignore[index]
        # w·(p − 1) at the positive; when it is the row maximum, p − 1 = −S/(1+S) without cancellation.
        at_max = columns.squeeze(1) == argmax
        positive_grad = torch.where(
            at_max, -others * softmax_weight, logit_grad.gather(1, columns).squeeze(1) - block_weights
        )
        logit_grad.scatter_(1, columns, positive_grad[:, None])
    else:
        logit_grad.sub_(positive_mask * (block_weights / positive_count)[:, None])
    _accumulate(logit_grad, block, keys, scale, start, stop, grads)
    return rows


def _positive_mask(targets: Targets, start: int, stop: int) -> Tensor | None:
    """``(stop − start, N)``: True where a column shares the row's label (its excluded column left out)."""
    if targets.query_labels is None or targets.key_labels is None:
        return None
    mask = targets.query_labels[start:stop, None] == targets.key_labels[None, :]
    if targets.excluded is not None:
        mask.scatter_(1, targets.excluded[start:stop, None], False)
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
