"""Hard-negative-weighted, debiased contrastive loss over the global batch (Robinson et al., 2021)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_pair
from contrastive_dist.losses._families import DECOUPLED
from contrastive_dist.losses._frame import Call, Common, begin
from contrastive_dist.losses._module import HeldOptions
from contrastive_dist.losses._options import Communication, Reduction, full_precision
from contrastive_dist.losses.dcl import decoupled_views

__all__ = ["HCLLoss", "hcl"]


def hcl(
    z1: Tensor, z2: Tensor, logit_scale: Tensor | float | None = None, *, temperature: float = 0.5, beta: float = 1.0,
    tau_plus: float = 0.1, chunk_size: int | None = None, group: GroupLike = None,
    sizes: Sequence[int] | None = None, weight: Tensor | None = None, reduction: Reduction = "mean",
    communication: Communication = "gather", ids: Tensor | None = None,
) -> Tensor:
    """HCL: NT-Xent's anchors, their negatives reweighted by hardness and debiased; exact under data parallelism.

    Every embedding ``a`` of the ``2N`` of the global batch (two views of ``N`` samples, L2-normalised
    here) is an anchor, with logits ``l = s · cos`` (``s``: ``logit_scale``, ``1 / temperature`` by
    default), its positive ``p = l_{a,a'}`` (the other view of its sample) and its ``M`` negatives
    ``j`` (every other embedding; with ``ids``, none that shares ``a``'s id)::

        ℓ_a = −log( e^p / (e^p + Ng_a) ),   Ng_a = max( (M · Σ_j e^{(1+β) l_aj} / Σ_j e^{β l_aj} − τ⁺ M e^p) / (1 − τ⁺),
                                                          M e^{−s} )

    — the paper's hard negatives ``q ∝ e^{β l}`` (``beta``) and its debiasing prior ``τ⁺`` (``tau_plus``),
    clamped at its floor ``M e^{−1/t}``. ``beta=0, tau_plus=0`` is NT-Xent. A sample's loss is the mean of
    its two anchors' (``weight``, ``reduction="none"``: per sample); an anchor without negatives has none.
    Contract, options and returns as for :func:`nt_xent`: the mean over the ranks of the returned values
    is the single-process loss, for any per-rank batch sizes ([gradient contract][gradient-contract]).

    Computed from the frame's per-row primitive, the log-sum-exp over each anchor's negatives, at the
    scales ``(1 + β) s`` and ``β s`` (:meth:`~contrastive_dist.losses._frame.Call.rows`), in log space:
    no ``e^{l}`` is formed, so large scales do not overflow.

    Args:
        z1: the first views' embeddings, row ``i`` from sample ``i`` (normalised here).
        z2: the second views', row ``i`` from sample ``i`` too.
        logit_scale: the similarity multiplier (default ``1 / temperature``); receives gradients.
        temperature: used when ``logit_scale`` is ``None``; > 0.
        beta: the hardness ``β ≥ 0`` of the negatives' reweighting (0: uniform).
        tau_plus: the prior ``τ⁺ ∈ [0, 1)`` that a negative is a positive (0: no debiasing).
        chunk_size: anchors a logit block ([chunk_size][option-chunk-size]).
        group: see [group][option-group].
        sizes: see [sizes][option-sizes].
        weight: one per sample, for both of its anchors ([weight][option-weight]).
        reduction: ``"mean"`` or ``"none"``, each sample's loss: its two anchors' mean.
        communication: see [communication][option-communication].
        ids: ``(n_r,)`` int64: samples with equal ids are not each other's negatives ([ids][option-ids]).

    Shape:
        z1, z2: ``(n_r, D)``; weight, ids: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import hcl, nt_xent
        >>> z1, z2 = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 16, dtype=torch.float64)
        >>> hcl(z1, z2).shape, hcl(z1, z2, reduction="none").shape
        (torch.Size([]), torch.Size([6]))
        >>> torch.allclose(hcl(z1, z2, beta=0.0, tau_plus=0.0), nt_xent(z1, z2), rtol=1e-14, atol=0)
        True
    """

    def own() -> tuple[Tensor, Tensor]:
        first, second = check_pair("z1", z1, "z2", z2)
        _check_number("beta", beta, upper=math.inf)
        _check_number("tau_plus", tau_plus, upper=1.0)
        return first, second

    call = begin(own, Common(operation="hcl", logit_scale=logit_scale, temperature=temperature, chunk_size=chunk_size,
                             group=group, sizes=sizes, weight=weight, reduction=reduction,
                             communication=communication, ids=ids),
                 inputs=(z1, z2), options={"beta": beta, "tau_plus": tau_plus})  # fmt: skip
    with full_precision(z1.device):
        views, weights, columns, targets, tiles = decoupled_views(call, *call.own)
        hard = call.rows(DECOUPLED, views, columns, targets, scale=(1 + beta) * call.scale, tiles=tiles)[0]
        count = negatives_per_anchor(call, views)  # M
        # Σ_j e^{β l_aj}: M at β = 0 (every term 1), for no second pass.
        base = count.clamp(min=1).log() if beta == 0 else call.rows(DECOUPLED, views, columns, targets,
                                                                      scale=beta * call.scale, tiles=tiles)[0]
        positive = call.scale * (views[0::2] * views[1::2]).sum(dim=1).repeat_interleave(2)
        rows = debiased_rows(hard - base, positive, count, call.scale, tau_plus)
        if call.per_row:
            return rows.view(-1, 2).mean(dim=1)
        return call.share(0.5 * (rows.sum() if weights is None else rows @ weights))


def debiased_rows(hardness: Tensor, positive: Tensor, count: Tensor, scale: Tensor, tau_plus: float) -> Tensor:
    """Each anchor's ``ℓ = log(1 + Ng e^{−p})`` from ``hardness = log Σ e^{(1+β) l} − log Σ e^{β l}``, in log space.

    ``Ng e^{−p} = max((M e^{hardness − p} − τ⁺ M) / (1 − τ⁺), M e^{−s−p})``: the debiased term is formed as
    ``u + log1p(−τ⁺ M e^{−u}) − log(1 − τ⁺)`` with ``u = log M + hardness − p``, below the floor wherever
    ``τ⁺ M ≥ e^u``. An anchor without negatives (``M = 0``) has ``ℓ = 0``.

    Shape:
        hardness, positive, count: ``(a,)``; scale: ``()``; output: ``(a,)``.

    Example:
        >>> import torch
        >>> rows = debiased_rows(torch.tensor([0.5, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([4.0, 0.0]),
        ...                      torch.tensor(2.0), 0.0)
        >>> [round(value, 4) for value in rows.tolist()]  # log(1 + 4 e^{0.5 − 1}), and none without negatives
        [1.2314, 0.0]
    """
    log_count = count.clamp(min=1).log()
    reweighted = log_count + hardness - positive  # u
    if tau_plus > 0:
        excess = math.log(tau_plus) + log_count - reweighted  # log(τ⁺ M e^{−u}) < 0 where the term stays
        kept = excess < 0
        debiased = reweighted + torch.log1p(-torch.exp(torch.where(kept, excess, -1.0))) - math.log1p(-tau_plus)
        reweighted = torch.where(kept, debiased, -math.inf)
    floor = log_count - scale - positive
    return torch.where(count > 0, F.softplus(torch.maximum(reweighted, floor)), 0.0)


def negatives_per_anchor(call: Call[tuple[Tensor, Tensor]], views: Tensor) -> Tensor:
    """``M_a`` of each of this rank's anchors: the views of the global batch but its sample's.

    With ids, but those of every sample that shares its id. Shape: ``(2 n_r,)``, in the views' dtype.
    """
    samples = sum(call.layout.sizes)
    if call.ids is None:
        return views.new_full((views.shape[0],), 2.0 * samples - 2.0)
    every, counts = torch.unique(call.gathered(call.ids), return_counts=True)  # ids are small: every rank's
    sharing = counts[torch.searchsorted(every, call.ids)]
    return (2.0 * (samples - sharing)).to(views.dtype).repeat_interleave(2)


def _check_number(name: str, value: object, *, upper: float) -> None:
    """``value`` a real number in ``[0, upper)`` (``upper`` infinite: any finite number ≥ 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < upper:
        bound = "finite and >= 0" if math.isinf(upper) else f"in [0, {upper:g})"
        raise ValueError(f"{name} must be a real number {bound}, got {value!r}")


class HCLLoss(HeldOptions):
    """HCL over the global batch; holds the options of :func:`hcl`.

    Example:
        >>> import torch
        >>> from contrastive_dist import HCLLoss
        >>> criterion = HCLLoss(beta=0.5, tau_plus=0.1, chunk_size=4)
        >>> z1 = torch.randn(6, 8, requires_grad=True)
        >>> criterion(z1, torch.randn(6, 8)).backward()
    """

    def __init__(self, *, temperature: float = 0.5, beta: float = 1.0, tau_plus: float = 0.1,
                 chunk_size: int | None = None, group: GroupLike = None, reduction: Reduction = "mean",
                 communication: Communication = "gather") -> None:  # fmt: skip
        _check_number("beta", beta, upper=math.inf)
        _check_number("tau_plus", tau_plus, upper=1.0)
        super().__init__(temperature=temperature, beta=beta, tau_plus=tau_plus, chunk_size=chunk_size, group=group,
                         reduction=reduction, communication=communication)

    def forward(self, z1: Tensor, z2: Tensor, logit_scale: Tensor | float | None = None, *,
                sizes: Sequence[int] | None = None, weight: Tensor | None = None, ids: Tensor | None = None) -> Tensor:
        """Return this rank's share of the loss (or its per-sample losses); see :func:`hcl`."""
        return hcl(z1, z2, logit_scale, sizes=sizes, weight=weight, ids=ids, **self.options())
