"""Per-sample weights and ``reduction``: checks and the weighted global mean every loss shares.

With weights ``w_i`` (one per local row) a loss is ``Σ_i w_i ℓ_i / Σ_global w_i`` over the global
batch. The weights ride in the loss's own gather (packed beside the features when their dtypes
match, so no extra collective), which gives every rank the same ``Σ_global w``, summed in the
single-process order; a rank that passes weights while another does not fails the gather's
agreement with a clear error on every rank instead of hanging. Ring mode reduces the same way
(:mod:`._ring_extras`): the weights join its agreement exchange and ``Σ_global w`` takes one
scalar all-reduce.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from torch import Tensor

from contrastive_dist._validation import compute_dtype
from contrastive_dist.losses._chunked import contract_factor

__all__ = ["Reduction", "check_reduction", "check_weight", "mean_factor", "total_factor"]

Reduction = Literal["mean", "none"]


def check_reduction(reduction: object, weight: object) -> Reduction:
    """Check ``reduction`` is ``"mean"`` or ``"none"``, and that ``weight`` comes only with ``"mean"``."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if reduction == "none" and weight is not None:
        raise ValueError(
            "weight= applies to reduction='mean' only; with reduction='none' the per-row losses come back "
            "unweighted and the caller weights and normalises them"
        )
    return cast(Reduction, reduction)


def check_weight(weight: object, rows: int, like: Tensor) -> Tensor | None:
    """Return ``weight`` detached, in ``like``'s compute dtype and device, after checking it.

    Expected: a real tensor of shape ``(rows,)``, every entry finite and ≥ 0.
    """
    if weight is None:
        return None
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor of shape ({rows},), got {type(weight).__name__}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise TypeError(f"weight must be a real (float or integer) tensor, got {weight.dtype}")
    if weight.shape != (rows,):
        raise ValueError(f"weight must have one entry per local row, shape ({rows},), got {tuple(weight.shape)}")
    values = weight.detach().to(dtype=compute_dtype(like.dtype), device=like.device)
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"weight must be finite, got {_first_bad(values, ~torch.isfinite(values))}")
    if bool((values < 0).any()):
        raise ValueError(f"weight must be >= 0, got {_first_bad(values, values < 0)}")
    return values


def _first_bad(values: Tensor, bad: Tensor) -> str:
    index = int(torch.nonzero(bad)[0, 0])
    return f"weight[{index}] = {values[index].item()}"


def mean_factor(world_size: int, count: int, gathered_weights: Tensor | None) -> float | Tensor:
    """``W / N`` (unweighted) or ``W / Σ_global w``; 0 when the denominator is 0 (the loss is then 0).

    Returned as a tensor when weighted (no host sync); multiplied into this rank's (weighted) sum of
    per-row losses, it makes the mean over ranks the global (weighted) mean.
    """
    if gathered_weights is None:
        return contract_factor(count, world_size)
    return total_factor(world_size, gathered_weights.sum())


def total_factor(world_size: int, total: Tensor) -> Tensor:
    """``W / total`` as a 0-d tensor (no host sync), 0 where ``total`` is 0 (then the summed losses are 0 too)."""
    positive = total > 0
    return torch.where(positive, world_size / torch.where(positive, total, 1.0), 0.0)
