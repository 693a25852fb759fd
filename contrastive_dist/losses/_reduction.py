"""The contract's reduction: this rank's share of the global (weighted) mean of the per-row losses.

With weights ``w_i`` (one per local row, ``w = 1`` without) a loss is ``Σ_i w_i ℓ_i / Σ_global w_i``
over the global batch; each rank returns ``W · Σ_local w_i ℓ_i / Σ_global w_i``, so the mean over
ranks — what DDP's gradient averaging differentiates — is the global mean, for any per-rank batch
sizes, 0 included. The global weight total comes from the agreement exchange (no collective of
its own); a denominator the inputs cannot tell up front (SupCon's anchors with positives) takes
one scalar all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._agreement import Layout
from contrastive_dist.engine._wire import all_reduce
from contrastive_dist.losses import _epilogue, _gram
from contrastive_dist.losses._columns import OneBlock
from contrastive_dist.losses._fused import weighted_pair_sum
from contrastive_dist.losses._gram import gram_pair_sum
from contrastive_dist.losses._gram_ring import gram_ring_pair_sum, gram_ring_rows
from contrastive_dist.losses._kernel import SIGMOID, Pairs
from contrastive_dist.losses._recomputed import pair_losses
from contrastive_dist.losses._sigmoid_ring import sigmoid_ring_pair_sum

__all__ = ["Direction", "all_reduced", "mean_over_directions", "mean_share", "weight_total"]


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
    all_reduce(summed, layout.group, operation="loss reduction (all-reduce)")
    return summed


class Direction(NamedTuple):
    """One kernel call of a loss: its rows (queries) against their columns (keys)."""

    queries: Tensor
    keys: Tensor
    scale: Tensor
    bias: Tensor | None
    pairs: Pairs


def takes_gram(direction: Direction) -> bool:
    """Whether a Gram loss takes its pairs of tiles (half the logits): :mod:`._gram`, or :mod:`._gram_ring`.

    Where it measured faster (:func:`._gram.worth_it`); not where the fused Triton epilogue serves (its
    rows-against-columns kernel), not under ``torch.compile``, not with columns held here. Gather mode's
    tiles serve the weighted sum; ring mode's serve per-row losses too, and need the rows to be the
    columns themselves (this rank's own block).
    """
    pairs = direction.pairs
    if pairs.gram is None or pairs.local_keys is not None or direction.bias is not None:
        return False
    ring = not isinstance(pairs.transport, OneBlock)
    if ring and direction.queries is not direction.keys:
        return False
    worth_it = _gram.worth_it(direction.queries, direction.keys, len(pairs.key_rows), ring=ring)
    if torch.compiler.is_compiling() or not worth_it:
        return False
    return not _epilogue.fused(pairs, direction.queries, direction.keys)


def mean_over_directions(
    directions: Sequence[Direction], *, weights: Tensor | None, per_row: bool
) -> tuple[Tensor, Tensor]:
    """A loss whose row loss is the mean of its directions': ``Σ_i w_i ℓ_i`` (or the ``ℓ_i`` with ``per_row``).

    The two directions of a symmetric loss (image→text, text→image) are one kernel call whose
    columns have losses of their own (:attr:`Pairs.columns`), in either mode. Gather mode's weighted
    sum forms its gradients in forward (:func:`weighted_pair_sum`, or :func:`gram_pair_sum` for a
    Gram loss), and so does ring mode's for a Gram loss (:func:`gram_ring_pair_sum`; its rows:
    :func:`gram_ring_rows`) and for a sigmoid loss (:func:`sigmoid_ring_pair_sum`); every other case forms
    them in backward (:func:`pair_losses`).

    Returns:
        The weighted sum ``()`` or the rows ``(n,)``, and whether each row has a loss ``(n,)`` (first direction).
    """
    parts: list[Tensor] = []
    has_positive: Tensor | None = None
    count = 0  # directions: a call whose columns have losses of their own counts twice
    for direction in directions:
        symmetric = direction.pairs.columns is not None
        ring = not isinstance(direction.pairs.transport, OneBlock)
        if not per_row and not ring:
            if takes_gram(direction):
                total, has = gram_pair_sum(direction.queries, direction.keys, direction.scale, direction.pairs, weights)
            else:
                total, has = weighted_pair_sum(*direction, weights)  # both directions' sum, when symmetric
            parts.append(total)
        elif ring and takes_gram(direction):
            queries, keys, scale, _, pairs = direction
            total, has = gram_ring_rows(queries, keys, scale, pairs) if per_row else gram_ring_pair_sum(
                queries, keys, scale, pairs, weights)  # fmt: skip
            parts.append(total)
        elif not per_row and direction.pairs.family is SIGMOID and not torch.compiler.is_compiling():
            total, has = sigmoid_ring_pair_sum(*direction, weights)  # its gradient needs no row state
            parts.append(total)
        else:
            rows, columns, has = pair_losses(*direction)
            parts += [rows, columns] if symmetric else [rows]
        count += 2 if symmetric else 1
        has_positive = has if has_positive is None else has_positive
    value = parts[0] if len(parts) == 1 else sum(parts[1:], parts[0])
    value = value if count == 1 else value * (1.0 / count)
    if not per_row and value.ndim:
        value = value.sum() if weights is None else value @ weights
    assert has_positive is not None
    return value, has_positive
