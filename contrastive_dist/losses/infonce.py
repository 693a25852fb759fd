"""CLIP's symmetric InfoNCE loss over the global batch of every rank (Radford et al., 2021)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_world_size
from contrastive_dist._validation import (
    check_chunk_size,
    check_pair,
    check_temperature,
    resolve_scale,
    validated_on_all_ranks,
)
from contrastive_dist.engine.gather import all_gather_many
from contrastive_dist.losses._chunked import Targets, cross_entropy, upcast
from contrastive_dist.losses._module import TemperatureLoss
from contrastive_dist.losses._negatives import SharedNegatives, check_negatives, negative_columns, negatives_marker
from contrastive_dist.losses._reduction import Reduction, check_reduction, check_weight, mean_factor
from contrastive_dist.losses._ring_losses import Communication, check_communication, ring_checks, ring_info_nce

__all__ = ["DistributedInfoNCE", "info_nce"]


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
) -> Tensor:
    """CLIP loss of this rank's pairs against every rank's pairs; exact under data parallelism.

    Image ``i`` must pick text ``i`` among all ``N`` texts of the global batch (cross-entropy
    over ``logit_scale · image @ textᵀ``), and with ``symmetric=True`` text ``i`` must pick
    image ``i`` too; the two directions are averaged. ``symmetric=False`` keeps image→text only.

    The features are used as given: normalise them in the model, as CLIP does. Each rank
    computes its local rows against the gathered columns and returns ``(W / N) · Σ_i ℓ_i``, so
    the mean over ranks of the returned values is the single-process loss and DDP's gradient
    averaging gives its exact gradient, for any per-rank batch sizes (including 0). Without a
    process group this is the plain single-process loss.

    **Extra negatives.** ``negatives`` adds columns that every image row must rank below its
    text (image→text only; text→image is unchanged): a tensor holds this rank's own negatives
    (any count, 0 included, e.g. ``k`` hard negatives per query), gathered from every rank in
    rank order, each one's gradient returned to its owner; :class:`SharedNegatives` (e.g.
    :attr:`DistributedMemoryQueue.negatives`) holds negatives identical on every rank, used as
    they are, without gradient.

    **Weights and reduction.** A pair's loss ``ℓ_i`` is the mean of its two directions (its
    image→text term alone when ``symmetric=False``). With ``weight`` the loss is
    ``Σ_i w_i ℓ_i / Σ_global w_i`` over the global batch (this rank returns ``W · Σ_local w_i ℓ_i /
    Σ_global w``, still exact under DDP). ``reduction="none"`` returns this rank's ``ℓ_i`` as they
    are: the caller owns the normalisation (``rows.sum() * W / N`` gives back the mean's share).

    Args:
        image_features: this rank's image embeddings.
        text_features: this rank's text embeddings, row ``i`` paired with image row ``i``.
        logit_scale: the similarity multiplier, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``, as in CLIP); receives gradients. Default ``1 / temperature``.
        temperature: used when ``logit_scale`` is ``None``; must be > 0.
        symmetric: average image→text and text→image (``True``) or image→text only.
        chunk_size: compute ``chunk_size`` rows at a time against all gathered columns, so
            at most ``chunk_size × N`` logits exist at once; same value and gradients.
        group: the process group (default: the world).
        sizes: every rank's batch size, if known (skips the size exchange).
        negatives: extra negative texts: this rank's own ``(k_r, D)`` (same dtype as the texts,
            the same kind on every rank) or :class:`SharedNegatives`; see above.
        weight: one weight ≥ 0 per local pair (no gradient); see above.
        reduction: ``"mean"`` (this rank's share of the global mean) or ``"none"`` (per-pair losses).
        communication: ``"gather"`` gathers every rank's features onto every rank (memory
            ``O(N·D + chunk·N)``); ``"ring"`` keeps the images here and passes text blocks round
            the ring, each logit block serving both directions (memory ``O(n_r·D + chunk·max_r n_r)``,
            independent of the number of ranks); same value and gradients, every option included:
            ``weight`` (one more scalar all-reduce), ``reduction="none"``, own negatives (they
            travel with their rank's text block, memory ``O(chunk·max_r (n_r + k_r))``) and
            shared negatives (local columns, no transfer).

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss (0 for an empty global batch or
        all-zero weights). ``"none"``: this rank's per-pair losses. Float32 (float64 for float64
        features): the core runs in float32 with autocast off, so fp16/bf16 features and
        ``torch.autocast`` work; gradients come back in the inputs' dtypes.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale: ``()``; negatives: ``(k_r, D)``
        or ``(K, D)`` shared; weight: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

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

    """
    with validated_on_all_ranks((image_features, text_features), group=group, sizes=ring_checks(communication, sizes)):
        image_features, text_features = check_pair("image_features", image_features, "text_features", text_features)
        scale = resolve_scale(logit_scale, check_temperature(temperature), image_features)
        chunk_size = check_chunk_size(chunk_size)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        reduction = check_reduction(reduction, weight)
        weights = check_weight(weight, image_features.shape[0], image_features)
        negatives = check_negatives(negatives, text_features)
        communication = check_communication(communication)
    if communication == "ring":
        return ring_info_nce(
            image_features,
            text_features,
            scale,
            symmetric=symmetric,
            chunk_size=chunk_size,
            group=group,
            sizes=sizes,
            negatives=negatives,
            weights=weights,
            reduction=reduction,
        )
    world_size = get_world_size(group)
    own = (image_features, text_features) if symmetric else (text_features,)
    extras = (() if weights is None else (weights,)) + negatives_marker(negatives, text_features)
    gathered = all_gather_many(own + extras, group=group, sizes=sizes)
    all_texts = gathered.tensors[len(own) - 1]
    if negatives is not None:
        # In the core's dtype: shared keys (a float32 queue) may differ from bf16/fp16 features.
        all_texts = upcast(all_texts)
        all_texts = torch.cat((all_texts, negative_columns(negatives, group).to(all_texts.dtype)))
    local_rows = torch.arange(image_features.shape[0], device=image_features.device)
    positives = Targets(columns=local_rows + gathered.offset)
    one_direction = functools.partial(cross_entropy, scale=scale, targets=positives, chunk_size=chunk_size)
    if reduction == "none":
        rows = one_direction(image_features, all_texts, reduction="none")
        if symmetric:
            rows = (rows + one_direction(text_features, gathered.tensors[0], reduction="none")) * 0.5
        return rows
    total = one_direction(image_features, all_texts, row_weights=weights)
    if symmetric:
        total = (total + one_direction(text_features, gathered.tensors[0], row_weights=weights)) * 0.5
    all_weights = None if weights is None else gathered.tensors[len(own)]
    return total * mean_factor(world_size, sum(gathered.sizes), all_weights)


class DistributedInfoNCE(TemperatureLoss):
    """CLIP loss over the global batch; holds the options of :func:`info_nce`.

    Args:
        temperature: ``1 / logit_scale`` when ``forward`` gets no ``logit_scale``; > 0.
        symmetric: average image→text and text→image, or image→text only.
        chunk_size: rows per block (bounded memory, same result); ``None``: all at once.
        group: the process group (default: the world).
        reduction: ``"mean"`` or ``"none"`` (per-pair losses; the caller normalises).
        communication: ``"gather"`` or ``"ring"`` (per-rank memory independent of the number of
            ranks; takes ``negatives``, ``weight`` and ``reduction`` too); see :func:`info_nce`.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale: ``()``; negatives: ``(k_r, D)``;
        weight: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

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
    ) -> None:
        super().__init__(
            temperature=temperature,
            chunk_size=chunk_size,
            group=group,
            reduction=reduction,
            communication=communication,
        )
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        self.symmetric = symmetric

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
        negatives: Tensor | SharedNegatives | None = None,
        weight: Tensor | None = None,
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
        )

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return f"{super().extra_repr()}, symmetric={self.symmetric}"
