"""CLIP's symmetric InfoNCE loss over the global batch of every rank (Radford et al., 2021)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_pair
from contrastive_dist.losses._captions import begin_captions, caption_info_nce, refuse_without_captions
from contrastive_dist.losses._families import SOFTMAX
from contrastive_dist.losses._frame import Common, begin
from contrastive_dist.losses._module import HeldOptions
from contrastive_dist.losses._negatives import SharedNegatives, check_negatives, negatives_options
from contrastive_dist.losses._options import Communication, Reduction, SameId, check_bool, full_precision
from contrastive_dist.losses._targets import pair_targets

__all__ = ["DistributedInfoNCE", "info_nce"]


def info_nce(
    image_features: Tensor, text_features: Tensor, logit_scale: Tensor | float | None = None, *,
    temperature: float = 0.07, symmetric: bool = True, chunk_size: int | None = None, group: GroupLike = None,
    sizes: Sequence[int] | None = None, negatives: Tensor | SharedNegatives | None = None, weight: Tensor | None = None,
    reduction: Reduction = "mean", communication: Communication = "gather", ids: Tensor | None = None,
    same_id: SameId = "mask", negative_ids: Tensor | None = None, image_ids: Tensor | None = None,
    text_ids: Tensor | None = None, text_weight: Tensor | None = None, text_sizes: Sequence[int] | None = None,
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

    **Several texts per image** ([several captions][several-captions]). With ``image_ids`` and
    ``text_ids`` a rank passes ``n_r`` images and ``m_r`` texts (any counts, 0 included); every pair
    with equal ids over the global batch is a positive. With ``P_i = {t : text_id_t = image_id_i}``
    and ``P_t = {i : image_id_i = text_id_t}``, ``ℓ_i = −(1/|P_i|) Σ_{t ∈ P_i} log softmax_t'(l_it')[t]``
    over all ``M`` texts, ``ℓ_t`` likewise over all ``N`` images, and the loss is
    ``½ (mean_i ℓ_i + mean_t ℓ_t)`` over the images and texts that have a positive (``weight`` and
    ``text_weight`` weigh those means). ``reduction="none"`` returns the images' ``ℓ_i`` then the texts'
    ``ℓ_t`` (0 without a positive). Not with ``ids`` or ``negatives``; under ``torch.compile`` on several
    ranks with ``sizes=`` (images) and ``text_sizes=`` (texts) given.

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
        group: a process group or a device mesh, default the world ([group][option-group]).
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
        image_ids: ``(n_r,)`` int64 global ids of the images: several texts per image (with ``text_ids``).
        text_ids: ``(m_r,)`` int64 global ids of the texts; a text is a positive of every image of its id.
        text_weight: ``(m_r,)`` one weight ≥ 0 per text, with ``image_ids`` / ``text_ids`` only.
        text_sizes: every rank's text count, if known (with ``image_ids`` / ``text_ids``; like ``sizes``).

    Returns:
        The global loss on every rank, its gradient this rank's share ([the contract][gradient-contract]),
        or its per-pair losses with ``reduction="none"`` ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, if any rank's call is wrong ([agreement][option-agreement]).

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
    common = Common(operation="info_nce", logit_scale=logit_scale, temperature=temperature, chunk_size=chunk_size,
                    group=group, sizes=sizes, weight=weight, reduction=reduction, communication=communication,
                    ids=ids, same_id=same_id)
    if image_ids is not None or text_ids is not None:  # several texts per image
        refused = {"negatives": negatives, "negative_ids": negative_ids, "ids": ids}
        captions = begin_captions(common, image_features, text_features, image_ids, text_ids, refused=refused,
                                  options={"symmetric": symmetric}, text_weight=text_weight, text_sizes=text_sizes)
        with full_precision(captions.own.images.device):
            return caption_info_nce(captions, symmetric=symmetric)
    given = negatives is not None or negative_ids is not None  # extra columns (most calls have none)

    def own() -> _Inputs:
        images, texts = check_pair("image_features", image_features, "text_features", text_features)
        check_bool("symmetric", symmetric)
        refuse_without_captions(text_weight=text_weight, text_sizes=text_sizes)
        extra = check_negatives(negatives, negative_ids, ids, texts) if given else (None, None)
        return _Inputs(images, texts, *extra)

    own_negatives = negatives if isinstance(negatives, Tensor) else None
    options = {"symmetric": symmetric, **(negatives_options(negatives, negative_ids) if given else {})}
    call = begin(own, common, inputs=(image_features, text_features, own_negatives, negative_ids), options=options,
                 keyed=(negative_ids,), extra=0 if own_negatives is None else own_negatives.shape[0])  # fmt: skip
    images, texts, extra, extra_ids = call.own
    with full_precision(images.device):
        keys = call.keys(call.ids)
        columns = call.columns(texts, keys=keys, negatives=extra, negative_keys=call.keys(extra_ids),
                               own_losses=symmetric)  # fmt: skip
        pairs = torch.arange(images.shape[0], device=images.device)  # image i's text is text i, and back
        targets = pair_targets(pairs, keys=keys, same_id=same_id, column_positive=pairs if symmetric else None)
        return call.mean(SOFTMAX, images, columns, targets)


class _Inputs(NamedTuple):
    """The checked inputs of :func:`info_nce`."""

    images: Tensor
    texts: Tensor
    negatives: Tensor | SharedNegatives | None
    negative_ids: Tensor | None


class DistributedInfoNCE(HeldOptions):
    """CLIP loss over the global batch; holds the options of :func:`info_nce`.

    ``temperature``, ``symmetric``, ``chunk_size``, ``group``, ``reduction``, ``communication`` and
    ``same_id`` mean what they mean for :func:`info_nce`, checked here; ``temperature`` applies when
    ``forward`` gets no ``logit_scale``.

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

    def __init__(self, *, temperature: float = 0.07, symmetric: bool = True, chunk_size: int | None = None,
                 group: GroupLike = None, reduction: Reduction = "mean",
                 communication: Communication = "gather", same_id: SameId = "mask") -> None:
        super().__init__(temperature=temperature, symmetric=symmetric, chunk_size=chunk_size, group=group,
                         reduction=reduction, communication=communication, same_id=same_id)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor | float | None = None, *,
                sizes: Sequence[int] | None = None, negatives: Tensor | SharedNegatives | None = None,
                weight: Tensor | None = None, ids: Tensor | None = None, negative_ids: Tensor | None = None,
                image_ids: Tensor | None = None, text_ids: Tensor | None = None,
                text_weight: Tensor | None = None, text_sizes: Sequence[int] | None = None) -> Tensor:  # fmt: skip
        """Return the global loss, its gradient this rank's share (or the per-pair losses); see :func:`info_nce`."""
        return info_nce(image_features, text_features, logit_scale, sizes=sizes, negatives=negatives, weight=weight,
                        ids=ids, negative_ids=negative_ids, image_ids=image_ids, text_ids=text_ids,
                        text_weight=text_weight, text_sizes=text_sizes, **self.options())  # fmt: skip
