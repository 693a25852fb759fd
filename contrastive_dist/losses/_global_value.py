"""The value a loss returns: the global loss on every rank, with this rank's share as its gradient.

The gradient contract makes each rank differentiate its share ``W · Σ_local w_i ℓ_i / Σ_global w_i``,
whose mean over the ranks is the global loss ``L``: DDP's average of the ranks' gradients is then
∇L. But a trainer logs what rank 0 returns, and a share is not ``L`` (rows 7 + 1 give shares 4.15
and 0.91 of a loss of 2.53; the last, short batch of an epoch logs near 0). So each rank returns

    ``(share − share.detach()) + L``

whose value is ``L`` on every rank, bit for bit (``share − share`` is exactly 0), and whose
gradient is the share's. ``L`` costs one scalar all-reduce of the detached local sums, which also
carries a denominator only the ranks' sums reveal (SupCon's anchors with positives): that loss
exchanged it already, so for it the value comes free. Under ``torch.compile`` the all-reduce is
the traceable functional collective. With one rank (or a group of one) the share is ``L`` itself.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from contrastive_dist.engine._agreement import Layout
from contrastive_dist.losses._reduction import all_reduced, mean_share

__all__ = ["global_mean"]


def global_mean(total: Tensor, layout: Layout, denominator: Tensor | int | None = None, *,
                local_denominator: Tensor | None = None) -> Tensor:
    """The global mean ``Σ_ranks total / denominator`` as value, this rank's share of it as gradient.

    Args:
        total: ``()`` this rank's ``Σ_i w_i ℓ_i``, in the graph.
        layout: the agreed layout (world size, group).
        denominator: the global row count or weight total, when every rank knows it.
        local_denominator: ``()`` this rank's part of a denominator only the ranks' sum gives
            (detached), summed in the same exchange as the value; instead of ``denominator``.

    Shape:
        total, local_denominator: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> from contrastive_dist.engine._agreement import Layout
        >>> one_rank = Layout(0, 1, (4,), (0,), None, None)
        >>> total = torch.tensor(6.0, requires_grad=True)
        >>> loss = global_mean(total, one_rank, 4)
        >>> loss.backward()
        >>> loss.item(), total.grad.item()
        (1.5, 0.25)
    """
    if local_denominator is None and denominator is None:
        raise ValueError("global_mean needs a denominator or a local_denominator")
    if layout.world_size == 1:
        return mean_share(total, layout, cast(Tensor, local_denominator) if denominator is None else denominator)
    sums = [total.detach()] + ([] if local_denominator is None else [local_denominator.detach().to(total.dtype)])
    summed = all_reduced(torch.stack(sums), layout)
    denominator = summed[1] if local_denominator is not None else cast(Tensor | int, denominator)
    share = mean_share(total, layout, denominator)
    # Σ_ranks total / denominator, with the zero-denominator rule of mean_share (a 1-rank layout: factor 1).
    value = mean_share(summed[0], layout._replace(world_size=1), denominator)
    return (share - share.detach()) + value
