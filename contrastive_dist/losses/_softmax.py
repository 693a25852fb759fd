"""The softmax-row family (InfoNCE, NT-Xent, SupCon): each row's running state across column blocks.

A row ``i`` meets its columns one block at a time (all of them at once in gather mode, one rank's
block per hop in ring mode). Its loss is ``ℓ_i = logsumexp_j l_ij − mean_{p ∈ P_i} l_ip`` over its
candidate columns ``j`` (every column but the excluded ones) with positives ``P_i``. Per row the
state keeps five numbers, merged exactly from block to block::

    m       the running maximum of the candidates' logits
    rest    Σ exp(l_j − m) over the candidates *not* counted in ``exact``
    exact   the part of the sum known without rounding: the term of the row's own pair
            ``exp(l_p − m)`` (exactly 1 when it is the maximum), or, for rows without one (SupCon's
            anchors), the number of candidates equal to the maximum (each term exactly 1)
    pos_sum, pos_count   Σ l_ip over the positives seen so far, and their number

so that ``ℓ_i = (m − pos_sum / pos_count) + log1p(rest + (exact − 1))``: both parts are ≥ 0, a row
whose positive is its only candidate gives exactly 0, and a small loss keeps its relative
precision (``log1p`` of a small sum, never ``logsumexp − positive``, the difference of two large,
separately rounded numbers). Merging two states moves the terms of the one with the smaller
maximum into ``rest``; equal maxima add both parts. A row without positives (SupCon: a label
seen once) has no loss: ``ℓ = 0`` and no gradient.

The gradient of ``Σ_i w_i ℓ_i`` with respect to the logits is ``w_i (p_ij − t_ij)``, with the
softmax ``p_ij = exp(l_ij − m_i) / (rest_i + exact_i)`` and the target ``t_i`` (one-hot, or
uniform over ``P_i``). The single positive's entry, ``w (p − 1) = −w (rest + exact − e_p) / Σ``, is
formed without cancellation: ``exact − e_p`` is exactly 0 when the positive holds the maximum.

Every function works on one block of ``c`` rows against ``m`` columns, in place on the
``(c, m)`` logits where it can, since a block's logits are the largest tensors of the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._targets import MASKED, Located, Targets

__all__ = [
    "WIDTH",
    "block_state_",
    "empty_state",
    "finish",
    "gradient_",
    "has_positive",
    "merge_",
    "merged",
    "numerators_",
    "rebase_",
]

WIDTH = 5
"""Numbers of state per row: ``m``, ``rest``, ``exact``, ``pos_sum``, ``pos_count``."""
_MAX, _REST, _EXACT, _POSITIVE_SUM, _POSITIVE_COUNT = range(WIDTH)


def empty_state(rows: int, like: Tensor) -> Tensor:
    """The state of rows that have met no column yet: ``m = −inf``, empty sums.

    Shape:
        output: ``(rows, WIDTH)``, in ``like``'s dtype.
    """
    state = like.new_zeros((rows, WIDTH))
    state[:, _MAX] = float("-inf")
    return state


def _finite(row_max: Tensor) -> Tensor:
    """The maximum to shift by: 0 for a row without candidates in this block (all its exponentials are 0)."""
    return torch.where(torch.isinf(row_max), 0.0, row_max)


def block_state_(logits: Tensor, targets: Targets, positive_mask: SameKey | None) -> Tensor:
    """The state of one block's rows; turns ``logits`` into the numerators ``exp(l − m_block)``, in place.

    Args:
        logits: ``(c, m)`` logits of this block, overwritten (excluded columns become 0).
        targets: where the rows' positives and excluded columns are in this block.
        positive_mask: the entries that are positives (positives given by equal keys), from
            :meth:`Targets.positive_mask`; ``None`` for a single positive column per row.

    Returns:
        ``(c, WIDTH)`` state of the rows over this block alone.
    """
    state = logits.new_zeros((logits.shape[0], WIDTH))
    positive = targets.positive
    if positive_mask is not None:
        # The positives' logits before the shift; excluded columns are not positives (the mask says so).
        state[:, _POSITIVE_SUM] = positive_mask.row_sums(logits)
        state[:, _POSITIVE_COUNT] = positive_mask.counts(logits)
    elif positive is not None:
        state[:, _POSITIVE_SUM] = positive.read(logits)
        state[:, _POSITIVE_COUNT] = positive.presence(logits)
    targets.exclude_(logits)
    # Rows without a single positive (SupCon's anchors) keep the maximum's own term exact instead: it
    # is 1 after the shift. Along contiguous rows max(dim) finds it with the maximum; elsewhere (a
    # block seen transposed) that is slow, and every term equal to the maximum is counted instead.
    by_key = positive is None and positive_mask is not None
    if by_key and logits.stride(-1) == 1:
        row_max, top = logits.max(dim=1, keepdim=True)
        positive, by_key = Located(top), False
    else:
        # amax, not max(dim) with indices: the latter costs as much as the exp pass on CPU.
        row_max = logits.amax(dim=1)
    row_max = row_max.view(-1)
    row_max = torch.where(row_max < -0.5 * MASKED, float("-inf"), row_max)  # no candidate in this block
    state[:, _MAX] = row_max
    shifted = logits.sub_(_finite(row_max)[:, None])
    if by_key:
        # (Comparisons written into a float tensor: several times faster than bool masks on CPU. torch.compile
        # refuses an out= of a transposed block's strides, and fuses the cast itself.)
        at_max = (shifted.eq(0.0).to(shifted.dtype) if torch.compiler.is_compiling()
                  else torch.eq(shifted, 0.0, out=torch.empty_like(shifted)))
        numerators = shifted.exp_()
        numerators.addcmul_(at_max, numerators, value=-1.0)  # the maxima's terms out ...
        state[:, _REST] = numerators.sum(dim=1)
        state[:, _EXACT] = at_max.sum(dim=1)
        numerators.add_(at_max)  # ... and back in, for the softmax
        return state
    if positive is None:
        state[:, _REST] = shifted.exp_().sum(dim=1)
        return state
    # The row's own pair's term (exactly 1 when it is the maximum) stays out of the sum, counted
    # exactly; with positives by key it is one of them (or the maximum's), and any other makes the
    # loss ≥ log 2: ties with it are summed with the rest, where their rounding does not matter.
    numerators = shifted.exp_()
    own = positive.read(numerators)
    positive.write_(numerators, 0.0)
    state[:, _REST] = numerators.sum(dim=1)
    state[:, _EXACT] = own
    positive.write_(numerators, own)
    return state


def merged(states: Tensor) -> Tensor:
    """The state of every part's columns together: exact, whatever order the parts come in.

    The parts whose maximum is the largest keep their exact parts exact (equal maxima add them); the
    others' terms move into ``rest``, scaled to the common maximum.

    Shape:
        states: ``(k, c, WIDTH)``; output: ``(c, WIDTH)``.
    """
    maxima = states[..., _MAX]
    top = maxima.amax(dim=0)
    leads = maxima == top  # this part holds the maximum: its exact part stays exact
    factor = torch.where(leads, 1.0, (maxima - _finite(top)).exp())
    rest = (states[..., _REST] * factor + torch.where(leads, 0.0, states[..., _EXACT] * factor)).sum(dim=0)
    exact = torch.where(leads, states[..., _EXACT], 0.0).sum(dim=0)
    positives = states[..., _POSITIVE_SUM:].sum(dim=0)
    return torch.cat((top[:, None], rest[:, None], exact[:, None], positives), dim=1)


def merge_(state: Tensor, other: Tensor) -> None:
    """``state`` ← the state of both column sets (:func:`merged`).

    Shape:
        state, other: ``(c, WIDTH)``.
    """
    state.copy_(merged(torch.stack((state, other))))


def finish(state: Tensor) -> Tensor:
    """Each row's loss ``ℓ = (m − mean positive) + log1p(rest + exact − 1)``; 0 for a row without positives.

    Shape:
        state: ``(c, WIDTH)``; output: ``(c,)``.
    """
    count = state[:, _POSITIVE_COUNT]
    has_positive = count > 0
    mean_positive = state[:, _POSITIVE_SUM] / count.clamp(min=1.0)
    # The clamp only undoes a rounding of a mean positive above the maximum.
    gap = (state[:, _MAX] - mean_positive).clamp(min=0.0)
    rows = gap + torch.log1p(state[:, _REST] + (state[:, _EXACT] - 1.0))
    return torch.where(has_positive, rows, 0.0)


def has_positive(state: Tensor) -> Tensor:
    """``(c,)`` whether each row met at least one positive (its loss is defined)."""
    return state[:, _POSITIVE_COUNT] > 0


def numerators_(logits: Tensor, state: Tensor, targets: Targets, positive_mask: SameKey | None = None) -> Tensor:
    """``exp(l − m)`` against the rows' final maxima, in place (excluded columns 0): for a recomputed block.

    Shape:
        logits: ``(c, m)``; state: ``(c, WIDTH)``; output: ``logits``.
    """
    targets.exclude_(logits)
    return logits.sub_(_finite(state[:, _MAX])[:, None]).exp_()


def rebase_(numerators: Tensor, partial: Tensor, final: Tensor) -> Tensor:
    """``exp(l − m_partial)`` → ``exp(l − m_final)``, in place, for a block's numerators.

    They were formed against the rows' state over part of their columns and move onto the final
    maxima (a factor of exactly 1 where the part held the maximum). Rows without a candidate in the
    part have only zeros.

    Shape:
        numerators: ``(c, m)``; partial, final: ``(c, WIDTH)``; output: ``numerators``.
    """
    partial_max = partial[:, _MAX]
    factor = torch.where(torch.isinf(partial_max), 0.0, (partial_max - _finite(final[:, _MAX])).exp())
    return numerators.mul_(factor[:, None])


def gradient_(
    numerators: Tensor, state: Tensor, targets: Targets, positive_mask: SameKey | None, weights: Tensor | float
) -> Tensor:
    """``∂(Σ_i w_i ℓ_i) / ∂logits`` of one block, in place on its numerators; rows without positives get 0.

    Args:
        numerators: ``(c, m)`` ``exp(l − m_i)`` with the rows' final maxima (from :func:`block_state_`
            when the block held every column, else from :func:`numerators_`).
        state: ``(c, WIDTH)`` the rows' final state (every column met).
        targets: the block's targets, as for :func:`block_state_`.
        positive_mask: as for :func:`block_state_`.
        weights: ``(c,)`` ``w_i``, the upstream gradient of each row's loss (a number: the same for every row).
    """
    total = state[:, _REST] + state[:, _EXACT]
    if isinstance(weights, Tensor):
        live = torch.where(has_positive(state), weights, 0.0)
    else:  # not ``where`` of two numbers: that takes the default dtype (float64 under Lightning's "64-true")
        live = has_positive(state).to(state.dtype) * weights
    softmax_weight = live / total.clamp(min=torch.finfo(total.dtype).tiny)
    if positive_mask is None:
        positive = targets.positive
        if positive is None:
            return numerators.mul_(softmax_weight[:, None])
        own = positive.read(numerators)  # e_p: exactly the exact part when the positive leads
        entry = -live * (state[:, _REST] + (state[:, _EXACT] - own)) / total.clamp(min=torch.finfo(total.dtype).tiny)
        numerators.mul_(softmax_weight[:, None])
        positive.write_(numerators, entry)
        return numerators
    numerators.mul_(softmax_weight[:, None])
    count = state[:, _POSITIVE_COUNT].clamp(min=1.0)
    return positive_mask.add_(numerators, live / count, alpha=-1.0)
