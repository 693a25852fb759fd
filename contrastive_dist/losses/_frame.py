"""The loss frame: what every loss does around its formula, written once.

A loss function names its own checks and options and then states its formula — its family, rows,
columns, targets and directions. The frame runs the rest, in this order:

1. :func:`begin`: the loss's own checks, then the common ones (reduction, communication, chunk size,
   scale, weights, ids), in one :func:`~contrastive_dist._validation.collect`; then the agreement —
   options, sizes, flags and the weight total in one exchange, the same error on every rank;
2. :meth:`Call.keys`: ids (or labels) as the kernel compares them, decided alike on every rank;
3. :meth:`Call.meet`: this rank's columns through the chosen transport;
4. :meth:`Call.pairs` and :meth:`Call.pair_sum`: the kernel call, ``Σ_i w_i ℓ_i`` (or the ``ℓ_i``);
5. :meth:`Call.share`: this rank's share of the global mean (the gradient contract), or the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import is_distributed
from contrastive_dist._validation import collect
from contrastive_dist.engine._agreement import Layout, agree
from contrastive_dist.losses._columns import Columns, meet
from contrastive_dist.losses._kernel import Family, Pairs
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
    positive_scalar,
    resolve_scale,
)
from contrastive_dist.losses._precision import compute_dtype
from contrastive_dist.losses._reduction import Direction, mean_over_directions, mean_share, weight_total
from contrastive_dist.losses._targets import SMALL_KEYS, RowTargets, comparable_keys, small_keys_flag

__all__ = ["Call", "Common", "begin"]

Own = TypeVar("Own", bound=tuple[Any, ...])


@dataclass(frozen=True)
class Common:
    """The options every loss takes, as the caller gave them (checked by :func:`begin`).

    ``temperature=None``: the loss has none, and ``logit_scale`` is required; ``same_id=None``: the
    loss takes no ``same_id``.
    """

    operation: str
    logit_scale: object
    temperature: object
    chunk_size: object
    group: ProcessGroup | None
    sizes: Sequence[int] | None
    weight: object
    reduction: Reduction
    communication: Communication
    ids: object = None
    same_id: SameId | None = None


@dataclass(frozen=True)
class Call(Generic[Own]):
    """One checked, agreed call of a loss: its own inputs, the common ones, and every rank's layout.

    Attributes:
        own: what the loss's own check returned (its features first).
        scale: ``()`` the logit scale, in the compute dtype.
        chunk: rows per logit block, or ``None`` (chosen from the shapes).
        weights: ``(n_r,)`` the rows' weights, detached, or ``None``.
        ids: ``(n_r,)`` int64 sample ids, or ``None``.
        layout: every rank's sizes, this rank's place, the agreed flags and weight total.
        common: the options as given.
    """

    own: Own
    scale: Tensor
    chunk: int | None
    weights: Tensor | None
    ids: Tensor | None
    layout: Layout
    common: Common

    @property
    def per_row(self) -> bool:
        """Whether the loss returns its rows' losses (``reduction="none"``)."""
        return self.common.reduction == "none"

    def keys(self, keys: Tensor | None, *, small: bool = True) -> Tensor | None:
        """``keys`` (ids, labels) as the kernel compares them: floats where every rank's are small integers.

        ``small``: what the caller knows of keys the agreement did not see (sample indices: their count).
        """
        if keys is None:
            return None
        every_rank_small = small and self.layout.every_rank_has(SMALL_KEYS)
        return comparable_keys(keys, self.scale.dtype, every_rank_small)

    def meet(self, own: Sequence[Tensor | None], *, per_sample: int = 1) -> Columns:
        """The columns of this rank's ``own`` (features first, then what travels with them; ``None``: left out)."""
        present = [tensor for tensor in own if tensor is not None]
        return meet(self.common.communication, self.layout, present, per_sample=per_sample)

    def pairs(self, family: Family, rows: RowTargets, met: Columns, *, keyed: bool, **more: Any) -> Pairs:
        """The fixed parts of a kernel call against the columns ``met`` (keys: ``met.tensors[1]``, when ``keyed``)."""
        column_keys = met.tensors[1] if keyed else None
        return Pairs(family, rows, met.transport, self.chunk, column_keys=column_keys, key_rows=met.rows, **more)

    def pair_sum(self, queries: Tensor, keys: Tensor, pairs: Pairs, *, bias: Tensor | None = None,
                 weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``Σ_i w_i ℓ_i`` of ``queries`` against ``keys`` (or the ``ℓ_i``), and which rows have a loss.

        ``weights``: per query row (default: the call's, one per local row).
        """
        weights = self.weights if weights is None else weights
        direction = Direction(queries, keys, self.scale, bias, pairs)
        return mean_over_directions([direction], weights=weights, per_row=self.per_row)

    def share(self, value: Tensor, denominator: Tensor | int | None = None) -> Tensor:
        """The share of this rank in the global mean of ``value`` summed over the ranks (the gradient contract).

        ``denominator``: the global weight total or row count, default the agreed one.
        """
        if denominator is None:
            denominator = sum(self.layout.sizes) if self.layout.total is None else self.layout.total
        return mean_share(value, self.layout, denominator)


def begin(
    common: Common,
    check: Callable[[], Own],
    inputs: Sequence[object],
    *,
    options: Mapping[str, object],
    keyed: Sequence[object] = (),
    extra: int = 0,
    total: bool = True,
    scalars: Mapping[str, int] | None = None,
) -> Call[Own]:
    """Check a call on this rank and agree on it with every rank; the same error everywhere if any rank's is wrong.

    Args:
        common: the options every loss takes.
        check: the loss's own checks; returns its checked inputs, the rows' features first.
        inputs: the tensors every rank compares (rows counted from the first); ``None`` entries left out.
        options: the loss's own options that every rank must share.
        keyed: id-like tensors beside ``common.ids`` whose keys every rank must compare alike.
        extra: this rank's second count (its own negatives).
        total: whether the weight total is agreed (a loss whose denominator only its blocks reveal: no).
        scalars: the loss's scalar parameters beside the scale, by name: their index in ``check()``'s result;
            every rank must pass the same values (compared with the scale's in the same exchange).
    """

    def checked() -> tuple[Own, Tensor, int | None, Tensor | None, Tensor | None]:
        own = check()
        features: Tensor = own[0]
        check_reduction(common.reduction, common.weight)
        check_communication(common.communication)
        if common.same_id is not None:
            check_same_id(common.same_id)
        if common.temperature is None:
            scale = positive_scalar("logit_scale", common.logit_scale, features)
        else:
            scale = resolve_scale(common.logit_scale, check_temperature(common.temperature), features)
        rows = features.shape[0]
        return (own, scale, check_chunk_size(common.chunk_size), check_weight(common.weight, rows, features),
                check_ids("ids", common.ids, rows, features))

    result, problem = collect(checked)
    flags: int | Tensor = 0
    if result is not None:
        dtype = compute_dtype(result[0][0].dtype)
        flags = SMALL_KEYS
        exchanged = is_distributed(common.group)
        for keys in (result[4], *keyed):  # every rank's keys small, or compared as integers everywhere
            flags = small_keys_flag(keys if isinstance(keys, Tensor) else None, dtype, exchanged=exchanged) & flags
    # Whether ids are given is agreed for every loss; what equal ids mean, for the losses that say.
    same_id = {} if common.same_id is None else {"same_id": common.same_id}
    options = {"ids": common.ids is not None, **same_id, **options}
    layout = agree(
        [tensor for tensor in (*inputs, common.ids) if tensor is not None],
        problem=problem,
        group=common.group,
        operation=common.operation,
        options=agreed_options(chunk_size=common.chunk_size, communication=common.communication,
                               reduction=common.reduction, weight=common.weight, temperature=common.temperature,
                               logit_scale=common.logit_scale, **options),
        sizes=common.sizes,
        extra=extra,
        total=None if result is None or not total else weight_total(result[3]),
        flags=flags,
        scalars=None if result is None else {"logit_scale": result[1]}
        | {name: result[0][index] for name, index in (scalars or {}).items()},
    )
    assert result is not None  # the agreement raised otherwise
    own, scale, chunk, weights, ids = result
    return Call(own, scale, chunk, weights, ids, layout, common)

