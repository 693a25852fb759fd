"""The decoupled softmax family (DCL): a row's loss is the log-sum-exp over its negatives alone.

The state, its merge and the numerators are the softmax family's (:mod:`._softmax`), for rows that
meet only negatives: their positives are left out of every block by key, so ``rest + exact`` is the
sum over the negatives and the row's term is ``m + log(rest + exact)``, its logit gradient
``w · exp(l − m) / (rest + exact)``. A row with no negative has no term. The positive's own term of a
decoupled loss is not a sum over columns: the loss forms it outside the blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._targets import Targets

_MAX, _REST, _EXACT = 0, 1, 2


def _total(state: Tensor) -> Tensor:
    return state[:, _REST] + state[:, _EXACT]


def has_positive(state: Tensor) -> Tensor:
    """``(c,)`` whether each row met a negative (its term is defined); the family's name for it."""
    return _total(state) > 0


def finish(state: Tensor) -> Tensor:
    """Each row's ``logsumexp`` over its negatives, ``m + log(rest + exact)``; 0 for a row without one."""
    total = _total(state)
    present = total > 0
    return torch.where(present, state[:, _MAX] + torch.log(torch.where(present, total, 1.0)), 0.0)


def gradient_(
    numerators: Tensor, state: Tensor, targets: Targets, positive_mask: SameKey | None, weights: Tensor | float
) -> Tensor:
    """``∂(Σ_i w_i ℓ_i) / ∂logits`` of one block, in place on its numerators: the softmax over the negatives."""
    total = _total(state)
    live = has_positive(state).to(state.dtype) * weights
    return numerators.mul_((live / total.clamp(min=torch.finfo(total.dtype).tiny))[:, None])

