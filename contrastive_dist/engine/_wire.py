"""Raw, non-differentiable transport used by the gather; no padding ever goes on the wire.

Routes, chosen by measurement on gloo (``benchmarks/gather.py``; 2 and 4 CPU processes,
2048 × 512 fp32 rows each) and by what NCCL does best:

============  ====================================  ============================================
tensors       forward (gather rows)                 backward (reduce-scatter, SUM)
============  ====================================  ============================================
CPU (gloo)    one broadcast per non-empty rank,     one ``all_to_all_single`` with split sizes,
              straight into its place in the        then a local sum over ranks
              output (async, then wait)
accelerator   equal sizes: ``all_gather_single``    equal sizes: ``reduce_scatter_single``;
(NCCL)        uneven: ``all_to_all_single``         uneven: ``all_to_all_single`` + local sum
============  ====================================  ============================================

On gloo the broadcasts measured 1.2-1.6x faster than ``all_gather_single`` (and 2x faster
than an uneven all-to-all, which must repeat the local rows once per peer), and the
all-to-all backward 1.7-2x faster than ``reduce_scatter_single``.

**Forcing the accelerator routes on CPU.** With the environment variable
``CONTRASTIVE_DIST_ROUTE=collective``, CPU tensors take the accelerator routes too (gloo runs
``all_gather_single`` on equal sizes, ``reduce_scatter_single`` and uneven ``all_to_all_single``),
so the routes a GPU user gets run in the test suite on CPU. It is read each time a collective
runs, so a process can switch per call; unset or ``auto`` chooses by device as above. Every
rank of a group must see the same value (the routes do not interoperate).

The collective names changed in torch 2.13 (``all_gather_into_tensor`` → ``all_gather_single``,
``reduce_scatter_tensor`` → ``reduce_scatter_single``); the installed torch's own names are
used so that no deprecation warning is raised.

Every collective here is wrapped twice (see ``_faults`` and ``_settle``): a transport failure
becomes a :class:`~contrastive_dist.engine._faults.PeerFailureError` naming the operation and the
peer, and a call on CPU tensors returns only once gloo has let go of them, so that no package
tensor is freed by a gloo thread at interpreter exit. :func:`all_gather_single` and
:func:`all_reduce` are those wrapped forms of the raw collectives, for the package's other layers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from einops import reduce, repeat
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._faults import naming_peers, wait_named
from contrastive_dist.engine._settle import settled

__all__ = [
    "ROUTE_VARIABLE",
    "all_gather_single",
    "all_reduce",
    "gather_rows",
    "reduce_scatter_rows",
]

ROUTE_VARIABLE = "CONTRASTIVE_DIST_ROUTE"
"""Environment variable: ``collective`` forces the accelerator routes for CPU tensors; ``auto`` / unset: by device."""
_ROUTES = ("auto", "collective")

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_single(
    output: Tensor, input: Tensor, group: ProcessGroup | None = None, *, operation: str = "all-gather"
) -> None:
    """Equal-size all-gather of ``input`` into ``output`` (rank order), named on failure, settled.

    Shape:
        input: ``(n, *rest)`` → output: ``(world_size · n, *rest)``
    """
    gather = _all_gather_single
    _named_and_settled(
        operation, group, lambda views: gather(views[0], views[1], group=group, async_op=True), (output, input)
    )


def all_reduce(tensor: Tensor, group: ProcessGroup | None = None, *, operation: str = "all-reduce") -> None:
    """Sum ``tensor`` over the ranks, in place, named on failure, settled."""
    _named_and_settled(
        operation,
        group,
        lambda views: dist.all_reduce(views[0], op=dist.ReduceOp.SUM, group=group, async_op=True),
        (tensor,),
    )


def _named_and_settled(
    operation: str, group: ProcessGroup | None, post: Callable[[list[Tensor]], dist.Work | None],
    tensors: Sequence[Tensor],
) -> None:
    """The wrappers of every collective here: ``post(views)``, waited on by ``wait_named``, settled.

    ``post`` runs the collective with ``async_op=True``; the wait is named on failure and watches
    for ranks gone elsewhere (``_faults``); the call returns once gloo let go of the views (``_settle``).
    """
    sliced = all(tensor.device.type == "cpu" for tensor in tensors)
    with naming_peers(operation, group):  # a failure while posting
        settled(lambda views: wait_named(post(views), operation, group, sliced=sliced), tensors)


def _source_operation(owner: int, rank: int) -> tuple[str, tuple[int, ...] | None]:
    """A broadcast of ``owner``'s rows, named by its one peer, the source (this rank's own: all of them)."""
    source = "this rank's rows" if owner == rank else f"rank {owner}'s rows"
    return f"gather (broadcast of {source})", None if owner == rank else (owner,)


# gloo and NCCL have no bool reduction; bool rows travel as uint8 (same bytes).
_WIRE_DTYPE = {torch.bool: torch.uint8}


def _to_wire(x: Tensor) -> Tensor:
    wire_dtype = _WIRE_DTYPE.get(x.dtype)
    return x.contiguous() if wire_dtype is None else x.contiguous().view(wire_dtype)


def _on_accelerator(x: Tensor) -> bool:
    """Accelerator tensors (NCCL and friends) take the single-collective routes; CPU ones (gloo) the measured ones.

    Decided by the tensor, not the backend name: a group created as ``"cpu:gloo,cuda:nccl"``
    serves both, and the device tells which of its backends runs the collective.
    ``CONTRASTIVE_DIST_ROUTE=collective`` sends CPU tensors the accelerator way too.
    """
    return x.device.type != "cpu" or _forced_route() == "collective"


def _forced_route() -> str:
    route = os.environ.get(ROUTE_VARIABLE, "") or "auto"
    if route not in _ROUTES:
        raise ValueError(f"{ROUTE_VARIABLE} must be one of {_ROUTES} (or unset), got {route!r}")
    return route


def _global_rank(group: ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def gather_rows(x: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's rows (dim 0) in rank order.

    Shape:
        x: ``(sizes[rank], *rest)`` → ``(sum(sizes), *rest)``
    """
    world_size = len(sizes)
    wire = _to_wire(x)
    out = wire.new_empty((sum(sizes), *x.shape[1:]))
    if out.numel() == 0:
        pass  # nothing to move (no rows, or rows of zero width), as every rank knows: no collective
    elif not _on_accelerator(x):
        settled(lambda views: _broadcast_blocks(views[0], wire, sizes, rank, group), (out,))
    elif min(sizes) == max(sizes):
        all_gather_single(out, wire, group=group, operation="gather")
    else:
        # The same rows for every peer; contiguous, since for one row einops returns a stride-0 view.
        send = repeat(wire, "n ... -> (peer n) ...", peer=world_size).contiguous()
        _named_and_settled(
            "gather",
            group,
            lambda views: dist.all_to_all_single(
                views[0], views[1], output_split_sizes=list(sizes), input_split_sizes=[sizes[rank]] * world_size,
                group=group, async_op=True,
            ),
            (out, send),
        )
    return out.view(x.dtype) if out.dtype != x.dtype else out


def _broadcast_blocks(out: Tensor, wire: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None) -> None:
    """gloo: every non-empty rank broadcasts its rows straight into its block of ``out`` (async, then wait).

    The other ranks' broadcasts are waited on first: a failed one names its source, the one rank
    it talked to (this rank's own broadcast talks to all of them).
    """
    works: list[tuple[int, dist.Work]] = []
    with naming_peers("gather", group):
        for owner, block in enumerate(out.split(list(sizes))):
            if block.shape[0] == 0:
                continue  # every rank knows the sizes, so all skip the same broadcasts
            if owner == rank:
                block.copy_(wire)
            work = dist.broadcast(block, src=_global_rank(group, owner), group=group, async_op=True)
            if work is not None:
                works.append((owner, work))
    works.sort(key=lambda pending: pending[0] == rank)  # stable: the others in rank order, this rank's last
    for owner, work in works:
        operation, peers = _source_operation(owner, rank)
        wait_named(work, operation, group, peers=peers)


def reduce_scatter_rows(grad: Tensor, sizes: Sequence[int], rank: int, group: ProcessGroup | None) -> Tensor:
    """Sum over ranks of the gradient rows that belong to this rank (reduce-scatter, SUM).

    Shape:
        grad: ``(sum(sizes), *rest)`` → ``(sizes[rank], *rest)``
    """
    world_size = len(sizes)
    grad = grad.contiguous()
    local = sizes[rank]
    if grad.numel() == 0:  # no rows, or rows of zero width: every rank skips the collective alike
        return grad.new_zeros((local, *grad.shape[1:]))
    operation = "gather backward (reduce-scatter of the gradient rows)"
    if min(sizes) == max(sizes) and _on_accelerator(grad):
        out = grad.new_empty((local, *grad.shape[1:]))
        scatter = _reduce_scatter_single
        _named_and_settled(
            operation, group, lambda views: scatter(views[0], views[1], group=group, async_op=True), (out, grad)
        )
        return out
    received = grad.new_empty((world_size * local, *grad.shape[1:]))
    _named_and_settled(
        operation,
        group,
        lambda views: dist.all_to_all_single(
            views[0], views[1], output_split_sizes=[local] * world_size, input_split_sizes=list(sizes), group=group,
            async_op=True,
        ),
        (received, grad),
    )
    return reduce(received, "(peer n) ... -> n ...", "sum", peer=world_size)
