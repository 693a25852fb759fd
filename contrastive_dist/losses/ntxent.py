"""SimCLR's NT-Xent loss over the global batch of every rank (Chen et al., 2020)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_pair
from contrastive_dist.losses._families import SOFTMAX
from contrastive_dist.losses._frame import Call, Common, begin
from contrastive_dist.losses._module import HeldOptions
from contrastive_dist.losses._options import Communication, Reduction, SameId, full_precision, half_products, upcast
from contrastive_dist.losses._targets import pair_targets
from contrastive_dist.losses._unit import unit_rows

__all__ = ["NTXentLoss", "nt_xent"]


def nt_xent(
    z1: Tensor, z2: Tensor, logit_scale: Tensor | float | None = None, *, temperature: float = 0.5,
    chunk_size: int | None = None, group: GroupLike = None, sizes: Sequence[int] | None = None,
    weight: Tensor | None = None, reduction: Reduction = "mean", communication: Communication = "gather",
    ids: Tensor | None = None, same_id: SameId = "mask",
) -> Tensor:
    """NT-Xent of this rank's views against both views of the whole global batch.

    The global batch holds ``2N`` embeddings (``N`` samples, two views each, L2-normalised
    here). Each embedding is an anchor whose positive is the other view of its sample and
    whose negatives are the other ``2N − 2`` embeddings (its own similarity is masked out).
    The global loss is the mean over all ``2N`` anchors of the cross-entropy of cosine
    similarity / ``temperature``.

    Each rank uses its ``2 n_r`` local anchors against the gathered ``2N`` columns and returns
    ``(W / 2N) · Σ_local ℓ``: the mean over ranks is the single-process loss, and DDP's gradient
    averaging gives its exact gradient, for any per-rank batch sizes (including 0): the
    [gradient contract][gradient-contract].

    **Sample ids** ([ids][option-ids]), carried by both views of a sample. With ``same_id="mask"``
    the embeddings of *other* samples with an anchor's id are left out of its candidates (its own
    other view stays its positive); with ``same_id="positive"`` every embedding with the anchor's id
    but itself is a positive: ``ℓ_a = logsumexp_{j ≠ a} l_aj − (1/|P_a|) Σ_{p ∈ P_a} l_ap`` with
    ``P_a = {j ≠ a : id_j = id_a}``.

    **A row** of ``weight`` and ``reduction="none"`` ([weight][option-weight],
    [reduction][option-reduction]) is a sample: its loss ``ℓ_i`` is the mean of its two anchors'
    losses (so the loss is the mean of the ``ℓ_i``).

    Args:
        z1: first view's embeddings of this rank's samples.
        z2: second view's embeddings, row ``i`` the same sample as ``z1[i]``.
        logit_scale: multiplies the cosine similarities, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``); receives gradients. Default ``1 / temperature``.
        temperature: divides the cosine similarities when ``logit_scale`` is ``None``; > 0.
        chunk_size: anchors per block, at most ``chunk_size × 2N`` logits at once; same result
            ([chunk_size][option-chunk-size]).
        group: a process group or a device mesh, default the world ([group][option-group]).
        sizes: every rank's batch size, if known ([sizes][option-sizes]).
        weight: one weight ≥ 0 per local sample ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, per-sample losses ([reduction][option-reduction]).
        ids: one int64 id per local sample, or ``None`` ([ids][option-ids]).
        same_id: ``"mask"`` or ``"positive"``: what samples with the same id are ([ids][option-ids]).
        communication: ``"gather"`` or ``"ring"``; in ring mode blocks of both views travel
            ([communication][option-communication]).

    Returns:
        The global loss (per sample: the mean of its two anchors') on every rank, its gradient this
        rank's share, or with ``reduction="none"`` its samples' losses ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, if any rank's call is wrong ([agreement][option-agreement]).

    Shape:
        z1, z2: ``(n_r, D)``; logit_scale: ``()``; weight: ``(n_r,)``; output: ``()``, or ``(n_r,)``
        with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import nt_xent
        >>> z1, z2 = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16)
        >>> loss = nt_xent(z1, z2, temperature=0.5)
        >>> loss.backward()
        >>> z1.grad.shape
        torch.Size([4, 16])
        >>> nt_xent(z1, z2, weight=torch.tensor([1.0, 2.0, 0.0, 1.0])).shape
        torch.Size([])

    """

    def own() -> tuple[Tensor, Tensor]:
        return check_pair("z1", z1, "z2", z2)

    call = begin(own, Common(operation="nt_xent", logit_scale=logit_scale, temperature=temperature,
                             chunk_size=chunk_size, group=group, sizes=sizes, weight=weight, reduction=reduction,
                             communication=communication, ids=ids, same_id=same_id),
                 inputs=(z1, z2), options={})  # fmt: skip
    with full_precision(call.own[0].device):
        views, keys, anchor_weights = two_views(call, *call.own, call.keys(call.ids))
        columns = call.columns(views, keys=keys, per_sample=2)
        anchors, every = (torch.arange(count, device=views.device) for count in (views.shape[0], sum(columns.counts)))
        targets = pair_targets(anchors ^ 1, excluded=anchors, keys=keys, same_id=same_id)  # the other view; not itself
        tiles = pair_targets(every ^ 1, excluded=every, keys=columns.keys, same_id=same_id)  # every row's, in order
        if call.per_row:  # a sample's loss: the mean of its two anchors'
            return call.rows(SOFTMAX, views, columns, targets, tiles=tiles)[0].view(-1, 2).mean(dim=1)
        value, _ = call.weighted_sum(SOFTMAX, views, columns, targets, weights=anchor_weights, tiles=tiles)
        return call.share(value * 0.5)


def two_views(
    call: Call[Any], first: Tensor, second: Tensor, keys: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Two views as anchors, sample-major (sample ``i``'s views: rows ``2i``, ``2i + 1``), their keys and weights.

    Normalised in the core's dtype, then rounded back to the features' dtype where half features
    enter the products as they are (CUDA; see :mod:`._options`): the unit vectors carry the
    features' own precision, as those of a half-precision model do, and the products run on the
    tensor cores (float32 unit vectors made an H200's bf16 step 8× slower). Both views of a sample
    carry its key (one per sample, as compared) and its weight.

    Shape:
        first, second: ``(n_r, D)``; keys: ``(n_r,)``; output: ``(2 n_r, D)``, ``(2 n_r,)``, ``(2 n_r,)``.
    """
    stacked = torch.stack((first, second), dim=1)
    views = unit_rows(upcast(stacked)).flatten(0, 1)
    if half_products(stacked.dtype, stacked.device):
        views = views.to(stacked.dtype)
    keys = None if keys is None else keys.repeat_interleave(2)
    weights = None if call.weights is None else call.weights.repeat_interleave(2)
    return views, keys, weights


class NTXentLoss(HeldOptions):
    """SimCLR's NT-Xent loss over the global batch; holds the options of :func:`nt_xent`.

    The options (``temperature``, ``chunk_size``, ``group``, ``reduction``, ``communication``,
    ``same_id``) are :func:`nt_xent`'s, checked when the module is made.

    Example:
        >>> import torch
        >>> from contrastive_dist import NTXentLoss
        >>> criterion = NTXentLoss(temperature=0.5)
        >>> z1, z2 = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        >>> criterion(z1, z2).backward()

    """

    def __init__(self, *, temperature: float = 0.5, chunk_size: int | None = None, group: GroupLike = None,
                 reduction: Reduction = "mean", communication: Communication = "gather",
                 same_id: SameId = "mask") -> None:
        super().__init__(temperature=temperature, chunk_size=chunk_size, group=group, reduction=reduction,
                         communication=communication, same_id=same_id)

    def forward(self, z1: Tensor, z2: Tensor, logit_scale: Tensor | float | None = None, *,
                sizes: Sequence[int] | None = None, weight: Tensor | None = None, ids: Tensor | None = None) -> Tensor:
        """Return the global loss, its gradient this rank's share (or the per-sample losses); see :func:`nt_xent`."""
        return nt_xent(z1, z2, logit_scale, sizes=sizes, weight=weight, ids=ids, **self.options())
