"""The one exchange that makes every rank agree before any data moves, or raise the same error everywhere.

A mismatch that reaches a transport hangs NCCL and aborts gloo (SIGABRT). So a caller first
checks its own inputs and collects a problem (or none), then calls :func:`agree` once. It shares
one row of int64 per rank in a single small all-gather (``_agreement_row``): whether this rank found
its input invalid; its row count (and a second count, e.g. its own negatives); a few bits of facts
about its input that every rank needs (e.g. whether its keys are small integers); a digest of the
dtype, trailing shape, device type and gradient tracking of every tensor it passes; a digest of the
call's options (temperature, chunk size, communication, which optional tensors are passed, ...);
a digest of the ``sizes=`` (and ``text_sizes=``) it was given; the number of this call among the rank's agreements on
the group; one float summed over the ranks (a weight total); and up to two scalar values that must
be equal on every rank (a loss's ``logit_scale`` and ``logit_bias``). Every rank then holds the same
table and either returns the same :class:`Layout` or raises the same ``ValueError``/``TypeError``,
which names the rank at fault and lists every rank's inputs and options (``_agreement_errors``).
The caller's transport consumes the layout without exchanging again.

Before anything is built on a device, this rank's input is checked to live on a device type the
group serves (``_agreement_inputs``): a rank with an input elsewhere sends its problem instead of
failing alone. A rank whose earlier call left before its exchange (it raised there, and the error
was caught) is named a call behind at the next one, and the ranks are in step again after it.

On an accelerator the exchange costs one host sync, the read of the table: this rank's row leaves
pinned host memory without waiting, and the parts only the device holds (the total, the scalars, a
flag computed from device data) are written into it on the device.

Without a process group (or with one rank) nothing is exchanged and a problem is raised as it is.
Under ``torch.compile`` nothing is exchanged either (the exchange is data-dependent): ``sizes=``
(and a second count's ``text_sizes=``) must be given and are trusted, and a total is all-reduced
with a traceable collective.

``CONTRASTIVE_DIST_DEBUG=1`` (in the spirit of ``TORCH_DISTRIBUTED_DEBUG``) makes
:func:`~contrastive_dist.all_gather` verify caller-given ``sizes=`` with this exchange too, on
the one path that skips it (see its ``sizes`` argument). Set it on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import GroupLike, get_rank, get_world_size, process_group, start_offset
from contrastive_dist._validation import Problem, sizes_problem
from contrastive_dist.engine._agreement_errors import DEBUG_VARIABLE, raise_everywhere
from contrastive_dist.engine._agreement_inputs import (
    describe,
    device_problem,
    digest,
    local_problem,
    signature,
    table_device,
)
from contrastive_dist.engine._agreement_row import FIELDS, OK, PROBLEM, Row, local_row
from contrastive_dist.engine._progress import next_call, resync_calls
from contrastive_dist.engine._wire import all_gather_single

__all__ = ["DEBUG_VARIABLE", "Layout", "Problem", "agree", "debug_checks", "describe", "local_problem", "signature"]

_NO_SIZES = 0


class Layout(NamedTuple):
    """What every rank agreed on: where this rank stands and how many rows every rank holds.

    Attributes:
        rank: this process's rank in ``group``.
        world_size: the number of ranks ``W``.
        sizes: every rank's row count, in rank order.
        extra_sizes: every rank's second count (e.g. own negatives); zeros when not used.
        total: the sum over ranks of each rank's ``total`` (a 0-d tensor), or ``None``.
        group: the process group (``None``: the world).
        flags: every rank's ``flags``; empty under ``torch.compile`` (nothing was exchanged).
    """

    rank: int
    world_size: int
    sizes: tuple[int, ...]
    extra_sizes: tuple[int, ...]
    total: Tensor | None
    group: ProcessGroup | None
    flags: tuple[int, ...] = ()

    def every_rank_has(self, flag: int) -> bool:
        """Whether every rank set ``flag`` (``False`` when the flags are unknown)."""
        return bool(self.flags) and all(flags & flag for flags in self.flags)

    @property
    def offset(self) -> int:
        """Index of this rank's first row among every rank's rows."""
        return start_offset(self.sizes, self.rank)


def debug_checks() -> bool:
    """Whether ``CONTRASTIVE_DIST_DEBUG=1``: caller-given sizes of :func:`~contrastive_dist.all_gather` are verified."""
    value = os.environ.get(DEBUG_VARIABLE, "") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{DEBUG_VARIABLE} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def agree(
    tensors: Sequence[object],
    *,
    problem: Problem | None,
    group: GroupLike,
    operation: str = "all_gather",
    dim: int = 0,
    options: Mapping[str, object] | None = None,
    sizes: Sequence[int] | None = None,
    extra: int = 0,
    extra_sizes: Sequence[int] | None = None,
    total: Tensor | None = None,
    flags: int | Tensor = 0,
    rows: int | None = None,
    compare_inputs: bool = True,
    scalars: Mapping[str, Tensor] | None = None,
) -> Layout:
    """Exchange once; return the :class:`Layout` every rank agrees on, or raise the same error on every rank.

    Args:
        tensors: what this rank passes (rows along ``dim`` counted from the first); described in errors.
        problem: what this rank found wrong with its own input, or ``None``.
        group: the group (a mesh too), resolved here once: the layout holds its process group.
        operation: the public name of the call, for messages (``"info_nce"``, ``"all_gather"``).
        dim: the dimension rows are counted along.
        options: the call's options that must be the same on every rank (numbers, strings, flags).
        sizes: the caller's ``sizes=``, checked to be the same on every rank and equal to the rows.
        extra: this rank's second count (e.g. its own negatives).
        extra_sizes: the caller's every-rank second counts (a loss's ``text_sizes=``), checked like ``sizes``.
        total: a 0-d tensor to sum over the ranks (e.g. a weight total), or ``None``.
        flags: bits this rank tells every rank (see :meth:`Layout.every_rank_has`); a 0-d int64
            tensor for bits computed on the device (read there only with one rank).
        rows: this rank's row count, when not that of ``tensors[0]`` along ``dim``.
        compare_inputs: whether the tensors' dtypes, trailing shapes and gradient tracking must
            match across ranks (``False``: inputs that may legitimately differ, such as token
            batches padded per rank).
        scalars: up to two named 0-d tensors whose values must be equal on every rank (a loss's
            ``logit_scale`` and ``logit_bias``), compared without reading them on the host.
    """
    group = process_group(group)
    world_size, rank = get_world_size(group), get_rank(group)
    exchanged = world_size > 1 and not torch.compiler.is_compiling()
    # Counted first: a call that leaves before its exchange (anything below raised) is still counted.
    call = next_call(group) if exchanged else 0
    if problem is None and sizes is not None:
        problem = sizes_problem(sizes, world_size)
    if problem is None and extra_sizes is not None:
        problem = sizes_problem(extra_sizes, world_size, "text_sizes")
    if exchanged:
        problem = device_problem(tensors, group) or problem  # the root cause of whatever else failed
    if rows is None:
        rows = cast(Tensor, tensors[0]).shape[dim] if problem is None else 0
    if not exchanged:
        layout = _agree_locally(problem, operation, rows, (extra, extra_sizes), sizes, total, group, world_size, rank)
        return layout._replace(flags=(int(flags),)) if world_size == 1 else layout
    named = dict(scalars or {}) if problem is None else {}
    given = None if sizes is None and extra_sizes is None else (tuple(sizes or ()), tuple(extra_sizes or ()))
    everyone = _exchange(tensors, group, world_size, {
        "status": PROBLEM if problem is not None else OK,
        "rows": rows,
        "extra": extra,
        "flags": flags if isinstance(flags, int) else 0,
        "signature": signature(cast(Sequence[Tensor], tensors), dim) if problem is None and compare_inputs else 0,
        # The operation is part of the digest: a rank that calls another operation here (an empty rank
        # that skipped a call) is named as such, not as one with different options.
        "options": digest((operation, sorted((options or {}).items()), sorted(scalars or {}))),
        "sizes": _NO_SIZES if given is None else digest(given),
        "call": call,
    }, operation, total=None if problem is not None else total,
       flags=flags if isinstance(flags, Tensor) and problem is None else None, scalars=list(named.values()))
    agreed_sizes, extra_counts = tuple(row.rows for row in everyone), tuple(row.extra for row in everyone)
    # Every rank decides alike: the same table everywhere, and equal digests mean equal given sizes.
    given_sizes = {row.sizes for row in everyone}
    valid = [row for row in everyone if row.status == OK]
    mismatch = {
        "calls": len({row.call for row in everyone}) > 1,
        "problem": len(valid) < len(everyone),
        "options": len({row.options for row in everyone}) > 1,
        "inputs": len({row.signature for row in everyone}) > 1,
        "sizes": len(given_sizes) > 1 or (sizes is not None and tuple(sizes) != agreed_sizes)
        or (extra_sizes is not None and tuple(extra_sizes) != extra_counts),
        "scalars": any(not row.same_scalars(valid[0]) for row in valid),
    }
    if mismatch["calls"]:
        resync_calls(group, max(row.call for row in everyone))  # in step again: the next call works
    if any(mismatch.values()):
        raise_everywhere(tensors, problem, options, given, group, operation, mismatch, everyone, list(scalars or {}))
    agreed_total = None
    if total is not None:
        summed = sum(row.total for row in everyone)
        agreed_total = torch.full((), summed, dtype=total.dtype, device=total.device)
    agreed_flags = tuple(row.flags for row in everyone)
    return Layout(rank, world_size, agreed_sizes, extra_counts, agreed_total, group, agreed_flags)


def _exchange(
    tensors: Sequence[object],
    group: ProcessGroup | None,
    world_size: int,
    fields: Mapping[str, int],
    operation: str,
    *,
    total: Tensor | None,
    flags: Tensor | None,
    scalars: Sequence[Tensor],
) -> list[Row]:
    """Every rank's row, in rank order: one all-gather, and the exchange's one host sync (the read of the table)."""
    device = table_device(tensors, group)
    table = torch.empty((world_size, FIELDS), dtype=torch.int64, device=device)
    mine = local_row(fields, device, total=total, flags=flags, scalars=scalars)
    # Named "agreement (...)": one kind of collective whatever the operation, as the rows of every operation meet.
    all_gather_single(table, mine, group=group, operation=f"agreement ({operation})")
    return [Row.read(values) for values in table.tolist()]


def _agree_locally(
    problem: Problem | None,
    operation: str,
    rows: int,
    extra: tuple[int, Sequence[int] | None],
    sizes: Sequence[int] | None,
    total: Tensor | None,
    group: ProcessGroup | None,
    world_size: int,
    rank: int,
) -> Layout:
    """One rank, or under ``torch.compile``: nothing to exchange; given sizes are checked or trusted.

    ``extra``: this rank's second count, and every rank's as the caller gave them (``text_sizes=``) or None.
    """
    count, extra_sizes = extra
    if problem is not None:
        raise problem[0](f"{operation}: {problem[1]}")
    if world_size == 1:
        for name, given, held in (("sizes", sizes, rows), ("text_sizes", extra_sizes, count)):
            if given is not None and tuple(given) != (held,):
                raise ValueError(f"{operation}: {name}={tuple(given)} was given, but the input has {held} rows")
        return Layout(rank, 1, (rows,), (count,), total, group)
    if sizes is None:
        raise ValueError(f"{operation} under torch.compile needs sizes= (exchanging them is data-dependent)")
    if count and extra_sizes is None:
        raise ValueError(f"{operation} under torch.compile cannot exchange the count of this rank's own negatives")
    if total is not None:
        import torch.distributed._functional_collectives as funcol

        total = funcol.all_reduce(total, "sum", cast(ProcessGroup, group or dist.group.WORLD))
    extra_counts = (0,) * world_size if extra_sizes is None else tuple(extra_sizes)
    return Layout(rank, world_size, tuple(sizes), extra_counts, total, group)
