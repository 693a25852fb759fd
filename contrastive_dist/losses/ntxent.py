"""SimCLR's NT-Xent loss over the global batch of every rank (Chen et al., 2020)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
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
from contrastive_dist.losses._chunked import Targets, cross_entropy, full_precision, upcast
from contrastive_dist.losses._module import TemperatureLoss
from contrastive_dist.losses._reduction import Reduction, check_reduction, check_weight, mean_factor
from contrastive_dist.losses._ring_losses import Communication, check_communication, ring_checks, ring_nt_xent

__all__ = ["NTXentLoss", "nt_xent"]


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
) -> Tensor:
    """NT-Xent of this rank's views against both views of the whole global batch.

    The global batch holds ``2N`` embeddings (``N`` samples, two views each, L2-normalised
    here). Each embedding is an anchor whose positive is the other view of its sample and
    whose negatives are the other ``2N − 2`` embeddings (its own similarity is masked out).
    The global loss is the mean over all ``2N`` anchors of the cross-entropy of cosine
    similarity / ``temperature``.

    Each rank uses its ``2 n_r`` local anchors against the gathered ``2N`` columns and returns
    ``(W / 2N) · Σ_local ℓ``: the mean over ranks is the single-process loss, and DDP's gradient
    averaging gives its exact gradient, for any per-rank batch sizes (including 0).

    **Weights and reduction.** A sample's loss ``ℓ_i`` is the mean of its two anchors' losses
    (so the loss is the mean of the ``ℓ_i``). With ``weight`` the loss is ``Σ_i w_i ℓ_i /
    Σ_global w_i`` (this rank returns ``W · Σ_local w_i ℓ_i / Σ_global w``, still exact under DDP).
    ``reduction="none"`` returns this rank's ``ℓ_i`` as they are: the caller owns the
    normalisation (``rows.sum() * W / N`` gives back the mean's share).

    Args:
        z1: first view's embeddings of this rank's samples.
        z2: second view's embeddings, row ``i`` the same sample as ``z1[i]``.
        logit_scale: multiplies the cosine similarities, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``); receives gradients. Default ``1 / temperature``.
        temperature: divides the cosine similarities when ``logit_scale`` is ``None``; > 0.
        chunk_size: anchors per block (at most ``chunk_size × 2N`` logits at once); same result.
        group: the process group (default: the world).
        sizes: every rank's batch size, if known (skips the size exchange).
        weight: one weight ≥ 0 per local sample (no gradient); see above.
        reduction: ``"mean"`` (this rank's share of the global mean) or ``"none"`` (per-sample losses).
        communication: ``"gather"`` gathers both views of every rank onto every rank (memory
            ``O(N·D + chunk·N)``); ``"ring"`` passes blocks of both views round the ring instead
            (memory ``O(n_r·D + chunk·max_r n_r)``, independent of the number of ranks); same result,
            with ``weight`` (one more scalar all-reduce) and ``reduction="none"`` too.

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss (0 for an empty global batch or
        all-zero weights); ``"none"``: this rank's per-sample losses.
        Float32 (float64 for float64 inputs): the core runs in float32 with autocast off;
        gradients come back in the inputs' dtypes.

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
    with validated_on_all_ranks((z1, z2), group=group, sizes=ring_checks(communication, sizes)):
        z1, z2 = check_pair("z1", z1, "z2", z2)
        scale = resolve_scale(logit_scale, check_temperature(temperature), z1)
        chunk_size = check_chunk_size(chunk_size)
        reduction = check_reduction(reduction, weight)
        weights = check_weight(weight, z1.shape[0], z1)
        communication = check_communication(communication)
    if communication == "ring":
        return ring_nt_xent(
            z1, z2, scale, chunk_size=chunk_size, group=group, sizes=sizes, weights=weights, reduction=reduction
        )
    gathered = all_gather_many((z1, z2) + (() if weights is None else (weights,)), group=group, sizes=sizes)
    total = sum(gathered.sizes)
    with full_precision(z1.device):
        # Normalised after the gather, in the core's dtype: rows are normalised one by one, so
        # this is the same loss, and bf16/fp16 inputs lose nothing to a rounded unit vector.
        # Columns: every rank's first views, then every rank's second views (the single-process
        # order cat(z1, z2) when W = 1). Local anchor i of view 1 is column offset + i.
        keys = F.normalize(upcast(torch.cat(gathered.tensors[:2])), dim=-1)
        u1, u2 = F.normalize(upcast(z1), dim=-1), F.normalize(upcast(z2), dim=-1)
        own_columns = torch.arange(gathered.offset, gathered.offset + z1.shape[0], device=z1.device)
        anchors = Targets(
            columns=torch.cat((own_columns + total, own_columns)),
            excluded=torch.cat((own_columns, own_columns + total)),
        )
        queries = torch.cat((u1, u2))
        if reduction == "none":
            rows = cross_entropy(queries, keys, scale, anchors, chunk_size=chunk_size, reduction="none")
            return rows.view(2, z1.shape[0]).mean(dim=0)
        row_weights = None if weights is None else weights.repeat(2)
        loss_sum = cross_entropy(queries, keys, scale, anchors, chunk_size=chunk_size, row_weights=row_weights)
    # Two anchors per sample: the weighted mean over anchors is half the sum over samples' pairs.
    factor = mean_factor(get_world_size(group), total, None if weights is None else gathered.tensors[2])
    return loss_sum * 0.5 * factor


class NTXentLoss(TemperatureLoss):
    """SimCLR's NT-Xent loss over the global batch; holds the options of :func:`nt_xent`.

    Args:
        temperature: divides the cosine similarities when ``forward`` gets no ``logit_scale``; > 0.
        chunk_size: anchors per block (bounded memory, same result); ``None``: all at once.
        group: the process group (default: the world).
        reduction: ``"mean"`` or ``"none"`` (per-sample losses; the caller normalises).
        communication: ``"gather"`` or ``"ring"`` (per-rank memory independent of the number of
            ranks; takes ``weight`` and ``reduction`` too); see :func:`nt_xent`.

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
        z1: Tensor,
        z2: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
        weight: Tensor | None = None,
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
        )
