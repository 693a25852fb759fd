"""SigLIP's pairwise sigmoid loss over the global batch of every rank (Zhai et al., 2023)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_pair
from contrastive_dist.losses._captions import begin_captions, caption_siglip, refuse_without_captions
from contrastive_dist.losses._families import SIGMOID
from contrastive_dist.losses._frame import Common, begin
from contrastive_dist.losses._module import HeldOptions
from contrastive_dist.losses._options import Communication, Reduction, SameId, full_precision, scalar_tensor
from contrastive_dist.losses._targets import pair_targets

__all__ = ["SigLIPLoss", "siglip"]


def siglip(
    image_features: Tensor, text_features: Tensor, logit_scale: Tensor | float, logit_bias: Tensor | float, *,
    chunk_size: int | None = None, group: GroupLike = None, sizes: Sequence[int] | None = None,
    weight: Tensor | None = None, reduction: Reduction = "mean", communication: Communication = "gather",
    ids: Tensor | None = None, same_id: SameId = "mask", image_ids: Tensor | None = None,
    text_ids: Tensor | None = None, text_weight: Tensor | None = None, text_sizes: Sequence[int] | None = None,
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

    **Several texts per image** ([several captions][several-captions]): SigLIP+. With ``image_ids``
    and ``text_ids`` a rank passes ``n_r`` images and ``m_r`` texts (any counts, 0 included); a pair with
    equal ids over the global batch is a positive, weighted as siglip-kernel's SigLIP+ weighs it:
    ``½ (1/k_i + 1/k'_j)`` (``k_i`` the texts with image ``i``'s id, ``k'_j`` the images with text ``j``'s),
    every negative 1: the loss is ``(1/N) Σ_{i,j} v_ij (softplus(s_ij) − s_ij y_ij)`` over the ``N × M`` pairs
    (siglip-kernel divides by ``N·M``: its drop-ins in ``contrastive_dist.compat.siglip_kernel``); with one
    text per image it is the loss above. It is the mean of two directions: image ``i``'s
    ``ℓ_i = Σ_j [P_ij/k_i · softplus(−s_ij) + (1 − P_ij) softplus(s_ij)]`` over all ``M`` texts and text ``j``'s
    ``ℓ_j`` the same with ``1/k'_j`` over all ``N`` images; ``weight`` weighs the images' and ``text_weight``
    the texts': ``½ (Σ_i w_i ℓ_i / Σ w + (M/N) Σ_j u_j ℓ_j / Σ u)`` (without weights the loss above), and
    ``reduction="none"`` returns the images' ``ℓ_i`` then the texts' ``ℓ_j``, ``(n_r + m_r,)``; with
    ``text_weight`` or ``reduction="none"`` each direction takes a pass of its own. Not with ``ids``; under
    ``torch.compile`` on several ranks with ``sizes=`` and ``text_sizes=`` given.

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
        group: a process group or a device mesh, default the world ([group][option-group]).
        sizes: every rank's batch size, if known ([sizes][option-sizes]).
        weight: one weight ≥ 0 per local image row ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, per-row losses ([reduction][option-reduction]).
        ids: one int64 id per local pair, or ``None`` ([ids][option-ids]).
        same_id: ``"mask"`` or ``"positive"``: what pairs with the same id are ([ids][option-ids]).
        image_ids: ``(n_r,)`` int64 global ids of the images: several texts per image (with ``text_ids``).
        text_ids: ``(m_r,)`` int64 global ids of the texts (``text_features`` then ``(m_r, D)``).
        text_weight: ``(m_r,)`` one weight ≥ 0 per text, with ``image_ids`` / ``text_ids`` only.
        text_sizes: every rank's text count, if known (with ``image_ids`` / ``text_ids``; like ``sizes``).
        communication: ``"gather"`` (only the texts are gathered) or ``"ring"`` (text blocks
            travel) ([communication][option-communication]).

    Returns:
        The global loss on every rank, its gradient that of this rank's pair terms times ``W / N`` (its
        share), or each image row's terms summed (``reduction="none"``) ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, if any rank's call is wrong ([agreement][option-agreement]).

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
    common = Common(operation="siglip", logit_scale=logit_scale, temperature=None, chunk_size=chunk_size,
                    group=group, sizes=sizes, weight=weight, reduction=reduction, communication=communication,
                    ids=ids, same_id=same_id)
    if image_ids is not None or text_ids is not None:  # several texts per image: SigLIP+'s rows
        captions = begin_captions(common, image_features, text_features, image_ids, text_ids, refused={"ids": ids},
                                  options={}, bias=logit_bias, text_weight=text_weight, text_sizes=text_sizes)
        with full_precision(captions.own.images.device):
            return caption_siglip(captions)

    def own() -> _Inputs:
        images, texts = check_pair("image_features", image_features, "text_features", text_features)
        refuse_without_captions(text_weight=text_weight, text_sizes=text_sizes)
        return _Inputs(images, texts, scalar_tensor("logit_bias", logit_bias, images))

    call = begin(own, common, inputs=(image_features, text_features), options={}, scalars={"logit_bias": 2})
    images, texts, bias = call.own
    with full_precision(images.device):
        keys = call.keys(call.ids)
        columns = call.columns(texts, keys=keys)
        own_text = torch.arange(images.shape[0], device=images.device)  # image i's positive: text i
        return call.mean(SIGMOID, images, columns, pair_targets(own_text, keys=keys, same_id=same_id), bias=bias)


class _Inputs(NamedTuple):
    """The checked inputs of :func:`siglip`."""

    images: Tensor
    texts: Tensor
    bias: Tensor


class SigLIPLoss(HeldOptions):
    """SigLIP's sigmoid loss over the global batch; holds the options of :func:`siglip`.

    Held: ``chunk_size``, ``group``, ``reduction``, ``communication`` and ``same_id`` (what pairs with
    the same ``ids``, given to ``forward``, are), as :func:`siglip` takes them.

    Example:
        >>> import torch
        >>> from contrastive_dist import SigLIPLoss
        >>> criterion = SigLIPLoss()
        >>> images, texts = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        >>> criterion(images, texts, torch.tensor(10.0), torch.tensor(-10.0)).backward()

    """

    def __init__(self, *, chunk_size: int | None = None, group: GroupLike = None,
                 reduction: Reduction = "mean", communication: Communication = "gather",
                 same_id: SameId = "mask") -> None:
        super().__init__(chunk_size=chunk_size, group=group, reduction=reduction, communication=communication,
                         same_id=same_id)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor | float,
                logit_bias: Tensor | float, *, sizes: Sequence[int] | None = None, weight: Tensor | None = None,
                ids: Tensor | None = None, image_ids: Tensor | None = None, text_ids: Tensor | None = None,
                text_weight: Tensor | None = None, text_sizes: Sequence[int] | None = None) -> Tensor:  # fmt: skip
        """Return the global loss, its gradient this rank's share (or the per-row losses); see :func:`siglip`."""
        return siglip(image_features, text_features, logit_scale, logit_bias, sizes=sizes, weight=weight, ids=ids,
                      image_ids=image_ids, text_ids=text_ids, text_weight=text_weight, text_sizes=text_sizes,
                      **self.options())
