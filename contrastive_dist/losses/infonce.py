"""CLIP's symmetric InfoNCE loss over the global batch of every rank (Radford et al., 2021)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._validation import check_pair, collect
from contrastive_dist.engine._agreement import agree
from contrastive_dist.losses._columns import Columns, meet
from contrastive_dist.losses._kernel import SOFTMAX, Pairs
from contrastive_dist.losses._module import TemperatureLoss
from contrastive_dist.losses._negatives import (
    SharedNegatives,
    check_negative_ids,
    check_negatives,
    negatives_kind,
    shared_negatives_option,
    with_own_negatives,
)
from contrastive_dist.losses._options import (
    Communication,
    Reduction,
    SameId,
    agreed_options,
    check_bool,
    check_chunk_size,
    check_communication,
    check_ids,
    check_reduction,
    check_same_id,
    check_temperature,
    check_weight,
    resolve_scale,
)
from contrastive_dist.losses._precision import compute_dtype, full_precision, operands
from contrastive_dist.losses._reduction import Direction, mean_over_directions, mean_share, weight_total
from contrastive_dist.losses._targets import SMALL_KEYS, comparable_keys, pair_targets, small_keys_flag

__all__ = ["DistributedInfoNCE", "info_nce"]


class _Arguments(NamedTuple):
    images: Tensor
    texts: Tensor
    scale: Tensor
    chunk_size: int | None
    weights: Tensor | None
    negatives: Tensor | SharedNegatives | None
    ids: Tensor | None
    negative_ids: Tensor | None


def info_nce(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor | float | None = None,
    *,
    temperature: float = 0.07,
    symmetric: bool = True,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    negatives: Tensor | SharedNegatives | None = None,
    weight: Tensor | None = None,
    reduction: Reduction = "mean",
    communication: Communication = "gather",
    ids: Tensor | None = None,
    same_id: SameId = "mask",
    negative_ids: Tensor | None = None,
) -> Tensor:
    """CLIP loss of this rank's pairs against every rank's pairs; exact under data parallelism.

    Image ``i`` must pick text ``i`` among all ``N`` texts of the global batch (cross-entropy
    over ``logit_scale · image @ textᵀ``), and with ``symmetric=True`` text ``i`` must pick
    image ``i`` too; the two directions are averaged. ``symmetric=False`` keeps image→text only.

    The features are used as given: normalise them in the model, as CLIP does. Each rank
    computes its local rows against every column and returns ``(W / N) · Σ_i ℓ_i``, so the mean
    over ranks of the returned values is the single-process loss and DDP's gradient averaging
    gives its exact gradient, for any per-rank batch sizes (including 0): the
    [gradient contract][gradient-contract]. Without a process group this is the plain
    single-process loss.

    **Extra negatives.** ``negatives`` adds columns that every image row must rank below its
    text (image→text only; text→image is unchanged): a tensor holds this rank's own negatives
    (any count, 0 included, e.g. ``k`` hard negatives per query), met by every rank's rows, each
    one's gradient returned to its owner; :class:`SharedNegatives` (e.g.
    :attr:`DistributedMemoryQueue.negatives`) holds negatives identical on every rank, used as
    they are, without gradient.

    **Sample ids** ([ids][option-ids]). With ``same_id="mask"`` a column with the row's id, other
    than its own positive, is left out of the row's softmax. With ``same_id="positive"`` every column
    with the row's id is a positive: ``ℓ_i = logsumexp_j l_ij − (1/|P_i|) Σ_{p ∈ P_i} l_ip`` with
    ``P_i = {j : id_j = id_i}`` (its own pair included), in each direction. ``negative_ids`` gives
    the extra negatives ids too (a mined negative that is a positive of its query is then masked, or
    counted as a positive); negatives without ids share none.

    **A row** of ``weight`` and ``reduction="none"`` ([weight][option-weight],
    [reduction][option-reduction]) is a pair: its loss ``ℓ_i`` is the mean of its two directions
    (its image→text term alone when ``symmetric=False``).

    Args:
        image_features: this rank's image embeddings.
        text_features: this rank's text embeddings, row ``i`` paired with image row ``i``.
        logit_scale: the similarity multiplier, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``, as in CLIP); receives gradients. Default ``1 / temperature``.
        temperature: used when ``logit_scale`` is ``None``; must be > 0.
        symmetric: average image→text and text→image (``True``) or image→text only.
        chunk_size: rows computed at a time; same result ([chunk_size][option-chunk-size]).
        group: the process group, default the world ([group][option-group]).
        sizes: every rank's batch size, if known ([sizes][option-sizes]).
        negatives: extra negative texts: this rank's own ``(k_r, D)`` (same dtype as the texts,
            the same kind on every rank) or :class:`SharedNegatives`; see above.
        weight: one weight ≥ 0 per local pair ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, per-pair losses ([reduction][option-reduction]).
        communication: ``"gather"`` or ``"ring"``; in ring mode the text blocks travel with their
            rank's own negatives, the images stay ([communication][option-communication]).
        ids: one int64 id per local pair, or ``None`` ([ids][option-ids]).
        same_id: ``"mask"`` or ``"positive"``: what pairs with the same id are ([ids][option-ids]).
        negative_ids: ``(k_r,)`` (own) or ``(K,)`` (shared) int64 ids of ``negatives``, or ``None``.

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss (0 for an empty global batch or
        all-zero weights). ``"none"``: this rank's per-pair losses. Float32 (float64 for float64
        features), gradients in the inputs' dtypes ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, when an input or option is invalid on any rank, or
            the ranks' inputs or options differ ([checked on every rank][option-agreement]).

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale: ``()``; negatives: ``(k_r, D)``
        or ``(K, D)`` shared; weight, ids: ``(n_r,)``; negative_ids: ``(k_r,)`` or ``(K,)``;
        output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import info_nce
        >>> images = F.normalize(torch.randn(4, 16), dim=-1).requires_grad_()
        >>> texts = F.normalize(torch.randn(4, 16), dim=-1)
        >>> hard_negatives = F.normalize(torch.randn(8, 16), dim=-1)  # two per query
        >>> logit_scale = torch.tensor(1 / 0.07).log().requires_grad_()
        >>> loss = info_nce(images, texts, logit_scale.exp(), negatives=hard_negatives)
        >>> loss.backward()
        >>> loss.shape, logit_scale.grad is not None
        (torch.Size([]), True)
        >>> info_nce(images, texts, reduction="none").shape
        torch.Size([4])
        >>> captions = torch.tensor([7, 3, 7, 5])  # pairs 0 and 2 share a caption: not negatives of each other
        >>> info_nce(images, texts, ids=captions, same_id="positive").shape
        torch.Size([])

    """

    def arguments() -> _Arguments:
        images, texts = check_pair("image_features", image_features, "text_features", text_features)
        check_bool("symmetric", symmetric)
        check_reduction(reduction, weight)
        check_communication(communication)
        check_same_id(same_id)
        extra = check_negatives(negatives, texts)
        check_negative_ids(negative_ids, ids, extra)
        extra_rows = 0 if extra is None else (extra.keys if isinstance(extra, SharedNegatives) else extra).shape[0]
        return _Arguments(
            images,
            texts,
            resolve_scale(logit_scale, check_temperature(temperature), images),
            check_chunk_size(chunk_size),
            check_weight(weight, images.shape[0], images),
            extra,
            check_ids("ids", ids, images.shape[0], images),
            check_ids("negative_ids", negative_ids, extra_rows, images),
        )

    checked, problem = collect(arguments)
    own_negatives = checked.negatives if checked is not None and isinstance(checked.negatives, Tensor) else None
    optional = tuple(tensor for tensor in (own_negatives, ids, negative_ids) if isinstance(tensor, Tensor))
    small_keys: int | Tensor = 0
    if checked is not None:
        dtype = compute_dtype(checked.images.dtype)
        small_keys = small_keys_flag(checked.ids, dtype) & small_keys_flag(checked.negative_ids, dtype)
    layout = agree(
        (image_features, text_features, *optional),
        problem=problem,
        group=group,
        operation="info_nce",
        options=agreed_options(
            chunk_size=chunk_size,
            communication=communication,
            reduction=reduction,
            weight=weight,
            temperature=temperature,
            logit_scale=logit_scale,
            symmetric=symmetric,
            negatives=negatives_kind(negatives),
            ids=ids is not None,
            same_id=same_id,
            negative_ids=negative_ids is not None,
            shared_negatives=shared_negatives_option(negatives, negative_ids),  # identical on every rank
        ),
        sizes=sizes,
        extra=0 if own_negatives is None else own_negatives.shape[0],
        total=None if checked is None else weight_total(checked.weights),
        flags=small_keys,
    )
    arguments_ = cast(_Arguments, checked)
    images, texts, scale, chunk, weights, negatives = arguments_[:6]
    ring = communication == "ring"
    with full_precision(images.device):
        small = layout.every_rank_has(SMALL_KEYS)
        keys = None if arguments_.ids is None else comparable_keys(arguments_.ids, compute_dtype(images.dtype), small)
        keyed = () if keys is None else (keys,)
        # Gather mode's text→image direction weighs every rank's texts: their weights travel with them.
        weighed = (weights,) if symmetric and not ring and weights is not None else ()
        columns = meet(communication, layout, (texts, *keyed, *weighed))
        column_keys = columns.tensors[1] if keys is not None else None
        negative_keys = arguments_.negative_ids
        if negative_keys is not None:
            negative_keys = comparable_keys(negative_keys, compute_dtype(images.dtype), small)
        text_columns = Columns((operands(columns.tensors[0]), *(() if column_keys is None else (column_keys,))),
                               columns.transport, columns.rows)
        column_key_rows = columns.rows
        if own_negatives is not None:
            joined = (operands(own_negatives), negative_keys if column_keys is not None else None)
            text_columns = with_own_negatives(text_columns, joined, layout)
            column_key_rows = text_columns.rows if negative_keys is not None else columns.rows
        pairs_with = torch.arange(images.shape[0], device=images.device)
        # Text j's image: row j of its own rank (ring: its own block's column j; gather: the offset's).
        column_positive = None
        if symmetric:
            column_positive = torch.arange(columns.tensors[0].shape[0], device=images.device)
            column_positive = column_positive if ring else column_positive - layout.offset
        rows = pair_targets(pairs_with, keys=keys, same_id=same_id, column_positive=column_positive)
        image_to_text = Pairs(
            SOFTMAX,
            rows,
            text_columns.transport,
            chunk,
            column_keys=text_columns.tensors[1] if column_keys is not None else None,
            key_rows=text_columns.rows,
            column_key_rows=column_key_rows,
            columns=layout.sizes if symmetric else None,  # the texts' own losses, from the same logits
            local_keys=negatives.keys if isinstance(negatives, SharedNegatives) else None,
            local_column_keys=negative_keys if isinstance(negatives, SharedNegatives) else None,
            column_weights=columns.tensors[-1] if weighed else None,
        )
        direction = Direction(operands(images), text_columns.tensors[0], scale, None, image_to_text)
        value, _ = mean_over_directions([direction], weights=weights, per_row=reduction == "none")
    if reduction == "none":
        return value
    return mean_share(value, layout, sum(layout.sizes) if layout.total is None else layout.total)


class DistributedInfoNCE(TemperatureLoss):
    """CLIP loss over the global batch; holds the options of :func:`info_nce`.

    Args:
        temperature: ``1 / logit_scale`` when ``forward`` gets no ``logit_scale``; > 0.
        symmetric: average image→text and text→image, or image→text only.
        chunk_size: rows computed at a time; same result ([chunk_size][option-chunk-size]).
        group: the process group, default the world ([group][option-group]).
        reduction: ``"mean"`` or ``"none"``, per-pair losses ([reduction][option-reduction]).
        communication: ``"gather"`` or ``"ring"`` ([communication][option-communication]).
        same_id: what pairs with the same ``ids`` (given to ``forward``) are: ``"mask"`` or
            ``"positive"`` ([ids][option-ids]).

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale: ``()``; negatives: ``(k_r, D)``;
        weight, ids: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import DistributedInfoNCE
        >>> criterion = DistributedInfoNCE(temperature=0.07, chunk_size=2)
        >>> images = F.normalize(torch.randn(5, 8), dim=-1).requires_grad_()
        >>> texts = F.normalize(torch.randn(5, 8), dim=-1).requires_grad_()
        >>> loss = criterion(images, texts)
        >>> loss.backward()

    """

    def __init__(
        self,
        *,
        temperature: float = 0.07,
        symmetric: bool = True,
        chunk_size: int | None = None,
        group: ProcessGroup | None = None,
        reduction: Reduction = "mean",
        communication: Communication = "gather",
        same_id: SameId = "mask",
    ) -> None:
        super().__init__(
            temperature=temperature,
            chunk_size=chunk_size,
            group=group,
            reduction=reduction,
            communication=communication,
        )
        self.same_id = check_same_id(same_id)
        self.symmetric = check_bool("symmetric", symmetric)

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
        negatives: Tensor | SharedNegatives | None = None,
        weight: Tensor | None = None,
        ids: Tensor | None = None,
        negative_ids: Tensor | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss (or its per-pair losses); see :func:`info_nce`."""
        return info_nce(
            image_features,
            text_features,
            logit_scale,
            temperature=self.temperature,
            symmetric=self.symmetric,
            chunk_size=self.chunk_size,
            group=self.group,
            sizes=sizes,
            negatives=negatives,
            weight=weight,
            reduction=self.reduction,
            communication=self.communication,
            ids=ids,
            same_id=self.same_id,
            negative_ids=negative_ids,
        )

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return f"{super().extra_repr()}, symmetric={self.symmetric}, same_id={self.same_id!r}"
