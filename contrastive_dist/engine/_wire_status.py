"""The gather's transfers when the caller promised ``sizes=``: every rank's status rides on the same transfers.

With ``sizes=`` given there is no size exchange, so a rank whose tensor does not have the promised
rows (or whose autograd tracking differs) must still move exactly the promised bytes, or the transport
aborts (gloo) or hangs (NCCL). Each rank sends a status code with its rows; every rank reads all of
them and the caller raises on every rank when one is off. The routes are those of
:func:`~contrastive_dist.engine._wire.gather_rows` (``_wire``'s docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._faults import naming_peers, wait_named
from contrastive_dist.engine._settle import settled
from contrastive_dist.engine._wire import (
    _global_rank,
    _on_accelerator,
    _source_operation,
    _to_wire,
    all_gather_single,
    gather_rows,
)

__all__ = ["STATUS_BAD_ROWS", "STATUS_OK", "STATUS_OK_WITH_GRAD", "gather_rows_with_status"]

STATUS_OK, STATUS_BAD_ROWS, STATUS_OK_WITH_GRAD = 0, 1, 2
"""Status codes a rank sends with its rows when the caller gave ``sizes`` (small ints: exact in any dtype)."""


def gather_rows_with_status(
    x: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None, status: int
) -> tuple[Tensor, list[int]]:
    """Like :func:`~contrastive_dist.engine._wire.gather_rows`, with one status row per rank riding on its transfers.

    Used when the caller promised ``sizes`` (no size exchange): a rank whose tensor does not
    have ``sizes[rank]`` rows sends zeros of the promised size with ``STATUS_BAD_ROWS`` instead,
    so the transport never sees a size mismatch and *every* rank learns of the problem. The
    other codes say whether the rank's rows are tracked by autograd, which must agree too.

    Returns:
        The gathered rows (meaningless unless every status is OK) and every rank's status.
    """
    rest = x.shape[1:]
    ok = status != STATUS_BAD_ROWS
    payload = _to_wire(x) if ok else _to_wire(x.new_zeros((sizes[rank], *rest)))
    if math.prod(rest) == 0:
        # Rows of zero width cannot carry a status, and there is no data to move: one small
        # exchange of the statuses alone, so a wrong row count or autograd mismatch still shows.
        return x.new_empty((sum(sizes), *rest)), _gather_statuses(status, len(sizes), x.device, group)
    if _on_accelerator(x):
        return _gather_framed(payload, x.dtype, sizes, rank, group, status)
    # gloo: rank r broadcasts its rows plus one status row into out[start_r : start_r + n_r + 1].
    # That status row lands on the first row of rank r+1's block (or on the one spare row at the
    # end), is read, and is then overwritten by rank r+1's broadcast: no copy of the data, at the
    # price of broadcasting in order, one at a time.
    out = payload.new_empty((sum(sizes) + 1, *rest))
    statuses: list[int] = []
    settled(lambda views: _broadcast_in_order(views[0], payload, sizes, rank, group, status, statuses), (out,))
    data = out[:-1]
    return (data.view(x.dtype) if data.dtype != x.dtype else data), statuses


def _broadcast_in_order(
    out: Tensor,
    payload: Tensor,
    sizes: Sequence[int],
    rank: int,
    group: ProcessGroup | None,
    status: int,
    statuses: list[int],
) -> None:
    """gloo, with statuses: each rank's rows and status row into ``out``, one broadcast after the other."""
    start = 0
    for owner, size in enumerate(sizes):
        block = out[start : start + size + 1]
        if owner == rank:
            block[:size] = payload
            block[size] = status
        operation, peers = _source_operation(owner, rank)
        with naming_peers(operation, group, peers=peers):
            work = dist.broadcast(block, src=_global_rank(group, owner), group=group, async_op=True)
        wait_named(work, operation, group, peers=peers)
        statuses.append(int(block[size].flatten()[0]) if block[size].numel() else STATUS_OK)
        start += size


def _gather_statuses(status: int, world_size: int, device: torch.device, group: ProcessGroup | None) -> list[int]:
    mine = torch.tensor([status], dtype=torch.int64, device=device)
    everyone = mine.new_empty(world_size)
    all_gather_single(everyone, mine, group=group, operation="gather (status exchange)")
    return [int(value) for value in everyone.tolist()]


def _gather_framed(
    payload: Tensor, dtype: torch.dtype, sizes: Sequence[int], rank: int, group: ProcessGroup | None, status: int
) -> tuple[Tensor, list[int]]:
    """Accelerators: append the status row to every rank's rows, gather once, drop the status rows.

    The final copy is cheap on an accelerator, cheaper than a second collective's latency.
    """
    framed = payload.new_zeros((payload.shape[0] + 1, *payload.shape[1:]))
    framed[:-1] = payload
    framed[-1] = status
    framed_sizes = [size + 1 for size in sizes]
    received = gather_rows(framed, framed_sizes, rank, group)
    ends = torch.tensor(framed_sizes, device=received.device).cumsum(0)
    statuses = [int(value) for value in received[ends - 1].reshape(len(sizes), -1)[:, 0].tolist()]
    data = torch.cat([segment[:-1] for segment in received.split(framed_sizes)])
    return (data.view(dtype) if data.dtype != dtype else data), statuses
