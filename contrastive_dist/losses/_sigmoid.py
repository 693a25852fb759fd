"""The sigmoid-pair family (SigLIP): every image–text pair is one independent binary term.

A row's loss is a plain sum over its pairs, so its state across column blocks is one number::

    ℓ_i = Σ_j softplus(−z_ij · l_ij),   l_ij = s · x_i·y_j + b,   z_ij = +1 for a positive pair, −1 otherwise

Positive pairs are the row's own text (the diagonal of its own block) or, with keys and the
``"positive"`` rule, every pair that shares a key; with the ``"mask"`` rule a pair that shares a
key, other than the row's own, is no term at all. The gradient of ``Σ_i w_i ℓ_i`` with respect to
the logits is ``−z_ij · σ(−z_ij · l_ij) · w_i``. Functions mirror :mod:`._softmax`, so that one
driver runs both families over both transports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._targets import Targets

WIDTH = 1
"""One number of state per row: its sum of pair terms so far."""


def empty_state(rows: int, like: Tensor) -> Tensor:
    """Rows that have met no pair yet: an empty sum. Shape: ``(rows, 1)``."""
    return like.new_zeros((rows, WIDTH))


def _flip_positives_(values: Tensor, targets: Targets, positive_mask: SameKey | None) -> Tensor:
    """Negate the positive pairs' entries, in place (``−z`` is −1 there, +1 elsewhere)."""
    if positive_mask is not None:
        return positive_mask.flip_(values)
    if targets.positive is not None:
        targets.positive.write_(values, -targets.positive.read(values))
    return values


def numerators_(logits: Tensor, state: Tensor | None, targets: Targets, positive_mask: SameKey | None) -> Tensor:
    """The margins ``−z · l``, in place; pairs the ``"mask"`` rule removes get ``-inf`` (no term, no gradient)."""
    margins = _flip_positives_(logits, targets, positive_mask)
    targets.exclude_(margins)
    return margins


def block_state_(logits: Tensor, targets: Targets, positive_mask: SameKey | None) -> Tensor:
    """The rows' sums over this block; ``logits`` become the margins (see :func:`numerators_`).

    Shape:
        logits: ``(c, m)``; output: ``(c, 1)``.
    """
    return softplus_sums(numerators_(logits, None, targets, positive_mask))


def softplus_sums(margins: Tensor) -> Tensor:
    """Each row's ``Σ_j softplus(m_ij)``; on the CPU from one ``exp`` and one ``log`` per entry.

    ``softplus(m) = max(m, 0) + log1p(e)`` with ``e = exp(−|m|)``; ``log1p(e)`` is ``log(u)`` of
    ``u = 1 + e`` corrected by the rounding of that sum, ``δ = e − (u − 1)`` (exact), as
    ``log(u) + δ / u``: within an ulp or two of ``log1p``, and for ``e`` below half an ulp of 1
    (``u = 1``) exactly ``e``. Why not ``F.softplus`` there: torch's CPU ``log1p`` ran 6× slower than
    its ``log`` on the development machine (AVX-512, torch 2.14), half of SigLIP's CPU epilogue.
    Elsewhere (a GPU's eager chain: float16) ``F.softplus`` is one kernel, and these passes would
    more than double the chain's memory traffic (``tests/test_traffic.py``'s counter, float16).

    Shape:
        margins: ``(c, m)``; output: ``(c, 1)``.
    """
    if margins.device.type != "cpu":
        return F.softplus(margins).sum(dim=1, keepdim=True)
    small = margins.abs().neg_().exp_()  # e
    total = small.add(1.0).sub_(1.0)  # u − 1 of u = 1 + e rounded: exact, as is every step to the log
    small.sub_(total)  # δ
    total += 1.0  # u
    small /= total  # δ / u
    total.log_().add_(small)
    total += torch.clamp_min(margins, 0.0, out=small)
    return total.sum(dim=1, keepdim=True)


def merged(states: Tensor) -> Tensor:
    """The sum over every part. Shape: ``(k, c, 1)`` → ``(c, 1)``."""
    return states.sum(dim=0)


def merge_(state: Tensor, other: Tensor) -> None:
    """``state`` ← the sum over both blocks."""
    state += other


def finish(state: Tensor) -> Tensor:
    """Each row's loss: its sum. Shape: ``(c, 1)`` → ``(c,)``."""
    return state[:, 0]


def has_positive(state: Tensor) -> Tensor:
    """Every row has a loss (its negatives' terms), with or without a positive pair."""
    return torch.ones(state.shape[0], dtype=torch.bool, device=state.device)


def rebase_(margins: Tensor, partial: Tensor, final: Tensor) -> Tensor:
    """The margins do not depend on the rows' state: unchanged."""
    return margins


def gradient_(
    margins: Tensor, state: Tensor, targets: Targets, positive_mask: SameKey | None, weights: Tensor | float
) -> Tensor:
    """``∂(Σ_i w_i ℓ_i) / ∂logits`` of one block, in place on its margins: ``−z · σ(−z · l) · w``.

    Shape:
        margins: ``(c, m)``; weights: ``(c,)`` (or a number, the same for every row); output: ``(c, m)``.
    """
    # d softplus(m)/dl = σ(m) · dm/dl with m = −z·l: the positives' sign flips back.
    gradient = _flip_positives_(margins.sigmoid_(), targets, positive_mask)
    if isinstance(weights, Tensor):
        return gradient.mul_(weights[:, None])
    return gradient if weights == 1.0 else gradient.mul_(weights)
