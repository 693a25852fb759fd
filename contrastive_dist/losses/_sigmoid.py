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

import math

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
    """Each row's ``Σ_j softplus(m_ij)``; on the CPU one ``exp`` per entry and (float32) one ``log`` per 64.

    ``softplus(m) = max(m, 0) + log(1 + e)`` with ``e = exp(−|m|)``, so a row's sum of the second
    terms is ``log Π_j (1 + e_j)``. The product is formed in pairs in the form ``1 + x``: two
    factors ``1 + a`` and ``1 + b`` make ``1 + (a + b + a·b)``. Every term is positive (no
    cancellation: a few ulps at most), a tiny ``e`` keeps its digits where ``1 + e`` would round
    them away, and each halving of a row needs two passes over half of it. A row is halved while
    its width is even, at most :func:`_halvings` times (after ``k`` halvings ``x < 2^(2^k)``, which
    the dtype must hold); what is left of it takes :func:`_log1p`.

    Why not ``F.softplus`` there: torch's CPU ``log1p`` ran 6× slower than its ``log``, and ``exp``
    plus ``log`` per entry were half of SigLIP's CPU epilogue (AVX-512, torch 2.14). Elsewhere (a
    GPU's eager chain: float16) ``F.softplus`` is one kernel, and these passes would more than double
    the chain's memory traffic (``tests/test_traffic.py``'s counter, float16).

    Shape:
        margins: ``(c, m)``; output: ``(c, 1)``.

    Example:
        >>> import math, torch
        >>> sums = softplus_sums(torch.tensor([[0.0] * 64, [-30.0, 30.0] * 32]))[:, 0].tolist()
        >>> [round(value, 4) for value in sums], round(64 * math.log(2.0), 4)
        ([44.3614, 960.0], 44.3614)
    """
    if margins.device.type != "cpu":
        return F.softplus(margins).sum(dim=1, keepdim=True)
    # One buffer serves both passes: a second block-sized temporary made glibc hand the pair back to
    # the system after each chunk, to fault its pages in again at the next (5.6 against 1.6 ms a
    # chunk of 256 × 4096 in a loop of calls).
    buffer = torch.clamp_min(margins, 0.0)
    positive_parts = buffer.sum(dim=1, keepdim=True)
    products = torch.abs(margins, out=buffer).neg_().exp_()  # the x of each factor 1 + x: e
    width = products.shape[1]
    for _ in range(_halvings(margins.dtype)):
        if width % 2:
            break
        width //= 2
        first, second = products[:, :width], products[:, width : 2 * width]
        second.addcmul_(first, second)  # b + a·b
        first += second
        products = first
    return _log1p(products).sum(dim=1, keepdim=True) + positive_parts


def _halvings(dtype: torch.dtype) -> int:
    """How often a row's factors, each at most 2, may be paired before their product could overflow.

    Example:
        >>> [_halvings(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]
        [3, 6, 6, 9]
    """
    largest_power = math.frexp(torch.finfo(dtype).max)[1] - 1  # 2^that is finite
    return math.floor(math.log2(largest_power))


def _log1p(x: Tensor) -> Tensor:
    """``log(1 + x)`` for ``x ≥ 0`` from ``log``: ``u = 1 + x`` rounded, corrected by its rounding error over ``u``.

    The error of the sum is exact (TwoSum), so the result is within an ulp or two of ``log1p``;
    for ``x`` below half an ulp of 1 (``u = 1``) it is ``x`` itself.
    """
    total = x + 1.0
    from_x = total - 1.0
    error = (x - from_x).add_(1.0 - (total - from_x)).div_(total)
    return total.log_().add_(error)


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
