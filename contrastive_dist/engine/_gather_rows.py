"""The gather's autograd function and its collectives per dtype: what :func:`~contrastive_dist.all_gather` runs.

:class:`_GatherRows` is the all-gather along dim 0 whose backward is the matching reduce-scatter
(SUM); :func:`gather_eager` packs the tensors of one dtype into one buffer, so that several tensors
with the same rows cost one collective, and runs it, with every rank's status riding on the same
transfers when the caller promised ``sizes=``.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange, unpack
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._wire import gather_rows, reduce_scatter_rows
from contrastive_dist.engine._wire_status import (
    STATUS_BAD_ROWS,
    STATUS_OK,
    STATUS_OK_WITH_GRAD,
    gather_rows_with_status,
)

__all__ = ["gather_eager"]


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 whose backward is the matching reduce-scatter (SUM)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        sizes: tuple[int, ...],
        rank: int,
        group: ProcessGroup | None,
        statuses: list[int] | None,
    ) -> Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        if statuses is None:
            return gather_rows(x, sizes, rank, group)
        # Caller-given sizes: ``statuses`` holds this rank's status code on the way in and every
        # rank's on the way out (carried by the same transfers), so the caller can check them.
        gathered, statuses[:] = gather_rows_with_status(x, sizes, rank, group, statuses[0])
        return gathered

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # The reduce-scatter is a raw collective autograd cannot differentiate again; marking
        # the backward makes ``create_graph=True`` raise instead of returning wrong results.
        return reduce_scatter_rows(grad, ctx.sizes, ctx.rank, ctx.group), None, None, None, None


def gather_eager(
    tensors: tuple[Tensor, ...],
    dim: int,
    sizes: tuple[int, ...],
    rank: int,
    group: ProcessGroup | None,
    *,
    check_rows: bool,
) -> tuple[tuple[Tensor, ...], list[int]]:
    """One collective per dtype.

    With ``check_rows`` (caller-given sizes) each collective also carries every rank's status:
    whether its row count matches ``sizes`` and whether autograd tracks its rows. Returns the
    gathered tensors and the statuses (stopping at the first collective where they disagree).
    """
    rows = [tensor.movedim(dim, 0) for tensor in tensors]
    results: list[Tensor] = list(rows)
    statuses: list[int] = []
    rows_match = rows[0].shape[0] == sizes[rank]
    for indices in _indices_by_dtype(rows):
        members = [rows[i] for i in indices]
        packed = _pack(members)
        exchange: list[int] | None = None
        if check_rows:
            tracked = torch.is_grad_enabled() and any(member.requires_grad for member in members)
            code = STATUS_OK_WITH_GRAD if tracked else STATUS_OK
            exchange = [code if rows_match else STATUS_BAD_ROWS]
        gathered = _GatherRows.apply(packed, sizes, rank, group, exchange)
        if exchange is not None:
            statuses = exchange
            if STATUS_BAD_ROWS in statuses or len(set(statuses)) > 1:
                return tuple(results), statuses  # the caller raises on every rank
        for index, piece in zip(indices, _unpack(gathered, members)):
            results[index] = piece.movedim(0, dim)
    return tuple(results), statuses


def _indices_by_dtype(rows: list[Tensor]) -> list[list[int]]:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, row in enumerate(rows):
        by_dtype.setdefault(row.dtype, []).append(index)
    return list(by_dtype.values())


def _pack(members: list[Tensor]) -> Tensor:
    """One ``(n, Σ row_numel)`` buffer for tensors of one dtype (the tensor itself if alone).

    Not ``einops.pack``: it flattens with a ``-1``, which torch cannot resolve for an empty
    rank's ``(0, ...)`` rows; naming the flattened axes always works.
    """
    if len(members) == 1:
        return members[0]
    return torch.cat([rearrange(member, "n ... -> n (...)") for member in members], dim=1)


def _unpack(gathered: Tensor, members: list[Tensor]) -> list[Tensor]:
    """Inverse of :func:`_pack` on the gathered rows (views, no copy)."""
    if len(members) == 1:
        return [gathered]
    return unpack(gathered, [member.shape[1:] for member in members], "n *")
