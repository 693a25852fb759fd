"""Supervised contrastive loss over the global batch of every rank (Khosla et al., 2020)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from einops import rearrange
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_features
from contrastive_dist.losses._families import SOFTMAX
from contrastive_dist.losses._frame import Common, begin
from contrastive_dist.losses._module import HeldOptions
from contrastive_dist.losses._options import Communication, Reduction, full_precision, operands
from contrastive_dist.losses._targets import RowTargets

__all__ = ["SupConLoss", "supcon"]


def supcon(
    features: Tensor, labels: Tensor, logit_scale: Tensor | float | None = None, *, temperature: float = 0.1,
    chunk_size: int | None = None, group: GroupLike = None, sizes: Sequence[int] | None = None,
    weight: Tensor | None = None, reduction: Reduction = "mean", communication: Communication = "gather",
) -> Tensor:
    """SupCon (``L_out``, all views as anchors) over the global batch; exact under data parallelism.

    Every embedding of the global batch (``N`` samples × ``V`` views) is an anchor ``a``. Its
    positives ``P(a)`` are the other embeddings with the same label (other views of the same
    sample included), its candidates every embedding but itself::

        ℓ_a = logsumexp_{j ≠ a}(f_a·f_j / τ) − (1/|P(a)|) Σ_{p ∈ P(a)} f_a·f_p / τ

    **Normalisation.** Anchors without positives (a label seen once, single view) contribute
    nothing; the loss is the mean of ``ℓ_a`` over the ``A`` anchors of the global batch that
    have positives, and 0 (still in the graph) when ``A = 0`` — never NaN. Each rank counts its
    anchors with positives and one scalar all-reduce sums the counts (with the ranks' loss sums), so
    each rank differentiates ``(W / A) · Σ_{its anchors with positives} ℓ_a``, whose mean over ranks
    is the single-process loss, and returns that loss itself, for any per-rank batch sizes
    (including 0): the [gradient contract][gradient-contract].

    **Conventions that differ from the paper's reference code** (``SupConLoss`` of
    HobbitLong/SupContrast): there, anchors without positives count as 0 in a mean over *all*
    ``N·V`` anchors, and the loss is multiplied by ``temperature / base_temperature``. To get its
    value: ``reference = ours · (A / (N·V)) · (temperature / base_temperature)``.

    Features are used as given: L2-normalise them in the model, as in the paper. Labels are
    gathered with the features (no gradient). The positives' mean logit is taken from each
    block's logits under a same-label mask (``chunk × N·V``, beside the logits), so it stays exact
    for large un-normalised features, and each ``ℓ_a`` is ≥ 0.

    **Weights and reduction** ([weight][option-weight], [reduction][option-reduction]). A weight
    belongs to a sample and is shared by its views: the loss is ``Σ_a w_a ℓ_a / Σ_a w_a`` over the
    global anchors with positives, whose weight total takes the all-reduce in place of ``A``.
    ``reduction="none"`` returns this rank's ``ℓ_a``, 0 for an anchor without
    positives.

    Args:
        features: this rank's embeddings, one view ``(n_r, D)`` or several ``(n_r, V, D)``.
        labels: integer class of each sample (shared by its views).
        logit_scale: multiplies the similarities, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``); receives gradients. Default ``1 / temperature``.
        temperature: divides the similarities when ``logit_scale`` is ``None``; > 0.
        chunk_size: anchors per block, the logits and two masks of ``chunk_size × N·V`` at once;
            same result ([chunk_size][option-chunk-size]).
        group: a process group or a device mesh, default the world ([group][option-group]).
        sizes: every rank's batch size ``n_r``, if known ([sizes][option-sizes]).
        weight: one weight ≥ 0 per local sample ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, per-anchor losses ([reduction][option-reduction]).
        communication: ``"gather"`` or ``"ring"``; the labels travel with the embeddings
            ([communication][option-communication]).

    Returns:
        The mean over anchors with positives on every rank, its gradient this rank's share, or each
        anchor's loss (``reduction="none"``; 0 without positives) ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, if any rank's call is wrong ([agreement][option-agreement]).

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

    def own() -> tuple[Tensor]:
        checked = check_features("features", features, ndims=(2, 3))
        _check_labels(labels, checked.shape[0])
        return (checked,)

    call = begin(own, Common(operation="supcon", logit_scale=logit_scale, temperature=temperature,
                             chunk_size=chunk_size, group=group, sizes=sizes, weight=weight, reduction=reduction,
                             communication=communication),
                 inputs=(features, labels), options={}, keyed=(labels,), total=False)  # fmt: skip
    (checked,) = call.own
    views = 1 if checked.ndim == 2 else checked.shape[1]
    with full_precision(checked.device):
        # One row per embedding, sample-major (sample s, view v: row s·V + v), its label beside it.
        embeddings = operands(rearrange(checked, "n ... d -> (n ...) d"))
        keys = cast(Tensor, call.keys(labels)).repeat_interleave(views)
        columns = call.columns(embeddings, keys=keys, per_sample=views)
        anchors, every = (torch.arange(count, device=keys.device) for count in (keys.shape[0], sum(columns.counts)))
        targets, tiles = RowTargets(excluded=anchors, keys=keys), RowTargets(excluded=every)  # positives: by label
        if call.per_row:  # 0 for an anchor without positives
            return call.rows(SOFTMAX, embeddings, columns, targets, tiles=tiles)[0].view(checked.shape[:-1])
        anchor_weights = None if call.weights is None else call.weights.repeat_interleave(views)
        value, has_positives = call.weighted_sum(SOFTMAX, embeddings, columns, targets, weights=anchor_weights,
                                                 tiles=tiles)  # fmt: skip
    # The mean runs over the anchors with positives (weighted): a count only the blocks reveal.
    counted = has_positives.to(value.dtype)
    local_denominator = (counted if anchor_weights is None else counted * anchor_weights).sum()
    return call.share(value, local_denominator=local_denominator)


def _check_labels(labels: object, batch_size: int) -> None:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.shape[0] != batch_size:
        raise ValueError(f"labels must have shape ({batch_size},) to match features, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")


class SupConLoss(HeldOptions):
    """Supervised contrastive loss over the global batch; holds the options of :func:`supcon`.

    With :func:`supcon`'s ``temperature`` (used without a ``logit_scale``), ``chunk_size``, ``group``,
    ``reduction`` and ``communication``, each checked when the module is made.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import SupConLoss
        >>> criterion = SupConLoss(temperature=0.1)
        >>> features = F.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
        >>> criterion(features, torch.tensor([0, 0, 1, 1])).backward()

    """

    def __init__(self, *, temperature: float = 0.1, chunk_size: int | None = None, group: GroupLike = None,
                 reduction: Reduction = "mean", communication: Communication = "gather") -> None:
        super().__init__(temperature=temperature, chunk_size=chunk_size, group=group, reduction=reduction,
                         communication=communication)

    def forward(self, features: Tensor, labels: Tensor, logit_scale: Tensor | float | None = None, *,
                sizes: Sequence[int] | None = None, weight: Tensor | None = None) -> Tensor:
        """Return the global loss, its gradient this rank's share (or the per-anchor losses); see :func:`supcon`."""
        return supcon(features, labels, logit_scale, sizes=sizes, weight=weight, **self.options())
