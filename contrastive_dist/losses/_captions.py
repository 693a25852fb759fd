"""Several texts per image: ``n_r`` images against ``m_r`` texts a rank, positives from global ids.

A rank holds any number of images and of texts (0 included, different on every rank); ``image_ids``
and ``text_ids`` (int64, one meaning across the global batch) say which texts belong to which image:
every image–text pair with equal ids is a positive. The texts' counts are the agreement's second
count, so the texts are columns of a layout of their own (:attr:`~._frame.Call.second_layout`), in
gather and ring mode alike. Both losses are written with the frame's primitive:

* InfoNCE, each direction a masked log-sum-exp against its positives by key (the softmax family's row,
  ``logsumexp_t l_it − mean_{t ∈ P_i} l_it``); a row without a positive has no term and is not
  counted, so each direction's mean runs over the rows with one, a count only the ranks' sum gives.
* SigLIP+ (siglip-kernel's multi-positive SigLIP): a positive pair's term weighs ``α/k_i + β/k'_j``
  (``k_i`` the texts of image ``i``'s id, ``k'_j`` the images of text ``j``'s; ``α = β = ½``, or
  ``(1, 0)`` for images only), every negative 1. For a positive pair both counts are those of the one
  id, so the weight ``w_i`` is the row's: the row is ``w_i A_i + (1 − w_i) X_i``, with ``A_i`` the row
  with its positives as positives and ``X_i`` the row without them (soft labels: with them as
  negatives) — two calls of the sigmoid family's row, exact, no kernel of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist._dist import GroupLike, is_distributed
from contrastive_dist._validation import check_features
from contrastive_dist.losses._families import SIGMOID, SOFTMAX
from contrastive_dist.losses._frame import Call, Common, begin
from contrastive_dist.losses._options import Communication, check_ids, check_weight, full_precision, scalar_tensor
from contrastive_dist.losses._same_key import key_pairs
from contrastive_dist.losses._targets import RowTargets
from contrastive_dist.losses._transports import Columns, OneBlock

__all__ = [
    "Captions",
    "begin_captions",
    "caption_info_nce",
    "caption_siglip",
    "check_captions",
    "count_in",
    "plus_loss",
    "refuse_beside_captions",
    "refuse_without_captions",
]


class Captions(NamedTuple):
    """The checked inputs of a call with several texts per image (``text_weight``, ``bias``: if the loss has them)."""

    images: Tensor
    texts: Tensor
    image_ids: Tensor
    text_ids: Tensor
    text_weight: Tensor | None = None
    bias: Tensor | None = None


def begin_captions(common: Common, images: object, texts: object, image_ids: object, text_ids: object, *,
                   refused: Mapping[str, object], options: Mapping[str, object], text_weight: object = None,
                   bias: object = None, text_sizes: Sequence[int] | None = None) -> Call[Captions]:  # fmt: skip
    """:func:`~._frame.begin` for a call with several texts per image: the texts' counts are its second count.

    ``refused``: the loss's options that do not go with ids of images and texts, as given; ``bias``: SigLIP's;
    ``text_sizes``: every rank's text count, if the caller knows it (needed under ``torch.compile``).
    """
    if torch.compiler.is_compiling() and is_distributed(common.group) and text_sizes is None:
        raise ValueError("image_ids= and text_ids= under torch.compile need text_sizes= beside sizes= (every rank's "
                         "count of texts; exchanging the counts is data-dependent)")

    def own() -> Captions:
        refuse_beside_captions(**refused)
        checked = check_captions(images, texts, image_ids, text_ids)
        own_bias = None if bias is None else scalar_tensor("logit_bias", bias, checked.images)
        weight = check_weight(text_weight, checked.texts.shape[0], checked.texts, "text_weight")
        return checked._replace(text_weight=weight, bias=own_bias)

    count = texts.shape[0] if isinstance(texts, Tensor) and texts.ndim == 2 else 0
    agreed = {**options, "text_weight": text_weight is not None}
    return begin(own, common, inputs=(images, texts, image_ids, text_ids, text_weight), options=agreed,
                 keyed=(image_ids, text_ids), extra=count, extra_sizes=text_sizes,
                 scalars=None if bias is None else {"logit_bias": 5})


def check_captions(images: object, texts: object, image_ids: object, text_ids: object) -> Captions:
    """Check ``(n, D)`` images and ``(m, D)`` texts of one width and dtype, with one int64 id each."""
    image_tensor, text_tensor = check_features("image_features", images), check_features("text_features", texts)
    if image_tensor.shape[1] != text_tensor.shape[1] or image_tensor.dtype != text_tensor.dtype:
        raise ValueError(
            "image_features and text_features must share their width D and dtype, got "
            f"{tuple(image_tensor.shape)} {image_tensor.dtype} and {tuple(text_tensor.shape)} {text_tensor.dtype}"
        )
    if image_ids is None or text_ids is None:
        raise ValueError("image_ids= and text_ids= go together: give one id per image and one per text")
    checked_image_ids = cast(Tensor, check_ids("image_ids", image_ids, image_tensor.shape[0], image_tensor))
    checked_text_ids = cast(Tensor, check_ids("text_ids", text_ids, text_tensor.shape[0], text_tensor))
    return Captions(image_tensor, text_tensor, checked_image_ids, checked_text_ids)


def refuse_beside_captions(**options: object) -> None:
    """A ``ValueError`` naming the first option given that does not go with ``image_ids=`` / ``text_ids=``."""
    for name, value in options.items():
        if value is not None and value is not False:
            raise ValueError(f"{name}= does not go with image_ids= and text_ids= (positives by id)")


def refuse_without_captions(**options: object) -> None:
    """A ``ValueError`` naming the first option given that only goes with ``image_ids=`` / ``text_ids=``."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{name}= goes with image_ids= and text_ids= (several texts per image) only")


def caption_info_nce(call: Call[Captions], *, symmetric: bool) -> Tensor:
    """``½ (mean_i ℓ_i + mean_t ℓ_t)`` over the images and texts with a positive (``symmetric=False``: the first).

    ``reduction="none"``: the images' ``ℓ_i`` then the texts' ``ℓ_t``, ``(n_r + m_r,)`` (0 without a positive).
    """
    images, texts, image_ids, text_ids, text_weight, _ = call.own
    image_keys, text_keys = call.keys(image_ids), call.keys(text_ids)
    directions = [(images, call.columns(texts, keys=text_keys, second=True), image_keys, call.weights)]
    if symmetric:
        directions.append((texts, call.columns(images, keys=image_keys), text_keys, text_weight))
    if call.per_row:
        return torch.cat([call.rows(SOFTMAX, rows, columns, RowTargets(keys=keys))[0]
                          for rows, columns, keys, _ in directions])  # fmt: skip
    means = []
    for rows, columns, keys, weights in directions:
        total, has_positive = call.weighted_sum(SOFTMAX, rows, columns, RowTargets(keys=keys), weights=weights)
        counted = has_positive.to(total.dtype) if weights is None else has_positive * weights.to(total.dtype)
        means.append(call.share(total, local_denominator=counted.sum()))
    return means[0] if len(means) == 1 else 0.5 * (means[0] + means[1])


def caption_siglip(call: Call[Captions], *, symmetric: bool = True, soft_label: bool = False,
                   per_pair: bool = False) -> Tensor:
    """SigLIP+'s loss: its pairs' terms summed, over ``N`` (``per_pair``: over ``N·M``, siglip-kernel's).

    ``symmetric``: ``½ (the images' direction + the texts')``, else the images' alone. Without ``text_weight``
    and per-row losses, one pass over the image rows (both directions' weights are then a row's); else each
    direction its own pass (:func:`_plus_rows` with the texts as rows). ``reduction="none"``: the images'
    ``ℓ_i`` then the texts' ``ℓ_t``, ``(n_r + m_r,)``.
    """
    images, texts, image_ids, text_ids, text_weight, _ = call.own
    image_keys, text_keys = cast(Tensor, call.keys(image_ids)), cast(Tensor, call.keys(text_ids))
    to_texts = call.columns(texts, keys=text_keys, second=True)
    every_text = _every_key(call, to_texts, text_ids, second=True)
    per = sum(call.layout.extra_sizes) if per_pair else 1
    share = (0.5, 0.5) if symmetric else (1.0, 0.0)
    if not call.per_row and text_weight is None:  # one pass: a row's negatives weigh alike, and its positives
        weights, balance = _weights_and_balance(call)  # balance: W / N, what a text direction's term weighs
        negative = share[0] * weights + share[1] * balance
        positive = share[0] * weights / count_in(image_keys, every_text).clamp_min(1).to(weights.dtype)
        if symmetric:  # the images of each row's id: every rank's image ids, gathered here
            every_image = cast(Tensor, call.keys(call.gathered(image_ids)))
            positive = positive + share[1] * balance / count_in(image_keys, every_image).clamp_min(1).to(weights.dtype)
        return call.share(_plus_rows(call, images, image_keys, to_texts, positive, negative, soft_label), per=per)
    directions: list[tuple[Tensor, Tensor, Columns, Tensor, Tensor | None]] = [
        (images, image_keys, to_texts, every_text, call.weights)]
    if symmetric:
        to_images = call.columns(images, keys=image_keys)
        every_image = _every_key(call, to_images, image_ids, second=False)
        directions.append((texts, text_keys, to_images, every_image, text_weight))
    values = []
    for anchors, keys, columns, others, given in directions:  # each with its own 1/k, its anchors' weights
        inverse = 1 / count_in(keys, others).clamp_min(1).to(call.scale.dtype)
        row_weights = None if call.per_row else _ones_or(given, inverse)
        weighted = inverse if row_weights is None else inverse * row_weights
        values.append(_plus_rows(call, anchors, keys, columns, weighted, row_weights, soft_label))
    if call.per_row:
        return torch.cat(values)
    means = [call.share(values[0], per=per)]
    if symmetric:  # the texts' weighted mean times M / N: without weights, their pairs' sum over N, as above
        counted = _ones_or(text_weight, texts.new_empty(texts.shape[0], dtype=call.scale.dtype)).sum()
        images_total, texts_total = sum(call.layout.sizes), sum(call.layout.extra_sizes)
        ratio = images_total / texts_total if texts_total else 0.0
        means.append(call.share(values[1], local_denominator=counted * (ratio * per)))
    return means[0] if len(means) == 1 else share[0] * means[0] + share[1] * means[1]


def _plus_rows(call: Call[Captions], anchors: Tensor, keys: Tensor, columns: Columns, positive: Tensor,
               negative: Tensor | None, soft_label: bool) -> Tensor:  # fmt: skip
    """Each anchor's SigLIP+ row ``Σ_j v_ij (softplus(s_ij) − s_ij y_ij)``, or their sum (``negative`` given).

    Row ``i``'s positive pairs weigh ``positive[i]`` and its negatives ``negative[i]`` (``None``: per-row
    values, negatives 1); soft labels: every pair the negatives' weight, a positive's label the ratio. The
    row is ``p A + (c − p) X``, ``A`` the primitive's row with its positives, ``X`` without them (soft
    labels: with them as negatives); in gather mode, where every column is here, ``c A`` plus the positive
    pairs' part directly (:func:`_positive_part`): one call of the primitive.

    Shape:
        anchors: ``(n, D)``; keys, positive, negative: ``(n,)``; output: ``(n,)``, or ``()`` with ``negative``.
    """
    bias = call.own.bias
    with_positives = RowTargets(keys=keys)
    if isinstance(columns.transport, OneBlock):
        excess = positive - (1 if negative is None else negative)
        corrections = _positive_part(call, anchors, keys, columns, excess, soft_label)
        if negative is None:
            return call.rows(SIGMOID, anchors, columns, with_positives, bias=bias)[0] + corrections
        total = call.weighted_sum(SIGMOID, anchors, columns, with_positives, weights=negative, bias=bias)[0]
        return total + corrections.sum()
    without = RowTargets() if soft_label else RowTargets(keys=keys, key_rule="mask")
    if negative is None:
        rows = [call.rows(SIGMOID, anchors, columns, targets, bias=bias)[0] for targets in (with_positives, without)]
        return positive * rows[0] + (1 - positive) * rows[1]
    parts = [call.weighted_sum(SIGMOID, anchors, columns, targets, weights=part, bias=bias)[0]
             for targets, part in ((with_positives, positive), (without, negative - positive))]  # fmt: skip
    return parts[0] + parts[1]


def _positive_part(call: Call[Captions], anchors: Tensor, keys: Tensor, columns: Columns, excess: Tensor,
                   soft_label: bool) -> Tensor:  # fmt: skip
    """``(n,)`` what each row's positive pairs add beyond the primitive's row weighted by its negatives' weight.

    With ``excess`` the positives' weight less the negatives': ``excess_i Σ_{j ∈ P_i} softplus(−s_ij)``;
    soft labels ``−excess_i Σ_{j ∈ P_i} s_ij``. Differentiable, through the gathered columns.
    """
    pairs = key_pairs(keys, cast(Tensor, columns.keys))
    assert pairs is not None
    rows, others = pairs
    dtype = call.scale.dtype
    products = (anchors[rows].to(dtype) * columns.features[others].to(dtype)).sum(dim=1)
    logits = call.scale * products + cast(Tensor, call.own.bias)
    terms = -excess[rows] * logits if soft_label else excess[rows] * F.softplus(-logits)
    return logits.new_zeros(anchors.shape[0]).index_add(0, rows, terms)


def _every_key(call: Call[Captions], columns: Columns, ids: Tensor, *, second: bool) -> Tensor:
    """Every rank's keys of ``ids``: the columns' where gather mode has them already, else gathered here."""
    if isinstance(columns.transport, OneBlock):
        return cast(Tensor, columns.keys)
    return cast(Tensor, call.keys(call.gathered(ids, second=second)))


def _weights_and_balance(call: Call[Captions]) -> tuple[Tensor, Tensor | float]:
    """The image rows' weights (ones without ``weight=``) and ``W / N``: their global total over the images."""
    images = call.own.images
    if call.weights is None:
        return images.new_ones(images.shape[0], dtype=call.scale.dtype), 1.0
    total = cast(Tensor, call.layout.total).to(call.scale.dtype)
    return call.weights.to(call.scale.dtype), total / max(sum(call.layout.sizes), 1)


def _ones_or(weights: Tensor | None, like: Tensor) -> Tensor:
    """``weights`` in ``like``'s dtype, or ones shaped like ``like``."""
    return torch.ones_like(like) if weights is None else weights.to(like.dtype)


def count_in(ids: Tensor, every: Tensor) -> Tensor:
    """``(n,)`` how many entries of ``every`` equal each of ``ids`` (sorted once, not an ``n × M`` mask)."""
    ordered = every.sort().values
    return torch.searchsorted(ordered, ids, side="right") - torch.searchsorted(ordered, ids, side="left")



def plus_loss(images: Tensor, texts: Tensor, logit_scale: Tensor, logit_bias: Tensor, image_ids: Tensor,
              text_ids: Tensor, *, symmetric: bool, soft_label: bool, chunk_size: int | None,
              communication: Communication, group: GroupLike) -> Tensor:  # fmt: skip
    """siglip-kernel's SigLIP+ over the global batch: its mean over the ``N·M`` pairs (the drop-ins' loss).

    Shape:
        images: ``(n_r, D)``; texts: ``(m_r, D)``; image_ids: ``(n_r,)``; text_ids: ``(m_r,)``; output: ``()``.
    """
    common = Common(operation="siglip_plus", logit_scale=logit_scale, temperature=None, chunk_size=chunk_size,
                    group=group, sizes=None, weight=None, reduction="mean", communication=communication)
    call = begin_captions(common, images, texts, image_ids, text_ids, refused={}, bias=logit_bias,
                          options={"symmetric": symmetric, "soft_label": soft_label})
    with full_precision(call.own.images.device):
        return caption_siglip(call, symmetric=symmetric, soft_label=soft_label, per_pair=True)
