"""The columns' own direction of a symmetric loss (InfoNCE's text→image), from the rows' logit block.

Text ``j``'s loss runs over column ``j`` of the global logit matrix, the same logits as the
image rows' losses: one block serves both directions. The block's first ``columns`` columns
(those with a loss of their own) are read transposed, so that the row family's functions apply
to them unchanged: their state over this chunk of rows, merged over chunks and ranks, and, from
their final state, their logit gradient, added onto the rows' (``G = G_rows + G_columnsᵀ``)
before the block's products. Both transports use these functions: in ring mode a column state
travels with its block, in gather mode every rank's partial states are merged by one exchange.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from contrastive_dist.losses._kernel import Pairs, transposed_copy
from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._targets import Targets

__all__ = ["ColumnBlock", "column_block", "column_gradient", "column_state", "column_targets"]


class ColumnBlock(NamedTuple):
    """A chunk's logits seen from its columns.

    Attributes:
        values: ``(columns, c)`` a transposed copy of the logits, turned into numerators by the family.
        targets: where each column's positive row and its masks are.
        positive_mask: the columns' positives by key, or ``None``.
    """

    values: Tensor
    targets: Targets
    positive_mask: SameKey | None


def column_block(
    pairs: Pairs, logits: Tensor, own_start: int | None, start: int, stop: int, targets: Targets, columns: int
) -> ColumnBlock:
    """The first ``columns`` columns of a chunk of rows ``start:stop``, transposed.

    Only this rank's own columns (from ``own_start`` in the block) hold their positive rows.
    """
    values = transposed_copy(logits[:, :columns])
    targets = column_targets(pairs, own_start, start, stop, targets, columns)
    return ColumnBlock(values, targets, targets.positive_mask(values))


def column_targets(
    pairs: Pairs, own_start: int | None, start: int, stop: int, targets: Targets, columns: int
) -> Targets:
    """The targets of the block's first ``columns`` columns against the rows ``start:stop``."""
    column_keys = None if targets.column_keys is None else targets.column_keys[:columns]
    own = own_start is not None
    return pairs.rows.columns(own, start, stop - start, targets._replace(column_keys=column_keys))


def column_state(pairs: Pairs, block: ColumnBlock) -> Tensor:
    """``(columns, width)`` the columns' state over this chunk's rows; ``block.values`` become numerators."""
    return pairs.family.block_state_(block.values, block.targets, block.positive_mask)


def column_gradient(
    pairs: Pairs, block: ColumnBlock, state: Tensor, weights: Tensor | float, partial: Tensor | None = None
) -> Tensor:
    """``(columns, c)`` the columns' logit gradient, from their final ``state`` (``weights``: one per column).

    ``partial``: ``block.values`` are the numerators :func:`column_state` formed against this
    partial state (moved onto the final one here); ``None``: they are logits (a recomputed block).
    """
    family = pairs.family
    if partial is None:
        family.numerators_(block.values, state, block.targets, block.positive_mask)
    else:
        family.rebase_(block.values, partial, state)
    return family.gradient_(block.values, state, block.targets, block.positive_mask, weights)
