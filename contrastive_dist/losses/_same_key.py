"""Which pairs of a block share a key (SupCon's labels, sample ids): a dense mask, or the few pairs by index.

Compared densely, keys cost a pass over the block for every use: the comparison, the positives'
sum, their count, their gradient, the masking. Most keys are nearly unique (sample ids repeat
rarely; labels of many classes pair a row with a few columns), so on the CPU the pairs that share
a key are found by sorting the block's keys once, and each use touches those pairs alone:
``O(m log m + pairs)`` instead of a few passes over ``c × m``. Keys shared by many pairs (a few
classes), accelerators (where the comparison is one cheap fused pass and counting the pairs would
wait on the device) and ``torch.compile`` (whose graphs want static shapes) keep the dense mask.
Both forms give the same numbers: the sums run over the same entries.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["SPARSE_AT_MOST", "SameKey", "key_pairs", "same_key"]

SPARSE_AT_MOST = 1 / 16
"""The pairs are kept as indices when they are at most this fraction of the block's entries."""


class SameKey(NamedTuple):
    """The entries of a ``c × m`` block whose row and column share a key.

    Attributes:
        dense: ``(c, m)`` 1 where they do, else 0, in the block's dtype; ``None`` when sparse.
        rows, columns: ``(P,)`` int64 the entries, when sparse (``dense`` is ``None``).
    """

    dense: Tensor | None
    rows: Tensor | None = None
    columns: Tensor | None = None

    def row_sums(self, values: Tensor) -> Tensor:
        """``(c,)`` each row's sum of ``values`` over its entries."""
        if self.dense is not None:
            return torch.mul(self.dense, values).sum(dim=1)
        sums = values.new_zeros(values.shape[0])
        return sums.index_add_(0, self.rows, values[self.rows, self.columns])  # type: ignore[index, arg-type]

    def counts(self, like: Tensor) -> Tensor:
        """``(c,)`` each row's number of entries, in ``like``'s dtype."""
        if self.dense is not None:
            return self.dense.sum(dim=1)
        return torch.bincount(self.rows, minlength=like.shape[0]).to(like.dtype)  # type: ignore[arg-type]

    def add_(self, values: Tensor, per_row: Tensor, *, alpha: float) -> Tensor:
        """``values += alpha · per_row[i]`` at each row ``i``'s entries, in place; returns ``values``."""
        if self.dense is not None:
            return values.addcmul_(self.dense, per_row[:, None], value=alpha)
        values[self.rows, self.columns] += alpha * per_row[self.rows]  # type: ignore[index]
        return values

    def flip_(self, values: Tensor) -> Tensor:
        """Negate the entries, in place."""
        if self.dense is not None:
            return values.mul_(1.0 - 2.0 * self.dense)
        values[self.rows, self.columns] = -values[self.rows, self.columns]  # type: ignore[index]
        return values

    def lower_(self, values: Tensor, amount: float) -> Tensor:
        """``values -= amount`` at the entries, in place."""
        if self.dense is not None:
            return values.add_(self.dense, alpha=-amount)
        values[self.rows, self.columns] -= amount  # type: ignore[index]
        return values

    def without(self, column: Tensor, present: Tensor | None) -> SameKey:
        """Without each row's entry at ``column[i, 0]`` (where ``present[i]``, all rows when ``None``)."""
        if self.dense is not None:
            kept = self.dense.gather(1, column).squeeze(1)
            leave = torch.zeros_like(kept) if present is None else torch.where(present, 0.0, kept)
            self.dense.scatter_(1, column, leave[:, None])
            return self
        dropped = self.columns == column[self.rows, 0]  # type: ignore[index]
        if present is not None:
            dropped &= present[self.rows]  # type: ignore[index]
        remaining = ~dropped
        return SameKey(None, self.rows[remaining], self.columns[remaining])  # type: ignore[index]


def same_key(row_keys: Tensor, column_keys: Tensor, like: Tensor) -> SameKey:
    """The entries of the block ``like`` (``c × m``) whose row key equals its column key.

    ``column_keys`` are those of the block's first ``k ≤ m`` columns; the others have none.

    Example:
        >>> import torch
        >>> block = torch.zeros(3, 4)
        >>> same = same_key(torch.tensor([0, 1, 2]), torch.tensor([1, 0, 0]), block)
        >>> same.counts(block), same.row_sums(torch.arange(12.0).view(3, 4))
        (tensor([2., 1., 0.]), tensor([3., 4., 0.]))
    """
    rows, columns = like.shape
    if like.device.type == "cpu" and not torch.compiler.is_compiling() and rows and column_keys.numel():
        pairs = key_pairs(row_keys, column_keys, most=int(SPARSE_AT_MOST * rows * columns))
        if pairs is not None:
            return SameKey(None, *pairs)
    keyed = column_keys.shape[0]
    dense = like.new_empty(like.shape) if keyed == columns else like.new_zeros(like.shape)
    # Assigned, not written through out=: torch.compile refuses an out= it cannot prove contiguous (a column
    # slice; in ring mode, a block whose size is symbolic).
    dense[:, :keyed] = torch.eq(row_keys[:, None], column_keys[None, :])
    return SameKey(dense)


def key_pairs(row_keys: Tensor, column_keys: Tensor, most: int | None = None) -> tuple[Tensor, Tensor] | None:
    """``(P,)`` rows and ``(P,)`` columns of every pair with equal keys, found by sorting the columns' keys once.

    ``None`` when there are more than ``most`` pairs. Reads their count on the host.

    Example:
        >>> key_pairs(torch.tensor([0, 1, 2]), torch.tensor([1, 0, 0]))
        (tensor([0, 0, 1]), tensor([1, 2, 0]))
    """
    ordered, order = column_keys.sort(stable=True)
    row_keys = row_keys.contiguous()  # (a column of the block that travelled with the features)
    first = torch.searchsorted(ordered, row_keys, side="left")
    counts = torch.searchsorted(ordered, row_keys, side="right") - first
    total = int(counts.sum())
    if most is not None and total > most:
        return None
    pair_rows = torch.repeat_interleave(torch.arange(row_keys.shape[0], device=row_keys.device), counts,
                                        output_size=total)  # fmt: skip
    within = torch.arange(total, device=row_keys.device) - (torch.cumsum(counts, 0) - counts)[pair_rows]
    return pair_rows, order[first[pair_rows] + within]
