"""Raw, non-differentiable transport used by the gather; no padding ever goes on the wire.

Routes, chosen by measurement on gloo (see ``benchmarks/gather.py``) and by what NCCL does best:

=================  ===========================  ===============================================
sizes              forward (gather rows)        backward (reduce-scatter, SUM)
=================  ===========================  ===============================================
equal              one ``all_gather_single``    gloo: one ``all_to_all_single`` + local sum;
                                                NCCL: one ``reduce_scatter_single``
uneven             gloo: one broadcast per      one ``all_to_all_single`` with split sizes
                   non-empty rank, straight     + local sum
                   into the output;
                   NCCL: one ``all_to_all_single``
=================  ===========================  ===============================================

On gloo, ``reduce_scatter_single`` measured about 1.7x slower than all-to-all + sum, and the
uneven all-to-all forward (which must repeat the local rows for every destination) about
2x slower than broadcasting each rank's rows into place.

The collective names changed in torch 2.13 (``all_gather_into_tensor`` → ``all_gather_single``,
``reduce_scatter_tensor`` → ``reduce_scatter_single``); the installed torch's own names are
used so that no deprecation warning is raised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["gather_rows", "gather_rows_with_status", "reduce_scatter_rows"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# gloo and NCCL have no bool reduction; bool rows travel as uint8 (same bytes).
_WIRE_DTYPE = {torch.bool: torch.uint8}


def _to_wire(x: Tensor) -> Tensor:
    wire_dtype = _WIRE_DTYPE.get(x.dtype)
    return x.contiguous() if wire_dtype is None else x.contiguous().view(wire_dtype)


def _is_nccl(group: ProcessGroup | None) -> bool:
    return dist.get_backend(group) == dist.Backend.NCCL


def gather_rows(x: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's rows (dim 0) in rank order.

    Shape:
        x: ``(sizes[rank], *rest)`` → ``(sum(sizes), *rest)``
    """
    world_size = len(sizes)
    wire = _to_wire(x)
    out = wire.new_empty((sum(sizes), *x.shape[1:]))
    if min(sizes) == max(sizes):
        _all_gather_single(out, wire, group=group)
    elif _is_nccl(group):
        send = wire.repeat(world_size, *([1] * (wire.ndim - 1)))  # the same rows for every peer
        dist.all_to_all_single(
            out, send, output_split_sizes=list(sizes), input_split_sizes=[sizes[rank]] * world_size, group=group
        )
    else:
        start = 0
        for owner, size in enumerate(sizes):
            block = out[start : start + size]
            start += size
            if size == 0:
                continue  # every rank knows the sizes, so all skip the same broadcasts
            if owner == rank:
                block.copy_(wire)
            dist.broadcast(block, src=dist.get_global_rank(group, owner) if group is not None else owner, group=group)
    return out.view(x.dtype) if out.dtype != x.dtype else out


def reduce_scatter_rows(grad: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None) -> Tensor:
    """Sum over ranks of the gradient rows that belong to this rank (reduce-scatter, SUM).

    Shape:
        grad: ``(sum(sizes), *rest)`` → ``(sizes[rank], *rest)``
    """
    world_size = len(sizes)
    grad = grad.contiguous()
    local = sizes[rank]
    if min(sizes) == max(sizes) and _is_nccl(group):
        out = grad.new_empty((local, *grad.shape[1:]))
        _reduce_scatter_single(out, grad, group=group)
        return out
    received = grad.new_empty((world_size * local, *grad.shape[1:]))
    dist.all_to_all_single(
        received, grad, output_split_sizes=[local] * world_size, input_split_sizes=list(sizes), group=group
    )
    return received.view(world_size, local, *grad.shape[1:]).sum(0)


def gather_rows_with_status(
    x: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None, ok: bool
) -> tuple[Tensor, list[int]]:
    """Like :func:`gather_rows`, with one status row per rank riding on the same collective.

    Used when the caller promised ``sizes`` (no size exchange): a rank whose tensor does not
    have ``sizes[rank]`` rows sends zeros of the promised size with a raised status instead,
    so the transport never sees a size mismatch and *every* rank learns of the problem.

    Returns:
        The gathered rows (meaningless if any status is raised) and the ranks whose status is raised.
    """
    rest = x.shape[1:]
    payload = _to_wire(x) if ok else _to_wire(x.new_zeros((sizes[rank], *rest)))
    framed = payload.new_zeros((payload.shape[0] + 1, *rest))
    framed[:-1] = payload
    framed[-1] = 0 if ok else 1
    framed_sizes = [size + 1 for size in sizes]
    received = gather_rows(framed, framed_sizes, rank, group)
    ends = torch.tensor(framed_sizes).cumsum(0)
    status_rows = received[ends - 1].reshape(len(sizes), -1)
    failed = [int(r) for r in torch.nonzero(status_rows.ne(0).any(dim=1)).flatten().tolist()]
    if failed:
        return received, failed
    data = torch.cat([segment[:-1] for segment in received.split(framed_sizes)])
    return (data.view(x.dtype) if data.dtype != x.dtype else data), failed
