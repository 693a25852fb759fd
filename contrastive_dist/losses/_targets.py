"""Where a block's rows find their positives, which columns they leave out, and which pairs share a key.

A loss says, for each of its rows, where its positive and its excluded column sit in *its own
rank's* column block (:class:`RowTargets`); the driver says where that block sits among the columns
a visit meets (:mod:`._transports`), and the two make the :class:`Indices` of one side of a visit:
raw indices, which the fused epilogue reads as they are and the eager one turns into
:class:`Targets` (:meth:`Indices.targets`). Keys (SupCon's labels, sample ids) travel with their
columns like any other data, so pairs that share a key are found in every block.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from contrastive_dist.losses._same_key import SameKey, same_key

__all__ = [
    "MASKED",
    "SMALL_KEYS",
    "Indices",
    "KeyRule",
    "Located",
    "RowTargets",
    "Targets",
    "comparable_keys",
    "pair_targets",
    "small_keys_flag",
]

MASKED = 1e30
"""What a masked column's logit is lowered by: far below any candidate, so that its term is exactly 0.
A row whose largest logit in a block is below ``-MASKED / 2`` has no candidate there."""

SMALL_KEYS = 1
"""Agreement flag: this rank's keys are integers that the core's float dtype holds exactly."""


def small_keys_flag(keys: Tensor | None, dtype: torch.dtype, *, exchanged: bool = True) -> int | Tensor:
    """:data:`SMALL_KEYS` when every key is an integer ``dtype`` holds exactly (``|k| ≤ 2**24`` in float32).

    For keys on an accelerator the flag is a 0-d int64 tensor there: the agreement carries it in its
    one exchange (``exchanged``), so deciding it costs no host sync of its own. Where nothing is
    exchanged (one process) such keys stay integers, undecided: there the float keys would buy
    nothing (no collective to share with the features, and a GPU compares integers as fast) for a
    read of the device.
    """
    if torch.compiler.is_compiling():
        return 0  # nothing is exchanged under torch.compile: the keys stay integers, decided alike everywhere
    if keys is None or keys.numel() == 0:
        return SMALL_KEYS
    if keys.device.type != "cpu" and not exchanged:
        return 0
    limit = 2 ** (53 if dtype == torch.float64 else 24)
    small = ((keys >= -limit) & (keys <= limit)).all()
    if keys.device.type != "cpu":
        return small.to(torch.int64) * SMALL_KEYS
    return SMALL_KEYS if bool(small) else 0


def comparable_keys(keys: Tensor, dtype: torch.dtype, every_rank_small: bool) -> Tensor:
    """Keys as they are compared: in the logits' ``dtype`` when every rank's are small integers.

    Comparing floats into a float mask is several times faster than comparing integers into one on
    CPU; every rank must decide alike (keys travel and are gathered), hence the agreed flag.
    """
    return keys.to(dtype) if every_rank_small else keys

KeyRule = Literal["positive", "mask"]
"""What equal keys mean: the pair is a positive (labels; ``same_id="positive"``), or it is removed
from the row's negatives (``same_id="mask"``; the row's own positive stays)."""


class Located(NamedTuple):
    """One column per row of a block (its positive, or the column it leaves out).

    Attributes:
        column: ``(c, 1)`` the column of each row (any valid column where the row has none here).
        present: ``(c,)`` whether each row's column is in this block; ``None``: every row's is.
    """

    column: Tensor
    present: Tensor | None = None

    def read(self, values: Tensor) -> Tensor:
        """``(c,)`` each row's entry at its column, 0 where it has none in this block."""
        entries = values.gather(1, self.column).squeeze(1)
        return entries if self.present is None else torch.where(self.present, entries, 0.0)

    def write_(self, values: Tensor, entries: Tensor | float) -> None:
        """Write ``entries`` at each row's column where it is in this block, in place."""
        if self.present is None:
            if isinstance(entries, Tensor):
                values.scatter_(1, self.column, entries[:, None])
            else:
                values.scatter_(1, self.column, entries)
            return
        kept = values.gather(1, self.column).squeeze(1)
        values.scatter_(1, self.column, torch.where(self.present, entries, kept)[:, None])

    def presence(self, like: Tensor) -> Tensor:
        """``(c,)`` 1 where the row's column is in this block, else 0, in ``like``'s dtype."""
        if self.present is None:
            return like.new_ones(self.column.shape[0])
        return self.present.to(like.dtype)


def partly_located(index: Tensor, columns: int) -> Located | None:
    """The columns ``index`` (one per row) of a block of ``columns``: entries outside ``[0, columns)`` are absent."""
    if columns == 0:
        return None
    present = (index >= 0) & (index < columns)
    return Located(index.clamp(0, columns - 1)[:, None], present)


class Targets(NamedTuple):
    """The targets of ``c`` rows against one block of ``m`` columns.

    Attributes:
        positive: each row's single positive column, or ``None`` (none in this block, or positives by key).
        excluded: a column each row leaves out (its own sample), or ``None``.
        row_keys: ``(c,)`` the rows' keys, with ``column_keys`` ``(k,)`` for the block's first ``k``
            columns (the others have no key: they share none with any row); ``None``: no keys.
        column_keys: see ``row_keys``.
        key_rule: what equal keys mean (:data:`KeyRule`).
    """

    positive: Located | None = None
    excluded: Located | None = None
    row_keys: Tensor | None = None
    column_keys: Tensor | None = None
    key_rule: KeyRule = "positive"

    def _same_key(self, like: Tensor) -> SameKey | None:
        """The entries of ``like``'s block whose row and column share a key, or ``None`` without keys."""
        if self.row_keys is None or self.column_keys is None:
            return None
        return same_key(self.row_keys, self.column_keys, like)

    def positive_mask(self, like: Tensor) -> SameKey | None:
        """The entries that are the rows' positives by key (never an excluded one), else ``None``.

        ``None`` means one positive column per row (:attr:`positive`) or, in this block, none.
        """
        if self.key_rule != "positive":
            return None
        mask = self._same_key(like)
        if mask is not None and self.excluded is not None:
            mask = mask.without(self.excluded.column, self.excluded.present)
        return mask

    def exclude_(self, logits: Tensor) -> None:
        """Set the excluded columns' logits to ``-inf``, in place.

        The row's own column, and with the ``"mask"`` rule every column that shares its key except its positive.
        """
        if self.key_rule == "mask" and (same := self._same_key(logits)) is not None:
            if self.positive is not None:
                same = same.without(self.positive.column, self.positive.present)
            # Pushed below any candidate by MASKED instead of set to -inf: one multiply-add pass, several
            # times faster than a masked fill on CPU; their exponentials underflow to exactly 0.
            same.lower_(logits, MASKED)
        if self.excluded is not None:
            self.excluded.write_(logits, float("-inf"))


class Indices(NamedTuple):
    """One side of a visit: ``c`` rows against a block of ``width`` columns, as raw indices.

    Attributes:
        positive: ``(c,)`` int64 each row's positive column, counted from ``shift`` (``positive − shift`` is
            its column in the block), or ``None``: none (or positives by key).
        excluded: ``(c,)`` int64 a column each row leaves out, counted from ``shift`` too, or ``None``.
        row_keys: ``(c,)`` the rows' keys, with ``column_keys`` ``(k,)`` those of the block's first ``k``
            columns (the others have none: they share none with any row); ``None``: no keys.
        column_keys: see ``row_keys``.
        key_rule: what equal keys mean (:data:`KeyRule`).
        shift: see ``positive``; a visit of a chunk shifts by its first row instead of copying the indices.
        width: the block's columns: an index outside ``[0, width)`` after the shift is none.
        inside: every index is inside the block: no row needs a presence mask.
    """

    positive: Tensor | None = None
    excluded: Tensor | None = None
    row_keys: Tensor | None = None
    column_keys: Tensor | None = None
    key_rule: KeyRule = "positive"
    shift: int = 0
    width: int = 0
    inside: bool = True

    def rows(self, start: int, stop: int) -> Indices:
        """The targets of the rows ``start:stop`` alone, against the same columns."""
        positive, excluded, row_keys = (None if index is None else index[start:stop]
                                        for index in (self.positive, self.excluded, self.row_keys))  # fmt: skip
        return self._replace(positive=positive, excluded=excluded, row_keys=row_keys)

    def targets(self) -> Targets:
        """The same targets for the eager family functions: located columns."""

        def located(index: Tensor | None) -> Located | None:
            if index is None:
                return None
            index = index if self.shift == 0 else index - self.shift
            return Located(index[:, None]) if self.inside else partly_located(index, self.width)

        rule = self.key_rule
        return Targets(located(self.positive), located(self.excluded), self.row_keys, self.column_keys, rule)


class RowTargets(NamedTuple):
    """A loss's rows, described against its own rank's column block.

    Attributes:
        positive: ``(n,)`` each row's single positive column in its own rank's block, or ``None``
            (positives by key).
        excluded: ``(n,)`` a column of its own rank's block each row leaves out, or ``None``.
        keys: ``(n,)`` the rows' keys (labels, ids), or ``None``; the columns' keys travel with them.
        key_rule: what equal keys mean.
        column_positive: for the columns' own direction: the row of each column's positive among
            this rank's rows (InfoNCE: text ``j``'s image ``j``; out of range: on another rank), for the
            columns of this rank's own block (ring mode) or of the one block (gather mode); or ``None``.
    """

    positive: Tensor | None = None
    excluded: Tensor | None = None
    keys: Tensor | None = None
    key_rule: KeyRule = "positive"
    column_positive: Tensor | None = None


def pair_targets(
    positive: Tensor,
    *,
    excluded: Tensor | None = None,
    keys: Tensor | None = None,
    same_id: KeyRule = "mask",
    column_positive: Tensor | None = None,
) -> RowTargets:
    """Rows with one positive column each (their pair), and, with ``keys`` (ids), what equal ids mean.

    ``same_id="mask"``: other columns with the row's id are left out, its positive stays;
    ``"positive"``: every column with the row's id is a positive (its own pair among them: a pair
    shares its id); the pair still locates the exact part of the row's sum. ``column_positive``:
    the columns have losses of their own (symmetric losses); the row of each column's pair
    (:attr:`RowTargets.column_positive`).
    """
    rule: KeyRule = "positive" if keys is not None and same_id == "positive" else "mask"
    return RowTargets(positive, excluded, keys, rule, column_positive)
