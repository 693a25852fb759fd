"""SimCLR's NT-Xent loss over the global batch of every rank (Chen et al., 2020)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._validation import check_pair, collect
from contrastive_dist.engine._agreement import agree
from contrastive_dist.losses._columns import meet
from contrastive_dist.losses._kernel import SOFTMAX, Pairs
from contrastive_dist.losses._module import TemperatureLoss
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
    check_temperature,
    check_weight,
    resolve_scale,
)
from contrastive_dist.losses._precision import compute_dtype, full_precision, upcast
from contrastive_dist.losses._reduction import Direction, mean_over_directions, mean_share, weight_total
from contrastive_dist.losses._targets import SMALL_KEYS, comparable_keys, pair_targets, small_keys_flag

__all__ = ["NTXentLoss", "nt_xent"]


class _Arguments(NamedTuple):
    z1: Tensor
    z2: Tensor
    scale: Tensor
    chunk_size: int | None
    weights: Tensor | None
    ids: Tensor | None


def nt_xent(
    z1: Tensor,
    z2: Tensor,
    logit_scale: Tensor | float | None = None,
    *,
    temperature: float = 0.5,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    weight: Tensor | None = None,
    reduction: Reduction = "mean",
    communication: Communication = "gather",
    ids: Tensor | None = None,
    same_id: SameId = "mask",
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
        group: the process group, default the world ([group][option-group]).
        sizes: every rank's batch size, if known ([sizes][option-sizes]).
        weight: one weight ≥ 0 per local sample ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, per-sample losses ([reduction][option-reduction]).
        ids: one int64 id per local sample, or ``None`` ([ids][option-ids]).
        same_id: ``"mask"`` or ``"positive"``: what samples with the same id are ([ids][option-ids]).
        communication: ``"gather"`` or ``"ring"``; in ring mode blocks of both views travel
            ([communication][option-communication]).

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss (0 for an empty global batch or
        all-zero weights); ``"none"``: this rank's per-sample losses.
        Float32 (float64 for float64 inputs), gradients in the inputs' dtypes
        ([compute dtypes][compute-dtypes]).

    Raises:
        ValueError / TypeError: on every rank, when an input or option is invalid on any rank, or
            the ranks' inputs or options differ ([checked on every rank][option-agreement]).

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

    def arguments() -> _Arguments:
        first, second = check_pair("z1", z1, "z2", z2)
        check_reduction(reduction, weight)
        check_communication(communication)
        check_same_id(same_id)
        scale = resolve_scale(logit_scale, check_temperature(temperature), first)
        weights = check_weight(weight, first.shape[0], first)
        sample_ids = check_ids("ids", ids, first.shape[0], first)
        return _Arguments(first, second, scale, check_chunk_size(chunk_size), weights, sample_ids)

    checked, problem = collect(arguments)
    layout = agree(
        (z1, z2, *(() if ids is None else (ids,))),
        problem=problem,
        group=group,
        operation="nt_xent",
        options=agreed_options(
            chunk_size=chunk_size,
            communication=communication,
            reduction=reduction,
            weight=weight,
            temperature=temperature,
            logit_scale=logit_scale,
            ids=ids is not None,
            same_id=same_id,
        ),
        sizes=sizes,
        total=None if checked is None else weight_total(checked.weights),
        flags=0 if checked is None else small_keys_flag(checked.ids, compute_dtype(checked.z1.dtype)),
    )
    first, second, scale, chunk, weights, sample_ids = cast(_Arguments, checked)
    samples = first.shape[0]
    with full_precision(first.device):
        # Normalised in the core's dtype, so bf16/fp16 inputs lose nothing to a rounded unit vector.
        # Sample-major anchors: sample i's views are rows 2i and 2i + 1, its own block's columns too.
        views = F.normalize(upcast(torch.stack((first, second), dim=1)), dim=-1).flatten(0, 1)
        keys = None
        if sample_ids is not None:  # both views of a sample carry its id
            small = layout.every_rank_has(SMALL_KEYS)
            keys = comparable_keys(sample_ids, views.dtype, small).repeat_interleave(2)
        columns = meet(communication, layout, (views, *(() if keys is None else (keys,))), per_sample=2)
        anchors = torch.arange(2 * samples, device=first.device)
        pairs = Pairs(
            SOFTMAX,
            pair_targets(anchors ^ 1, excluded=anchors, keys=keys, same_id=same_id),  # the other view; never itself
            columns.transport,
            chunk,
            column_keys=None if keys is None else columns.tensors[1],
            key_rows=columns.rows,
        )
        direction = Direction(views, columns.tensors[0], scale, None, pairs)
        anchor_weights = None if weights is None else weights.repeat_interleave(2)
        value, _ = mean_over_directions([direction], weights=anchor_weights, per_row=reduction == "none")
    if reduction == "none":
        return value.view(samples, 2).mean(dim=1)  # a sample's loss: the mean of its two anchors'
    denominator = sum(layout.sizes) if layout.total is None else layout.total
    return mean_share(value * 0.5, layout, denominator)


class NTXentLoss(TemperatureLoss):
    """SimCLR's NT-Xent loss over the global batch; holds the options of :func:`nt_xent`.

    Args:
        temperature: divides the cosine similarities when ``forward`` gets no ``logit_scale``; > 0.
        chunk_size: anchors per block; same result ([chunk_size][option-chunk-size]).
        group: the process group, default the world ([group][option-group]).
        reduction: ``"mean"`` or ``"none"``, per-sample losses ([reduction][option-reduction]).
        communication: ``"gather"`` or ``"ring"`` ([communication][option-communication]).
        same_id: what samples with the same ``ids`` (given to ``forward``) are: ``"mask"`` or
            ``"positive"`` ([ids][option-ids]).

    Shape:
        z1, z2: ``(n_r, D)``; logit_scale: ``()``; weight: ``(n_r,)``; output: ``()``, or ``(n_r,)``
        with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import NTXentLoss
        >>> criterion = NTXentLoss(temperature=0.5)
        >>> z1, z2 = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
        >>> criterion(z1, z2).backward()

    """

    def __init__(
        self,
        *,
        temperature: float = 0.5,
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

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
        weight: Tensor | None = None,
        ids: Tensor | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss (or its per-sample losses); see :func:`nt_xent`."""
        return nt_xent(
            z1,
            z2,
            logit_scale,
            temperature=self.temperature,
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
        return f"{super().extra_repr()}, same_id={self.same_id!r}"
