"""Supervised contrastive loss over the global batch of every rank (Khosla et al., 2020)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_world_size
from contrastive_dist._validation import (
    check_chunk_size,
    check_features,
    check_temperature,
    resolve_scale,
    validated_on_all_ranks,
)
from contrastive_dist.engine.gather import all_gather_many
from contrastive_dist.losses._chunked import Targets, cross_entropy, full_precision, upcast
from contrastive_dist.losses._module import TemperatureLoss
from contrastive_dist.losses._reduction import Reduction, check_reduction, check_weight
from contrastive_dist.losses._ring_losses import Communication, check_communication, ring_checks, ring_supcon

__all__ = ["SupConLoss", "supcon"]


def supcon(
    features: Tensor,
    labels: Tensor,
    logit_scale: Tensor | float | None = None,
    *,
    temperature: float = 0.1,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    weight: Tensor | None = None,
    reduction: Reduction = "mean",
    communication: Communication = "gather",
) -> Tensor:
    """SupCon (``L_out``, all views as anchors) over the global batch; exact under data parallelism.

    Every embedding of the global batch (``N`` samples × ``V`` views) is an anchor ``a``. Its
    positives ``P(a)`` are the other embeddings with the same label (other views of the same
    sample included), its candidates every embedding but itself::

        ℓ_a = logsumexp_{j ≠ a}(f_a·f_j / τ) − (1/|P(a)|) Σ_{p ∈ P(a)} f_a·f_p / τ

    **Normalisation.** Anchors without positives (a label seen once, single view) contribute
    nothing; the loss is the mean of ``ℓ_a`` over the ``A`` anchors of the global batch that
    have positives, and 0 (still in the graph) when ``A = 0`` — never NaN. ``A`` comes from the
    gathered labels, so each rank returns ``(W / A) · Σ_{its anchors with positives} ℓ_a`` and
    the mean over ranks is the single-process loss, for any per-rank batch sizes (including 0).

    **Conventions that differ from the paper's reference code** (``SupConLoss`` of
    HobbitLong/SupContrast): there, anchors without positives count as 0 in a mean over *all*
    ``N·V`` anchors, and the loss is multiplied by ``temperature / base_temperature``. To get its
    value: ``reference = ours · (A / (N·V)) · (temperature / base_temperature)``.

    Features are used as given: L2-normalise them in the model, as in the paper. Labels are
    gathered with the features (no gradient). The positives' mean logit is taken from each
    block's logits under a same-label mask (``chunk × N·V``, beside the logits), so it stays exact
    for large un-normalised features, and each ``ℓ_a`` is ≥ 0.

    **Weights and reduction.** ``weight`` holds one weight per sample, shared by its views: the
    loss is ``Σ_a w_a ℓ_a / Σ_a w_a`` over the global anchors with positives (this rank returns
    ``W ·`` its weighted sum ``/ Σ_global``). ``reduction="none"`` returns this rank's ``ℓ_a``
    (0 for an anchor without positives): the caller owns the normalisation.

    Args:
        features: this rank's embeddings, one view ``(n_r, D)`` or several ``(n_r, V, D)``.
        labels: integer class of each sample (shared by its views).
        logit_scale: multiplies the similarities, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``); receives gradients. Default ``1 / temperature``.
        temperature: divides the similarities when ``logit_scale`` is ``None``; > 0.
        chunk_size: anchors per block (the logits and two masks of ``chunk_size × N·V`` at once); same result.
        group: the process group (default: the world).
        sizes: every rank's batch size ``n_r``, if known (skips the size exchange).
        weight: one weight ≥ 0 per local sample (no gradient); see above.
        reduction: ``"mean"`` (this rank's share of the global mean) or ``"none"`` (per-anchor losses).
        communication: ``"gather"`` gathers every rank's embeddings and labels onto every rank
            (memory ``O(N·V·D + chunk·N·V)``); ``"ring"`` passes blocks of them round the ring
            instead (memory ``O(n_r·V·D + chunk·max_r n_r·V)``, independent of the number of ranks;
            the anchor count, or with ``weight`` the anchors' weight total, takes one scalar
            all-reduce); same result, with ``weight`` and ``reduction="none"`` too.

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss; ``"none"``: this rank's
        per-anchor losses. Float32 (float64 for float64
        features): the core runs in float32 with autocast off; gradients come back in the
        features' dtype.

    Shape:
        features: ``(n_r, D)`` or ``(n_r, V, D)``; labels, weight: ``(n_r,)``; logit_scale: ``()``;
        output: ``()``, or with ``reduction="none"`` ``(n_r,)`` / ``(n_r, V)`` like ``features[..., 0]``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import supcon
        >>> features = F.normalize(torch.randn(6, 2, 8), dim=-1).requires_grad_()
        >>> labels = torch.tensor([0, 1, 0, 2, 1, 3])
        >>> supcon(features, labels, temperature=0.1).backward()
        >>> features.grad.shape
        torch.Size([6, 2, 8])
        >>> supcon(features, labels, reduction="none").shape
        torch.Size([6, 2])

    """
    with validated_on_all_ranks((features, labels), group=group, sizes=ring_checks(communication, sizes)):
        features = check_features("features", features, ndims=(2, 3))
        _check_labels(labels, features.shape[0])
        scale = resolve_scale(logit_scale, check_temperature(temperature), features)
        chunk_size = check_chunk_size(chunk_size)
        reduction = check_reduction(reduction, weight)
        weights = check_weight(weight, features.shape[0], features)
        communication = check_communication(communication)
    if communication == "ring":
        return ring_supcon(
            features,
            labels,
            scale,
            chunk_size=chunk_size,
            group=group,
            sizes=sizes,
            weights=weights,
            reduction=reduction,
        )
    own = (features, labels) + (() if weights is None else (weights,))
    gathered = all_gather_many(own, group=group, sizes=sizes)
    all_features, all_labels = gathered.tensors[:2]
    views = 1 if features.ndim == 2 else features.shape[1]
    # One row per embedding, sample-major: the embedding (sample s, view v) is row s·V + v.
    _, key_class = torch.unique(all_labels.repeat_interleave(views), return_inverse=True)
    has_positives = torch.bincount(key_class)[key_class] > 1
    first_local_key = gathered.offset * views
    local_count = features.shape[0] * views
    # Every local embedding is a query; one without positives gets weight 0 instead of being
    # selected out, so no shape depends on the labels (torch.compile needs none). With a single
    # embedding in the whole batch no row has any candidate: then no row is a query at all.
    query_count = local_count if key_class.shape[0] > 1 else 0
    anchor_keys = torch.arange(query_count, device=features.device) + first_local_key
    is_anchor = has_positives[anchor_keys]
    with full_precision(features.device):
        keys = upcast(rearrange(all_features, "n ... d -> (n ...) d"))
        queries = upcast(rearrange(features, "n ... d -> (n ...) d"))[:query_count]
        # Class indices as floats for the kernel's masks, exact in the core's dtype (2**24 classes in float32).
        class_index = key_class.to(keys.dtype if key_class.numel() < 2**24 else torch.float64)
        targets = Targets(query_labels=class_index[anchor_keys], key_labels=class_index, excluded=anchor_keys)
        if reduction == "none":
            rows = cross_entropy(queries, keys, scale, targets, chunk_size=chunk_size, reduction="none")
            every_row = rows.new_zeros(local_count)
            every_row[:query_count] = torch.where(is_anchor, rows, 0.0)
            return every_row.view(features.shape[:-1])
        row_weights = is_anchor.to(keys.dtype)
        if weights is not None:
            row_weights = row_weights * weights.repeat_interleave(views)[:query_count]
        loss_sum = cross_entropy(queries, keys, scale, targets, chunk_size=chunk_size, row_weights=row_weights)
        if weights is None:
            denominator = has_positives.sum().to(loss_sum.dtype)
        else:
            denominator = (gathered.tensors[2].repeat_interleave(views) * has_positives).sum()
        # W / A as a tensor (no host sync), in the core's dtype (A is exact there, unlike in
        # bf16 above 256); A = 0 (or all weights 0) means the sum is 0 too.
        positive = denominator > 0
        return loss_sum * torch.where(positive, get_world_size(group) / torch.where(positive, denominator, 1.0), 0.0)


def _check_labels(labels: object, batch_size: int) -> None:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.shape[0] != batch_size:
        raise ValueError(f"labels must have shape ({batch_size},) to match features, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")


class SupConLoss(TemperatureLoss):
    """Supervised contrastive loss over the global batch; holds the options of :func:`supcon`.

    Args:
        temperature: divides the similarities when ``forward`` gets no ``logit_scale``; > 0.
        chunk_size: anchors per block (bounded memory, same result); ``None``: all at once.
        group: the process group (default: the world).
        reduction: ``"mean"`` or ``"none"`` (per-anchor losses; the caller normalises).
        communication: ``"gather"`` or ``"ring"`` (per-rank memory independent of the number of
            ranks; takes ``weight`` and ``reduction`` too); see :func:`supcon`.

    Shape:
        features: ``(n_r, D)`` or ``(n_r, V, D)``; labels, weight: ``(n_r,)``; logit_scale: ``()``;
        output: ``()``, or ``(n_r,)`` / ``(n_r, V)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import SupConLoss
        >>> criterion = SupConLoss(temperature=0.1)
        >>> features = F.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
        >>> criterion(features, torch.tensor([0, 0, 1, 1])).backward()

    """

    def __init__(
        self,
        *,
        temperature: float = 0.1,
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

    def forward(
        self,
        features: Tensor,
        labels: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
        weight: Tensor | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss (or its per-anchor losses); see :func:`supcon`."""
        return supcon(
            features,
            labels,
            logit_scale,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            group=self.group,
            sizes=sizes,
            weight=weight,
            reduction=self.reduction,
            communication=self.communication,
        )
