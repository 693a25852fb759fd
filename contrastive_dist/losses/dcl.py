"""Decoupled contrastive learning, DCL and DCLW, over the global batch of every rank (Yeh et al., 2022)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_pair
from contrastive_dist.losses._families import DECOUPLED
from contrastive_dist.losses._frame import Call, Common, begin
from contrastive_dist.losses._module import HeldOptions
from contrastive_dist.losses._options import Communication, Reduction, compute_dtype, full_precision
from contrastive_dist.losses._targets import RowTargets
from contrastive_dist.losses._transports import Columns
from contrastive_dist.losses.ntxent import two_views

__all__ = ["DCLLoss", "dcl"]


def dcl(
    z1: Tensor, z2: Tensor, logit_scale: Tensor | float | None = None, *, temperature: float = 0.1,
    sigma: float | None = None, positive_weight: Tensor | None = None, chunk_size: int | None = None,
    group: GroupLike = None, sizes: Sequence[int] | None = None, weight: Tensor | None = None,
    reduction: Reduction = "mean", communication: Communication = "gather", ids: Tensor | None = None,
) -> Tensor:
    """DCL: NT-Xent's anchors, each one's positive out of its denominator; exact under data parallelism.

    ``ℓ_a = −v_a · l_{a,a'} + logsumexp_{j ∉ {a, a'}} l_aj`` over every embedding ``j`` of the global
    batch (``l = s · cos``; ``a'``: the other view of ``a``'s sample), averaged over the ``2N`` anchors.
    ``v = 1`` for DCL; DCLW (``sigma=σ``) weighs a sample's positive by the von Mises–Fisher weight
    ``v_i = 2 − N · softmax_i(cos(z1_i, z2_i) / σ)`` over the ``N`` samples of the global batch
    (detached). ``ids``: samples with equal ids are not each other's negatives. An anchor without
    any negative has no loss. Contract, options and returns as for :func:`nt_xent`.

    Args:
        z1: the first views' embeddings, row ``i`` from sample ``i`` (normalised here).
        z2: the second views', row ``i`` from sample ``i`` too.
        logit_scale: the similarity multiplier (default ``1 / temperature``).
        temperature: used when ``logit_scale`` is ``None``; > 0.
        sigma: DCLW's ``σ > 0``; ``None``: DCL.
        positive_weight: ``v`` given, per sample ``(n_r,)`` or per anchor ``(n_r, 2)`` (not with ``sigma``).
        chunk_size: anchors per logit block, or chosen from the shapes.
        group: a process group or a device mesh, default the world ([group][option-group]).
        sizes: every rank's sample count, when the caller knows it.
        weight: ``(n_r,)`` each sample's weight ≥ 0 (both of its anchors').
        reduction: ``"mean"``, or ``"none"``: each sample's loss (its two anchors' mean).
        communication: ``"gather"`` or ``"ring"`` (the anchors' blocks travel).
        ids: ``(n_r,)`` int64; equal ids: not each other's negatives.

    Example:
        >>> import torch
        >>> from contrastive_dist import dcl
        >>> z1, z2 = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8)
        >>> dcl(z1, z2, sigma=0.5).backward()
        >>> dcl(z1, z2, reduction="none").shape
        torch.Size([6])

    """

    def own() -> tuple[Tensor, Tensor, float | None, Tensor | None]:
        first, second = check_pair("z1", z1, "z2", z2)
        return first, second, check_sigma(sigma, positive_weight), check_positive_weight(positive_weight, first)

    call = begin(own, Common(operation="dcl", logit_scale=logit_scale, temperature=temperature, chunk_size=chunk_size,
                             group=group, sizes=sizes, weight=weight, reduction=reduction,
                             communication=communication, ids=ids),
                 inputs=(z1, z2, positive_weight),
                 options={"sigma": sigma, "positive_weight": positive_weight is not None})  # fmt: skip
    first, second, sigma_, given = call.own
    start, samples = call.layout.offset, first.shape[0]
    with full_precision(first.device):
        views, weights, columns, targets, tiles = decoupled_views(call, first, second)
        if call.per_row:
            value, _, has_negative = call.rows(DECOUPLED, views, columns, targets, tiles=tiles)
        else:
            value, has_negative = call.weighted_sum(DECOUPLED, views, columns, targets, weights=weights, tiles=tiles)
        cosine = (views[0::2] * views[1::2]).sum(dim=1)
        v = given if given is not None else torch.ones_like(cosine)
        if sigma_ is not None:
            every = call.gathered(cosine.detach() / sigma_)
            v = 2 - every.shape[0] * torch.softmax(every, dim=0)[start : start + samples]
        v = v if v.ndim == 2 else v[:, None]  # per sample, or per anchor (a column per view)
        positive = ((call.scale * cosine)[:, None] * v).expand(samples, 2).flatten() * has_negative
        if call.per_row:
            return (value - positive).view(-1, 2).mean(dim=1)
        value = value - (positive.sum() if weights is None else positive @ weights)
    return call.share(value * 0.5)


def decoupled_views(
    call: Call[Any], first: Tensor, second: Tensor
) -> tuple[Tensor, Tensor | None, Columns, RowTargets, RowTargets]:
    """NT-Xent's anchors as a decoupled loss meets them: unit views, their columns, every view's negatives only.

    Keys leave each anchor's own sample (and, with ids, its id's) out of its negatives: the sample's index,
    or its id.

    Returns:
        The views ``(2 n_r, D)`` and their weights (:func:`~contrastive_dist.losses.ntxent.two_views`), their
        columns, the rows' targets and every row's (a Gram loss's tiles).
    """
    start, samples = call.layout.offset, first.shape[0]
    index = call.ids if call.ids is not None else torch.arange(start, start + samples, device=first.device)
    keys = call.keys(index, small=call.ids is not None or sum(call.layout.sizes) <= 2**24)
    views, anchor_keys, weights = two_views(call, first, second, keys)
    columns = call.columns(views, keys=anchor_keys, per_sample=2)
    return views, weights, columns, RowTargets(keys=anchor_keys, key_rule="mask"), RowTargets(key_rule="mask")


def check_sigma(sigma: object, positive_weight: object = None) -> float | None:
    """DCLW's ``σ``: ``None`` or a number > 0, not together with a given ``positive_weight``."""
    if sigma is None:
        return None
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma must be a finite number > 0 or None, got {sigma!r}")
    if positive_weight is not None:
        raise ValueError("give sigma (DCLW's von Mises-Fisher weights) or positive_weight, not both")
    return float(sigma)


def check_positive_weight(positive_weight: object, like: Tensor) -> Tensor | None:
    """``None``, or a float tensor of ``(n,)`` (per sample) or ``(n, 2)`` (per anchor), moved to ``like``'s device."""
    if positive_weight is None:
        return None
    rows = like.shape[0]
    if not isinstance(positive_weight, Tensor) or not positive_weight.is_floating_point():
        raise TypeError(f"positive_weight must be a floating-point torch.Tensor, got {type(positive_weight).__name__}"
                        f"{'' if not isinstance(positive_weight, Tensor) else f' of {positive_weight.dtype}'}")
    if tuple(positive_weight.shape) not in ((rows,), (rows, 2)):
        shape = tuple(positive_weight.shape)
        raise ValueError(f"positive_weight must have shape ({rows},) or ({rows}, 2), got {shape}")
    weights = positive_weight.to(device=like.device, dtype=compute_dtype(like.dtype))
    return weights if weights.ndim == 2 else weights[:, None]


class DCLLoss(HeldOptions):
    """DCL (``sigma=None``) or DCLW over the global batch; holds the options of :func:`dcl`.

    Example:
        >>> import torch
        >>> from contrastive_dist import DCLLoss
        >>> z1, z2 = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        >>> DCLLoss(temperature=0.1, sigma=0.5)(z1, z2).backward()

    """

    def __init__(self, *, temperature: float = 0.1, sigma: float | None = None, chunk_size: int | None = None,
                 group: GroupLike = None, reduction: Reduction = "mean",
                 communication: Communication = "gather") -> None:
        super().__init__(temperature=temperature, sigma=check_sigma(sigma), chunk_size=chunk_size, group=group,
                         reduction=reduction, communication=communication)

    def forward(self, z1: Tensor, z2: Tensor, logit_scale: Tensor | float | None = None, *,
                sizes: Sequence[int] | None = None, weight: Tensor | None = None, ids: Tensor | None = None,
                positive_weight: Tensor | None = None) -> Tensor:
        """Return the global loss, its gradient this rank's share (or the per-sample losses); see :func:`dcl`."""
        return dcl(z1, z2, logit_scale, sizes=sizes, weight=weight, ids=ids, positive_weight=positive_weight,
                   **self.options())
