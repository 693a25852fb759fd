"""The loss frame: what every loss does around its formula, written once.

A loss function states its own checks and options, then its formula in plain torch around the
frame's per-row primitive. The frame runs the rest, in this order:

1. :func:`begin`: the loss's own checks, then the common ones (reduction, communication, chunk size,
   scale, weights, ids), in one :func:`~contrastive_dist._validation.collect`; then the agreement —
   options, sizes, flags and the weight total in one exchange, the same error on every rank;
2. :meth:`Call.keys`: ids (or labels) as the driver compares them, decided alike on every rank;
3. :meth:`Call.columns`: this rank's columns through the chosen transport, with what travels with them;
4. the primitive: :meth:`Call.rows` — each row's value of a family (the masked log-sum-exp against its
   positives, the negatives-only log-sum-exp, the softplus sum), differentiable in both transports — and
   :meth:`Call.weighted_sum`, its fused ``Σ_i w_i ℓ_i`` (gradients formed with the logits, the same
   numbers); :meth:`Call.mean` is the usual composition of the two with the reduction;
5. :meth:`Call.share`: the gradient contract: each rank differentiates its share of the global mean
   ``Σ w ℓ / Σ_global w`` (whose mean over the ranks is that mean) and returns the mean itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import GroupLike, as_local, is_distributed
from contrastive_dist._validation import collect
from contrastive_dist.engine._agreement import Layout, agree
from contrastive_dist.engine._wire import all_reduce
from contrastive_dist.losses import _driver
from contrastive_dist.losses import _options as opt
from contrastive_dist.losses._families import Family
from contrastive_dist.losses._negatives import SharedNegatives
from contrastive_dist.losses._targets import SMALL_KEYS, RowTargets, comparable_keys, small_keys_flag
from contrastive_dist.losses._transports import Columns, columns_of, meet

__all__ = ["Call", "Common", "begin", "global_mean"]

Own = TypeVar("Own", bound=tuple[Any, ...])


@dataclass(frozen=True, kw_only=True)
class Common:
    """The options every loss takes, as the caller gave them (checked by :func:`begin`).

    ``temperature=None``: the loss has none, and ``logit_scale`` is required; ``same_id=None``: the
    loss takes no ``same_id``.
    """

    operation: str
    logit_scale: object
    temperature: object
    chunk_size: object
    group: GroupLike
    sizes: Sequence[int] | None
    weight: object
    reduction: opt.Reduction
    communication: opt.Communication
    ids: object = None
    same_id: opt.SameId | None = None


@dataclass(frozen=True)
class Call(Generic[Own]):
    """One checked, agreed call of a loss: its own inputs, the common ones, every rank's layout.

    Attributes:
        own: what the loss's own check returned (a named tuple, its rows' features first).
        scale, chunk: ``()`` the logit scale, in the compute dtype; rows per logit block, or ``None``.
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
    def second_layout(self) -> Layout:
        """The layout of the inputs counted by the agreement's second count (``begin(extra=)``)."""
        return self.layout._replace(sizes=self.layout.extra_sizes)

    @property
    def per_row(self) -> bool:
        """Whether the loss returns its rows' losses (``reduction="none"``)."""
        return self.common.reduction == "none"

    def keys(self, keys: Tensor | None, *, small: bool = True) -> Tensor | None:
        """``keys`` (ids, labels) as the driver compares them: floats where every rank's are small integers.

        ``small``: what the caller knows of keys the agreement did not see (sample indices: their count).
        """
        if keys is None:
            return None
        return comparable_keys(keys, self.scale.dtype, small and self.layout.every_rank_has(SMALL_KEYS))

    def columns(self, features: Tensor, *, keys: Tensor | None = None, per_sample: int = 1,
                negatives: Tensor | SharedNegatives | None = None, negative_keys: Tensor | None = None,
                own_losses: bool = False, second: bool = False) -> Columns:  # fmt: skip
        """The columns this rank's rows meet: every rank's ``features`` (``per_sample`` rows a sample), their keys.

        ``negatives``: InfoNCE's extra columns, this rank's own (after its features, every rank's) or
        :class:`~contrastive_dist.SharedNegatives` (held here), with ``negative_keys``. ``own_losses``: the
        features' columns have losses of their own, from the same logits (a symmetric loss); in gather
        mode the rows' weights travel with them. ``second``: the features are counted by the agreement's
        second count, not by the rows (the texts of a batch with several per image).

        Shape:
            features: ``(n_r · per_sample, D)`` (``second``: ``(m_r, D)``); keys: one per feature row.
        """
        weights = self.weights if own_losses else None
        layout = self.second_layout if second else self.layout
        columns = columns_of(self.common.communication, layout, opt.operands(features), keys,
                             per_sample=per_sample, weights=weights)
        columns = columns._replace(own_losses=columns.counts) if own_losses else columns
        if negatives is None:
            return columns
        from contrastive_dist.losses._negatives import with_negatives

        return with_negatives(columns, negatives, negative_keys, self.layout)

    def rows(self, family: Family, queries: Tensor, columns: Columns, targets: RowTargets, *,
             scale: Tensor | None = None, bias: Tensor | None = None, tiles: RowTargets | None = None,
             ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The primitive: each row's value of ``family`` against the columns (``scale``: default the call's).

        Returns the rows' values, this rank's own columns' (``own_losses``; else empty) and whether each
        row has one; differentiable, its gradient formed in backward. ``tiles``: a Gram loss's every-row
        targets (:class:`~._driver.Problem`).
        """
        problem = _driver.Problem(family, targets, columns, self.chunk, tiles)
        scale = self.scale if scale is None else scale
        return _driver.per_row(opt.operands(queries), columns.features, scale, bias, problem)

    def weighted_sum(self, family: Family, queries: Tensor, columns: Columns, targets: RowTargets, *,
                     weights: Tensor | None = None, bias: Tensor | None = None, tiles: RowTargets | None = None,
                     ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``Σ_i w_i ℓ_i`` of :meth:`rows` (symmetric: the own columns' too), fused; whether each row has a loss.

        ``weights``: per query row (default: the call's).
        """
        problem = _driver.Problem(family, targets, columns, self.chunk, tiles)
        weights = self.weights if weights is None else weights
        return _driver.weighted_sum(opt.operands(queries), columns.features, self.scale, bias, problem, weights)

    def mean(self, family: Family, queries: Tensor, columns: Columns, targets: RowTargets, *,
             bias: Tensor | None = None) -> Tensor:  # fmt: skip
        """The loss: each row's value (a symmetric loss's: the mean of its two directions) or this rank's share."""
        if self.per_row:
            rows, own_columns, _ = self.rows(family, queries, columns, targets, bias=bias)
            return rows if columns.own_losses is None else (rows + own_columns) * 0.5
        total, _ = self.weighted_sum(family, queries, columns, targets, bias=bias)
        return self.share(total if columns.own_losses is None else total * 0.5)

    def share(self, value: Tensor, *, local_denominator: Tensor | None = None, per: int = 1) -> Tensor:
        """The global mean of ``value`` summed over the ranks as the value, this rank's share as its gradient.

        ``local_denominator``: this rank's part of a denominator only the ranks' sum gives (SupCon's anchors
        with positives); default the agreed weight total or row count, times ``per``. See :func:`global_mean`.
        """
        total = sum(self.layout.sizes) if self.layout.total is None else self.layout.total
        return global_mean(value, self.layout, total * per if local_denominator is None else None,
                           local_denominator=local_denominator)  # fmt: skip

    def gathered(self, rows: Tensor, *, second: bool = False) -> Tensor:
        """Every rank's ``rows`` (one per local sample; ``second``: per second count), in rank order; differentiable.

        Shape:
            rows: ``(n_r, ...)``; output: ``(N, ...)``.
        """
        return meet("gather", self.second_layout if second else self.layout, [rows])[0]

    def summed(self, value: Tensor) -> Tensor:
        """``value`` summed over the ranks (one all-reduce; traceable under ``torch.compile``)."""
        return _summed(value, self.layout)


def begin(check: Callable[[], Own], common: Common, *, inputs: Sequence[object], options: Mapping[str, object],
          keyed: Sequence[object] = (), extra: int = 0, extra_sizes: Sequence[int] | None = None, total: bool = True,
          scalars: Mapping[str, int] | None = None) -> Call[Own]:  # fmt: skip
    """Check a call on this rank and agree on it with every rank; the same error everywhere if any rank's is wrong.

    Args:
        check: the loss's own checks; returns its checked inputs, the rows' features first.
        common: the options every loss takes.
        inputs: the tensors every rank compares (rows counted from the first); ``None`` entries left out.
        options: the loss's own options that every rank must share.
        keyed: id-like tensors beside ``common.ids`` whose keys every rank must compare alike.
        extra: this rank's second count (its own negatives, its texts).
        extra_sizes: every rank's second count, as the caller gave it (``text_sizes=``), or None.
        total: whether the weight total is agreed (a loss whose denominator only its blocks reveal: no).
        scalars: the loss's other scalars, by name: their index in ``check()``'s result (equal everywhere).
    """
    local_inputs = list(inputs)

    def checked() -> tuple[Own, Tensor, int | None, Tensor | None, Tensor | None]:
        local_inputs[:] = as_local(inputs, common.group)  # DTensor inputs: this rank's rows, or refused
        own = cast(Own, as_local(check(), common.group))
        features: Tensor = own[0]
        opt.check_reduction(common.reduction, common.weight)
        opt.check_communication(common.communication)
        if common.same_id is not None:
            opt.check_same_id(common.same_id)
        if common.temperature is None:
            scale = opt.positive_scalar("logit_scale", common.logit_scale, features)
        else:
            scale = opt.resolve_scale(common.logit_scale, opt.check_temperature(common.temperature), features)
        rows = features.shape[0]
        return (own, scale, opt.check_chunk_size(common.chunk_size), opt.check_weight(common.weight, rows, features),
                opt.check_ids("ids", common.ids, rows, features))

    result, problem = collect(checked)
    flags: int | Tensor = 0
    if result is not None:
        dtype, exchanged, flags = opt.compute_dtype(result[0][0].dtype), is_distributed(common.group), SMALL_KEYS
        for keys in (result[4], *keyed):  # every rank's keys small, or compared as integers everywhere
            flags = small_keys_flag(keys if isinstance(keys, Tensor) else None, dtype, exchanged=exchanged) & flags
    weight_total = None if result is None or not total or result[3] is None else result[3].sum(dtype=torch.float64)
    # Every rank must share these: the temperature where no logit_scale replaces it, whether weights come
    # (their values are per row, like the features'), whether ids do, and what equal ids mean.
    agreed = {"chunk_size": common.chunk_size, "communication": common.communication,
              "reduction": common.reduction, "weight": common.weight is not None}  # fmt: skip
    if common.temperature is not None:
        agreed["temperature"] = common.temperature if common.logit_scale is None else "logit_scale"
    agreed |= {"ids": common.ids is not None} | ({} if common.same_id is None else {"same_id": common.same_id})
    agreed |= options
    own_scalars = {} if result is None else {name: result[0][index] for name, index in (scalars or {}).items()}
    compared = None if result is None else {"logit_scale": result[1], **own_scalars}
    layout = agree([tensor for tensor in (*local_inputs, common.ids) if tensor is not None], problem=problem,
                   group=common.group, operation=common.operation, options=agreed, sizes=common.sizes, extra=extra,
                   extra_sizes=extra_sizes,
                   total=weight_total, flags=flags, scalars=compared)  # fmt: skip
    assert result is not None  # the agreement raised otherwise
    own, scale, chunk, weights, ids = result
    return Call(own, scale, chunk, weights, ids, layout, common)


def global_mean(value: Tensor, layout: Layout, denominator: Tensor | int | None = None, *,
                local_denominator: Tensor | None = None) -> Tensor:
    """``Σ_ranks value / denominator`` as the value, this rank's share ``W · value / denominator`` as the gradient.

    The share's mean over the ranks is the global mean (the gradient contract); each rank returns
    ``(share − share.detach()) + L``, the global loss ``L`` on every rank, bit for bit: the value a trainer
    logs (rank 0's share is not the loss: rows 7 + 1 give shares 4.15 and 0.91 of a loss of 2.53). ``L``
    takes one scalar all-reduce of the detached sums, which carries ``local_denominator`` too (this rank's
    part of a denominator only the ranks' sum gives; instead of ``denominator``). A zero denominator means
    every term is 0 too: the result is then a zero still connected to the graph, so every rank still runs
    the backward collectives.

    Shape:
        value, local_denominator: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> from contrastive_dist.engine._agreement import Layout
        >>> total = torch.tensor(6.0, requires_grad=True)
        >>> loss = global_mean(total, Layout(0, 1, (4,), (0,), None, None), 4)
        >>> loss.backward()
        >>> loss.item(), total.grad.item()
        (1.5, 0.25)
    """
    if layout.world_size == 1:
        return _mean(value, 1, cast(Tensor | int, denominator if local_denominator is None else local_denominator))
    sums = [value.detach()] + ([] if local_denominator is None else [local_denominator.detach().to(value.dtype)])
    summed = _summed(torch.stack(sums), layout)
    total = cast(Tensor | int, denominator) if local_denominator is None else summed[1]
    share = _mean(value, layout.world_size, total)
    return (share - share.detach()) + _mean(summed[0], 1, total)


def _summed(value: Tensor, layout: Layout) -> Tensor:
    if layout.world_size == 1:
        return value
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(value, "sum", cast(ProcessGroup, layout.group or dist.group.WORLD))
    total = value.clone()
    all_reduce(total, layout.group, operation="loss reduction (all-reduce)")
    return total


def _mean(total: Tensor, factor: int, denominator: Tensor | int) -> Tensor:
    """``factor · total / denominator``; 0 when the denominator is 0 (every term is then 0 too)."""
    if isinstance(denominator, int):
        return total * (factor / denominator if denominator > 0 else 0.0)
    denominator = denominator.to(total.dtype)
    positive = denominator > 0
    return total * torch.where(positive, factor / torch.where(positive, denominator, 1.0), 0.0)
