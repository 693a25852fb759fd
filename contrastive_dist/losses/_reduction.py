"""The contract's reduction: this rank's share of the global (weighted) mean of the per-row losses.

With weights ``w_i`` (one per local row, ``w = 1`` without) a loss is ``Σ_i w_i ℓ_i / Σ_global w_i``
over the global batch; each rank returns ``W · Σ_local w_i ℓ_i / Σ_global w_i``, so the mean over
ranks — what DDP's gradient averaging differentiates — is the global mean, for any per-rank batch
sizes, 0 included. The global weight total comes from the agreement exchange (no collective of
its own); a denominator the inputs cannot tell up front (SupCon's anchors with positives) takes
one scalar all-reduce.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._agreement import Layout

__all__ = ["all_reduced", "mean_share", "weight_total"]


def weight_total(weights: Tensor | None) -> Tensor | None:
    """The local weight total, for the agreement exchange (float64: exact enough for any batch)."""
    return None if weights is None else weights.sum(dtype=torch.float64)


def mean_share(total: Tensor, layout: Layout, denominator: Tensor | int) -> Tensor:
    """``W · total / denominator``: this rank's share of the global mean; 0 when the denominator is 0.

    ``denominator`` is global: the global row count (an int: no collective), or a 0-d tensor such as
    the agreed weight total. A zero denominator means every term is 0 too (an empty global batch, all
    weights 0): the result is then a zero still connected to the graph, so every rank still runs the
    backward collectives.

    Example:
        >>> import torch
        >>> from contrastive_dist.engine._agreement import Layout
        >>> layout = Layout(0, 2, (3, 1), (0, 0), None, None)
        >>> mean_share(torch.tensor(6.0), layout, 4)
        tensor(3.)
        >>> mean_share(torch.tensor(0.0), layout, 0)
        tensor(0.)
    """
    if isinstance(denominator, int):
        return total * (layout.world_size / denominator if denominator > 0 else 0.0)
    denominator = denominator.to(total.dtype)
    positive = denominator > 0
    return total * torch.where(positive, layout.world_size / torch.where(positive, denominator, 1.0), 0.0)


def all_reduced(value: Tensor, layout: Layout) -> Tensor:
    """``value`` summed over the ranks (one scalar all-reduce; traceable under ``torch.compile``)."""
    if layout.world_size == 1:
        return value
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(value, "sum", cast(ProcessGroup, layout.group or dist.group.WORLD))
    summed = value.clone()
    dist.all_reduce(summed, group=layout.group)
    return summed
