"""SigLIP's pairwise sigmoid loss over the global batch of every rank (Zhai et al., 2023)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from contrastive_dist._validation import check_pair, collect
from contrastive_dist.engine._agreement import agree
from contrastive_dist.losses._columns import meet
from contrastive_dist.losses._kernel import SIGMOID, Pairs
from contrastive_dist.losses._options import (
    Communication,
    Reduction,
    SameId,
    agreed_options,
    check_chunk_size,
    check_communication,
    check_ids,
    check_reduction,
    check_same_id,
    check_weight,
    positive_scalar,
    scalar_tensor,
)
from contrastive_dist.losses._precision import compute_dtype, full_precision, operands
from contrastive_dist.losses._reduction import Direction, mean_over_directions, mean_share, weight_total
from contrastive_dist.losses._targets import SMALL_KEYS, comparable_keys, pair_targets, small_keys_flag

__all__ = ["SigLIPLoss", "siglip"]


class _Arguments(NamedTuple):
    images: Tensor
    texts: Tensor
    scale: Tensor
    bias: Tensor
    chunk_size: int | None
    weights: Tensor | None
    ids: Tensor | None


def siglip(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    weight: Tensor | None = None,
    reduction: Reduction = "mean",
    communication: Communication = "gather",
    ids: Tensor | None = None,
    same_id: SameId = "mask",
) -> Tensor:
    """Sigmoid loss of this rank's images against every rank's texts; exact under data parallelism.

    The global loss is ``−(1/N) Σ_{i,j} log σ(z_ij · (logit_scale · x_i·y_j + logit_bias))``
    over all ``N × N`` image–text pairs of the global batch, with ``z_ij = +1`` for matching
    pairs (``i = j``) and ``−1`` otherwise. Every pair is one independent binary term, so only
    the texts are gathered: each rank sums its local image rows against all ``N`` texts and
    returns ``(W / N) ·`` that sum. The mean over ranks is the single-process loss; DDP's
    gradient averaging gives its gradient, for any per-rank batch sizes (including 0): the
    [gradient contract][gradient-contract].

    Features are used as given (normalise them in the model). With ``chunk_size``, rows are
    processed ``chunk_size`` at a time against all texts and their gradients formed on the
    spot, so at most ``chunk_size × N`` logits exist at once, at no extra matrix product.

    **Sample ids** ([ids][option-ids]). With ``same_id="mask"`` a pair ``(i, j)``, ``j ≠ i``, whose
    ids are equal is no term at all (neither a positive nor a negative); with ``same_id="positive"``
    every pair with equal ids is a positive: ``z_ij = +1``.

    **A row** of ``weight`` and ``reduction="none"`` ([weight][option-weight],
    [reduction][option-reduction]) is an image row: its loss is ``ℓ_i = Σ_j softplus(−z_ij ·
    logit_ij)``, its pairs with all ``N`` texts, so the loss above is the mean of the ``ℓ_i``; a
    weight applies to all of its pairs. ``reduction="none"`` recomputes each block in backward (one
    more product per block).

    Args:
        image_features: this rank's image embeddings.
        text_features: this rank's text embeddings, row ``i`` paired with image row ``i``.
        logit_scale: similarity multiplier, already exponentiated (learnable, like SigLIP's
            ``t``); > 0 when given as a number.
        logit_bias: added to every logit (learnable ``b``; SigLIP initialises it at −10).
        chunk_size: image rows per block; same result ([chunk_size][option-chunk-size]).
        group: the process group, default the world ([group][option-group]).
        sizes: every rank's batch size, if known ([sizes][option-sizes]).
        weight: one weight ≥ 0 per local image row ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, per-row losses ([reduction][option-reduction]).
        ids: one int64 id per local pair, or ``None`` ([ids][option-ids]).
        same_id: ``"mask"`` or ``"positive"``: what pairs with the same id are ([ids][option-ids]).
        communication: ``"gather"`` (only the texts are gathered) or ``"ring"`` (text blocks
            travel) ([communication][option-communication]).

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss (0 for an empty global batch or
        all-zero weights); ``"none"``: this rank's per-row losses.
        Float32 (float64 for float64 features), gradients in the inputs' dtypes
        ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, when an input or option is invalid on any rank, or
            the ranks' inputs or options differ ([checked on every rank][option-agreement]).

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale, logit_bias: ``()``;
        weight: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import siglip
        >>> images, texts = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        >>> scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        >>> siglip(images, texts, scale, bias, chunk_size=3).backward()
        >>> bias.grad.shape
        torch.Size([])
        >>> siglip(images, texts, scale, bias, reduction="none").shape
        torch.Size([4])

    """

    def arguments() -> _Arguments:
        images, texts = check_pair("image_features", image_features, "text_features", text_features)
        check_reduction(reduction, weight)
        check_communication(communication)
        check_same_id(same_id)
        return _Arguments(
            images,
            texts,
            positive_scalar("logit_scale", logit_scale, images),
            scalar_tensor("logit_bias", logit_bias, images),
            check_chunk_size(chunk_size),
            check_weight(weight, images.shape[0], images),
            check_ids("ids", ids, images.shape[0], images),
        )

    checked, problem = collect(arguments)
    layout = agree(
        (image_features, text_features, *(() if ids is None else (ids,))),
        problem=problem,
        group=group,
        operation="siglip",
        options=agreed_options(chunk_size=chunk_size, communication=communication, reduction=reduction,
                               weight=weight, ids=ids is not None, same_id=same_id),
        sizes=sizes,
        total=None if checked is None else weight_total(checked.weights),
        flags=0 if checked is None else small_keys_flag(checked.ids, compute_dtype(checked.images.dtype)),
    )
    images, texts, scale, bias, chunk, weights, pair_ids = cast(_Arguments, checked)
    with full_precision(images.device):
        keys = None
        if pair_ids is not None:
            keys = comparable_keys(pair_ids, scale.dtype, layout.every_rank_has(SMALL_KEYS))
        columns = meet(communication, layout, (operands(texts), *(() if keys is None else (keys,))))
        own_text = torch.arange(images.shape[0], device=images.device)
        pairs = Pairs(
            SIGMOID,
            pair_targets(own_text, keys=keys, same_id=same_id),
            columns.transport,
            chunk,
            column_keys=None if keys is None else columns.tensors[1],
            key_rows=columns.rows,
        )
        direction = Direction(operands(images), columns.tensors[0], scale, bias, pairs)
        value, _ = mean_over_directions([direction], weights=weights, per_row=reduction == "none")
    if reduction == "none":
        return value
    return mean_share(value, layout, sum(layout.sizes) if layout.total is None else layout.total)


class SigLIPLoss(nn.Module):
    """SigLIP's sigmoid loss over the global batch; holds the options of :func:`siglip`.

    Args:
        chunk_size: image rows per block; same result ([chunk_size][option-chunk-size]).
        group: the process group, default the world ([group][option-group]).
        reduction: ``"mean"`` or ``"none"``, per-row losses ([reduction][option-reduction]).
        communication: ``"gather"`` or ``"ring"`` ([communication][option-communication]).
        same_id: what pairs with the same ``ids`` (given to ``forward``) are: ``"mask"`` or
            ``"positive"`` ([ids][option-ids]).

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale, logit_bias: ``()``;
        weight: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import SigLIPLoss
        >>> criterion = SigLIPLoss()
        >>> images, texts = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        >>> criterion(images, texts, torch.tensor(10.0), torch.tensor(-10.0)).backward()

    """

    def __init__(
        self,
        *,
        chunk_size: int | None = None,
        group: ProcessGroup | None = None,
        reduction: Reduction = "mean",
        communication: Communication = "gather",
        same_id: SameId = "mask",
    ) -> None:
        super().__init__()
        self.chunk_size = check_chunk_size(chunk_size)
        self.group = group
        self.reduction = check_reduction(reduction, None)
        self.communication = check_communication(communication)
        self.same_id = check_same_id(same_id)

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float,
        *,
        sizes: Sequence[int] | None = None,
        weight: Tensor | None = None,
        ids: Tensor | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss (or its per-row losses); see :func:`siglip`."""
        return siglip(
            image_features,
            text_features,
            logit_scale,
            logit_bias,
            chunk_size=self.chunk_size,
            group=self.group,
            sizes=sizes,
            weight=weight,
            reduction=self.reduction,
            communication=self.communication,
            ids=ids,
            same_id=self.same_id,
        )

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return (
            f"chunk_size={self.chunk_size}, reduction={self.reduction!r}, communication={self.communication!r}, "
            f"same_id={self.same_id!r}"
        )
