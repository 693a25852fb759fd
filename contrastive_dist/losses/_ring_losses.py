"""The four losses in ring mode (``communication="ring"``): per-row losses first, the reduction last.

Gather mode holds the whole global batch on every rank (``N·D`` features, ``N·D`` gradients).
Ring mode keeps only this rank's rows and passes key blocks round the ring (:mod:`._ring`), so
per-rank memory is ``O(n_r·D + chunk_size·max_r n_r)`` whatever the number of ranks. Sizes are
exchanged once up front (given ``sizes=`` are checked against them) so every rank knows every
block's size, and an invalid input on one rank raises the same error on every rank.

Each body ends holding ``ℓ_i``, the loss of each of this rank's rows, defined as in gather mode
(a CLIP pair: the mean of its two directions; an NT-Xent sample: the mean of its two anchors; a
SigLIP image row: its sum over every text; a SupCon anchor: 0 without positives), computed as
``logsumexp − positive`` row by row. ``reduction="none"`` returns them; ``"mean"`` reduces them
last to this rank's share ``W · Σ_i w_i ℓ_i / Σ_global w_i`` (:func:`._ring_extras.ring_mean`;
``w = 1`` without weights), the gradient contract of DESIGN.md: the mean over ranks is the
single-process loss, for any per-rank sizes, 0 included. InfoNCE's extra negatives are in
:mod:`._ring_extras` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_rank, get_world_size
from contrastive_dist.engine._agreement import Problem, agree_on_sizes
from contrastive_dist.engine._ring import Ring
from contrastive_dist.losses._chunked import full_precision, upcast
from contrastive_dist.losses._negatives import SharedNegatives, negatives_marker
from contrastive_dist.losses._reduction import Reduction
from contrastive_dist.losses._ring_extras import ring_mean, shared_logsumexp, with_negatives
from contrastive_dist.losses._ring_sigmoid import ring_sigmoid_rows
from contrastive_dist.losses._ring_softmax import ring_logsumexp

__all__ = [
    "Communication",
    "check_communication",
    "open_ring",
    "ring_checks",
    "ring_info_nce",
    "ring_nt_xent",
    "ring_siglip",
    "ring_supcon",
]

Communication = Literal["gather", "ring"]


def check_communication(communication: object) -> Communication:
    """Check ``communication`` is one of the allowed modes."""
    allowed = get_args(Communication)
    if communication not in allowed:
        raise ValueError(f"communication must be one of {allowed}, got {communication!r}")
    return communication  # type: ignore[return-value]


def ring_checks(communication: object, sizes: Sequence[int] | None) -> Sequence[int] | None:
    """The ``sizes`` a loss's input checks should assume: ``None`` in ring mode, which always exchanges.

    Ring mode runs the size exchange even when ``sizes`` is given, so that an invalid input or a
    wrong ``sizes`` found on one rank raises on every rank (a rank that stopped would leave its
    ring neighbours waiting for a block). One three-integer all-gather per call.
    """
    return None if communication == "ring" else sizes


def open_ring(tensors: Sequence[Tensor], group: ProcessGroup | None, sizes: Sequence[int] | None) -> Ring:
    """Return this rank's place in the ring, with every rank's row count, exchanged once.

    The exchange is the gather's agreement: dtype, trailing shape and gradient tracking must
    match on every rank, or every rank raises the same ``ValueError``. Given ``sizes`` are
    checked against the exchanged counts (on every rank, when all ranks were given the same).
    """
    world_size, rank = get_world_size(group), get_rank(group)
    problem: Problem | None = None
    if sizes is not None and (
        isinstance(sizes, Tensor) or not all(isinstance(size, int) and size >= 0 for size in sizes)
    ):
        problem = TypeError, f"sizes must be a sequence of non-negative Python ints, got {sizes!r}"
    elif sizes is not None and len(sizes) != world_size:
        problem = ValueError, f"sizes must have one entry per rank ({world_size}), got {len(sizes)}: {tuple(sizes)}"
    if world_size == 1:
        if problem is not None:
            raise problem[0](problem[1])
        known: tuple[int, ...] = (tensors[0].shape[0],)
    else:
        known = agree_on_sizes(tensors, 0, problem, group, world_size)
    if sizes is not None and tuple(sizes) != known:
        raise ValueError(f"sizes={tuple(sizes)} was given, but the ranks hold {known} rows (raised on every rank)")
    return Ring(rank, world_size, known, group)


def _given(weights: Tensor | None) -> tuple[Tensor, ...]:
    """The weights among the agreed tensors: their presence, dtype and length are checked on every rank."""
    return () if weights is None else (weights,)


def ring_info_nce(
    images: Tensor,
    texts: Tensor,
    scale: Tensor,
    *,
    symmetric: bool,
    chunk_size: int | None,
    group: ProcessGroup | None,
    sizes: Sequence[int] | None,
    negatives: Tensor | SharedNegatives | None = None,
    weights: Tensor | None = None,
    reduction: Reduction = "mean",
) -> Tensor:
    """:func:`~contrastive_dist.info_nce` in ring mode: images stay, text blocks (and own negatives) travel."""
    ring = open_ring((images, texts, *_given(weights), *negatives_marker(negatives, texts)), group, sizes)
    with full_precision(images.device):
        queries, keys = upcast(images), upcast(texts)
        scale = scale.to(queries.dtype)
        key_ring, travelling = ring, keys
        if isinstance(negatives, Tensor):
            key_ring, travelling = with_negatives(ring, keys, upcast(negatives))
        # Columns (text→image) are the texts only: the negatives after them are image→text only.
        row_lse, col_lse, _, _ = ring_logsumexp(
            queries, travelling, scale, key_ring, columns=symmetric, column_sizes=ring.sizes, chunk_size=chunk_size
        )
        if isinstance(negatives, SharedNegatives):
            row_lse = torch.logaddexp(row_lse, shared_logsumexp(queries, negatives.keys, scale, chunk_size))
        positives = (queries * keys).sum(dim=1) * scale
        rows = row_lse - positives
        if symmetric:
            rows = 0.5 * (rows + (col_lse - positives))
        return rows if reduction == "none" else ring_mean(rows, ring, weights)


def ring_nt_xent(
    z1: Tensor,
    z2: Tensor,
    scale: Tensor,
    *,
    chunk_size: int | None,
    group: ProcessGroup | None,
    sizes: Sequence[int] | None,
    weights: Tensor | None = None,
    reduction: Reduction = "mean",
) -> Tensor:
    """:func:`~contrastive_dist.nt_xent` in ring mode: both views of a block travel together."""
    ring = open_ring((z1, z2, *_given(weights)), group, sizes)
    with full_precision(z1.device):
        u1, u2 = F.normalize(upcast(z1), dim=-1), F.normalize(upcast(z2), dim=-1)
        scale = scale.to(u1.dtype)
        anchors = torch.cat((u1, u2))  # local rows: first views, then second views
        row_lse, _, _, _ = ring_logsumexp(
            anchors, anchors, scale, ring, rows_per_sample=2, exclude_self=True, chunk_size=chunk_size
        )
        positives = (u1 * u2).sum(dim=1) * scale
        # A sample's loss: the mean of its two anchors'.
        rows = (row_lse - torch.cat((positives, positives))).view(2, z1.shape[0]).mean(dim=0)
        return rows if reduction == "none" else ring_mean(rows, ring, weights)


def ring_siglip(
    images: Tensor,
    texts: Tensor,
    scale: Tensor,
    bias: Tensor,
    *,
    chunk_size: int | None,
    group: ProcessGroup | None,
    sizes: Sequence[int] | None,
    weights: Tensor | None = None,
    reduction: Reduction = "mean",
) -> Tensor:
    """:func:`~contrastive_dist.siglip` in ring mode: images stay, text blocks travel."""
    ring = open_ring((images, texts, *_given(weights)), group, sizes)
    with full_precision(images.device):
        queries, keys = upcast(images), upcast(texts)
        rows = ring_sigmoid_rows(
            queries, keys, scale.to(queries.dtype), bias.to(queries.dtype), ring, chunk_size=chunk_size
        )
        return rows if reduction == "none" else ring_mean(rows, ring, weights)


def ring_supcon(
    features: Tensor,
    labels: Tensor,
    scale: Tensor,
    *,
    chunk_size: int | None,
    group: ProcessGroup | None,
    sizes: Sequence[int] | None,
    weights: Tensor | None = None,
    reduction: Reduction = "mean",
) -> Tensor:
    """:func:`~contrastive_dist.supcon` in ring mode: embeddings travel with their labels.

    The positives of an anchor are found in every block by label; the mean's denominator (the
    anchors with positives over the global batch, weighted by their sample's weight) takes one
    scalar all-reduce.
    """
    ring = open_ring((features, labels, *_given(weights)), group, sizes)
    views = 1 if features.ndim == 2 else features.shape[1]
    with full_precision(features.device):
        embeddings = upcast(features.reshape(-1, features.shape[-1]))  # sample-major: (sample s, view v) is s·V + v
        scale = scale.to(embeddings.dtype)
        row_lse, _, positive_sum, positive_count = ring_logsumexp(
            embeddings,
            embeddings,
            scale,
            ring,
            rows_per_sample=views,
            labels=labels.repeat_interleave(views),
            exclude_self=True,
            chunk_size=chunk_size,
        )
        has_positives = positive_count > 0
        # ℓ_a = logsumexp − mean positive logit; anchors without positives contribute nothing.
        rows = torch.where(has_positives, row_lse - positive_sum / positive_count.clamp(min=1), 0.0)
        anchor_weights = None if weights is None else weights.repeat_interleave(views)
        # The denominator's all-reduce runs with reduction="none" too: a rank asking for "none"
        # beside ranks asking for the mean then leaves none of them waiting.
        mean = ring_mean(rows, ring, anchor_weights, counted=has_positives)
        return rows.view(features.shape[:-1]) if reduction == "none" else mean
