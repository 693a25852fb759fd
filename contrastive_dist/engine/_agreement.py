"""The one exchange that makes every rank agree before any data moves, or raise the same error everywhere.

A mismatch that reaches a transport hangs NCCL and aborts gloo (SIGABRT). So a caller first
checks its own inputs and collects a problem (or none), then calls :func:`agree` once. It shares
one row of eight int64 per rank in a single small all-gather:

    status, rows, extra rows, flags, signature, options digest, given-sizes digest, total

— whether this rank found its input invalid; its row count (and a second count, e.g. its own
negatives); a few bits of facts about its input that every rank needs (e.g. whether its keys are
small integers); a digest of the dtype, trailing shape and gradient tracking of every tensor it
passes; a digest of the call's options (temperature, chunk size, communication, which optional
tensors are passed, ...); a digest of the ``sizes=`` it was given; and one float summed over the
ranks (a weight total), carried as its float64 bits. Every rank then holds the same table and
either returns the same :class:`Layout` or raises the same ``ValueError``/``TypeError``, which
names the rank at fault and lists every rank's inputs and options (fetched by a second exchange,
on that error path only). The caller's transport consumes the layout without exchanging again.

On an accelerator the exchange costs one host sync, the read of the table: this rank's row leaves
pinned host memory without waiting, and the parts only the device holds (the total, a flag computed
from device data) are written into it on the device.

Without a process group (or with one rank) nothing is exchanged and a problem is raised as it is.
Under ``torch.compile`` nothing is exchanged either (the exchange is data-dependent): ``sizes=``
must be given and is trusted, and a total is all-reduced with a traceable collective.

``CONTRASTIVE_DIST_DEBUG=1`` (in the spirit of ``TORCH_DISTRIBUTED_DEBUG``) makes
:func:`~contrastive_dist.all_gather` verify caller-given ``sizes=`` with this exchange too, on
the one path that skips it (see its ``sizes`` argument). Set it on every rank.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import GroupLike, get_rank, get_world_size, process_group, start_offset
from contrastive_dist._validation import Problem, sizes_problem
from contrastive_dist.engine._faults import naming_peers
from contrastive_dist.engine._wire import all_gather_single

__all__ = ["DEBUG_VARIABLE", "Layout", "Problem", "agree", "debug_checks", "describe", "local_problem", "signature"]

_OK, _PROBLEM = 0, 1
_NO_SIZES = 0
_STATUS, _ROWS, _EXTRA, _FLAGS, _SIGNATURE, _OPTIONS, _SIZES, _TOTAL = range(8)
_FIELDS = 8

DEBUG_VARIABLE = "CONTRASTIVE_DIST_DEBUG"
"""Environment variable: ``1`` verifies caller-given ``sizes=`` with one extra exchange; ``0`` / unset: off."""

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


def local_problem(tensors: Sequence[object], dim: int) -> Problem | None:
    """What is wrong with this rank's tensors to gather, judged without talking to other ranks."""
    if len(tensors) == 0:
        return ValueError, "expected at least one tensor, got none"
    for index, tensor in enumerate(tensors):
        name = "input" if len(tensors) == 1 else f"tensors[{index}]"
        if not isinstance(tensor, Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(tensor).__name__}"
        if tensor.ndim == 0:
            return ValueError, f"{name} must have at least one dimension, got a 0-d tensor"
        if not -tensor.ndim <= dim < tensor.ndim:
            return ValueError, f"dim={dim} is out of range for {name} of shape {tuple(tensor.shape)}"
    first = cast(Tensor, tensors[0])
    for index, tensor in enumerate(cast(Sequence[Tensor], tensors)):
        if tensor.shape[dim] != first.shape[dim]:
            return ValueError, (
                f"all tensors must have the same size along dim={dim}: tensors[0] has "
                f"{first.shape[dim]}, tensors[{index}] has {tensor.shape[dim]}"
            )
    return None


def _tracks_grad(tensor: Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


def describe(tensors: Sequence[object]) -> str:
    """Short human description of the inputs, e.g. ``float32 (5, 8)``."""
    parts = []
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            grad = " requires_grad" if _tracks_grad(tensor) else ""
            parts.append(f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}{grad}")
        else:
            parts.append(type(tensor).__name__)
    return ", ".join(parts)


def _digest(value: object) -> int:
    """A 62-bit digest of ``repr(value)``, never 0."""
    return (int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2) + 1


def signature(tensors: Sequence[Tensor], dim: int) -> int:
    """Digest of everything except the size along ``dim`` that must match across ranks.

    Whether autograd tracks each tensor is part of it: a rank whose gathered tensor has no graph
    never enters the backward collective the other ranks wait in, so a mismatch must fail here.
    """
    parts = []
    for tensor in tensors:
        dim_index = dim % tensor.ndim
        trailing = tuple(size for axis, size in enumerate(tensor.shape) if axis != dim_index)
        parts.append((str(tensor.dtype), tensor.ndim, dim_index, trailing, _tracks_grad(tensor)))
    return _digest(parts)


def _device(tensors: Sequence[object], group: ProcessGroup | None) -> torch.device:
    """Where the small table lives: beside the data, on the device the backend serves.

    The input's own device, not ``torch.cuda.current_device()``: a process that never called
    ``torch.cuda.set_device`` would otherwise put every rank's table on ``cuda:0``.
    """
    first = tensors[0] if len(tensors) else None
    if isinstance(first, Tensor):
        return first.device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_row(local: Sequence[int], device: torch.device) -> Tensor:
    """The local row of the table on ``device``; on an accelerator from pinned memory, without waiting."""
    row = torch.tensor([local], dtype=torch.int64)
    if device.type == "cpu":
        return row
    pinned = torch.empty(row.shape, dtype=torch.int64, pin_memory=True)
    pinned.copy_(row)
    return pinned.to(device, non_blocking=True)


def _bits_float(bits: int) -> float:
    return cast(float, struct.unpack("<d", struct.pack("<q", bits))[0])


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
    total: Tensor | None = None,
    flags: int | Tensor = 0,
    rows: int | None = None,
    compare_inputs: bool = True,
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
        total: a 0-d tensor to sum over the ranks (e.g. a weight total), or ``None``.
        flags: bits this rank tells every rank (see :meth:`Layout.every_rank_has`); a 0-d int64
            tensor for bits computed on the device (read there only with one rank).
        rows: this rank's row count, when not that of ``tensors[0]`` along ``dim``.
        compare_inputs: whether the tensors' dtypes, trailing shapes and gradient tracking must
            match across ranks (``False``: inputs that may legitimately differ, such as token
            batches padded per rank).
    """
    group = process_group(group)
    world_size, rank = get_world_size(group), get_rank(group)
    if problem is None and sizes is not None:
        problem = sizes_problem(sizes, world_size)
    if rows is None:
        rows = cast(Tensor, tensors[0]).shape[dim] if problem is None else 0
    if world_size == 1 or torch.compiler.is_compiling():
        layout = _agree_locally(problem, operation, rows, extra, sizes, total, group, world_size, rank)
        return layout._replace(flags=(int(flags),)) if world_size == 1 else layout
    local = [
        _PROBLEM if problem is not None else _OK,
        rows,
        extra,
        flags if isinstance(flags, int) else 0,
        signature(cast(Sequence[Tensor], tensors), dim) if problem is None and compare_inputs else 0,
        # The operation is part of the digest: a rank that calls another operation here (an empty rank
        # that skipped a call) is named as such, not as one with different options.
        _digest((operation, sorted((options or {}).items()))),
        _NO_SIZES if sizes is None else _digest(tuple(sizes)),
        0,  # the total's bits, written on the device below
    ]
    table = torch.empty((world_size, _FIELDS), dtype=torch.int64, device=_device(tensors, group))
    mine = _local_row(local, table.device)
    if total is not None:  # its float64 bits, without reading it on the host
        mine[0, _TOTAL] = total.detach().to(device=table.device, dtype=torch.float64).reshape(()).view(torch.int64)
    if isinstance(flags, Tensor):
        mine[0, _FLAGS] = flags.to(device=table.device, dtype=torch.int64).reshape(())
    all_gather_single(table, mine, group=group, operation="agreement")
    everyone = table.tolist()  # the exchange's one host sync
    agreed_sizes = tuple(int(row[_ROWS]) for row in everyone)
    # Every rank decides alike: the same table everywhere, and equal digests mean equal given sizes.
    given_sizes = {row[_SIZES] for row in everyone}
    mismatch = {
        "problem": any(row[_STATUS] != _OK for row in everyone),
        "options": len({row[_OPTIONS] for row in everyone}) > 1,
        "inputs": len({row[_SIGNATURE] for row in everyone}) > 1,
        "sizes": len(given_sizes) > 1 or (sizes is not None and tuple(sizes) != agreed_sizes),
    }
    if any(mismatch.values()):
        same_sizes_given = len(given_sizes) == 1
        _raise_everywhere(tensors, problem, options, sizes, group, world_size, operation, mismatch,
                          agreed_sizes if same_sizes_given else None)
    agreed_total = None
    if total is not None:
        summed = sum(_bits_float(int(row[_TOTAL])) for row in everyone)
        agreed_total = torch.full((), summed, dtype=total.dtype, device=total.device)
    extra_sizes = tuple(int(row[_EXTRA]) for row in everyone)
    agreed_flags = tuple(int(row[_FLAGS]) for row in everyone)
    return Layout(rank, world_size, agreed_sizes, extra_sizes, agreed_total, group, agreed_flags)


def _agree_locally(
    problem: Problem | None,
    operation: str,
    rows: int,
    extra: int,
    sizes: Sequence[int] | None,
    total: Tensor | None,
    group: ProcessGroup | None,
    world_size: int,
    rank: int,
) -> Layout:
    """One rank, or under ``torch.compile``: nothing to exchange; given sizes are checked or trusted."""
    if problem is not None:
        raise problem[0](f"{operation}: {problem[1]}")
    if world_size == 1:
        if sizes is not None and tuple(sizes) != (rows,):
            raise ValueError(f"{operation}: sizes={tuple(sizes)} was given, but the input has {rows} rows")
        return Layout(rank, 1, (rows,), (extra,), total, group)
    if sizes is None:
        raise ValueError(f"{operation} under torch.compile needs sizes= (exchanging them is data-dependent)")
    if extra:
        raise ValueError(f"{operation} under torch.compile cannot exchange the count of this rank's own negatives")
    if total is not None:
        import torch.distributed._functional_collectives as funcol

        total = funcol.all_reduce(total, "sum", cast(ProcessGroup, group or dist.group.WORLD))
    return Layout(rank, world_size, tuple(sizes), (0,) * world_size, total, group)


def _raise_everywhere(
    tensors: Sequence[object],
    problem: Problem | None,
    options: Mapping[str, object] | None,
    sizes: Sequence[int] | None,
    group: ProcessGroup | None,
    world_size: int,
    operation: str,
    mismatch: Mapping[str, bool],
    rows: tuple[int, ...] | None,
) -> None:
    """Every rank calls this together: share readable descriptions, raise the same error.

    ``rows``: every rank's rows, when every rank was given the same ``sizes=`` (else ``None``).
    """
    described = describe(tensors)
    if mismatch["sizes"]:
        described += f", sizes={tuple(sizes)}" if sizes is not None else ", no sizes="
    mine = {
        "kind": problem[0].__name__ if problem else "",
        "text": problem[1] if problem else described,
        "options": dict(options or {}),
        "operation": operation,
    }
    gathered: list[Any] = [None] * world_size
    with naming_peers("agreement (exchange of the error descriptions)", group):
        dist.all_gather_object(gathered, mine, group=group)
    failing = [rank for rank, entry in enumerate(gathered) if entry["kind"]]
    lines = [f"  rank {rank}: {'ERROR ' if entry['kind'] else ''}{entry['text']}"
             for rank, entry in enumerate(gathered)]
    kind: type[Exception] = ValueError
    if failing:
        # A rank found its own input invalid: its message leads, raised with its type everywhere.
        first = gathered[failing[0]]
        kind = {"TypeError": TypeError, "RuntimeError": RuntimeError}.get(first["kind"], ValueError)
        headline = (f"{operation}: {first['text']} (on rank {failing[0]}; raised on every rank of the group). "
                    "Inputs per rank:")
    elif mismatch["options"] and len({entry["operation"] for entry in gathered}) > 1:
        lines = [f"  rank {rank}: {entry['operation']}" for rank, entry in enumerate(gathered)]
        headline = ("the ranks reached one exchange from different operations; every rank must make the same calls "
                    "in the same order (a rank with no rows too):")
    elif mismatch["options"]:
        differing = sorted({key for entry in gathered for key in entry["options"]
                            if len({repr(other["options"].get(key)) for other in gathered}) > 1})
        lines = [f"  rank {rank}: " + ", ".join(f"{key}={entry['options'].get(key)!r}" for key in differing)
                 for rank, entry in enumerate(gathered)]
        headline = f"{operation}: the ranks called it with different options ({', '.join(differing)}); they must match:"
    elif mismatch["sizes"] and rows is not None and sizes is not None:
        headline = f"{operation}: sizes={tuple(sizes)} was given, but the ranks hold {rows} rows. Inputs per rank:"
    elif mismatch["sizes"]:
        why = f" (checked because {DEBUG_VARIABLE}=1)" if operation == "all_gather" else ""
        headline = (f"{operation}: sizes= must be given on every rank or on none, be the same sequence on every "
                    f"rank, and equal each rank's rows{why}. Inputs per rank:")
    else:
        headline = (f"{operation}: the ranks' inputs do not agree: the dtype, every dimension except the "
                    "batch, and whether autograd tracks them must match on all ranks. Inputs per rank:")
    raise kind(headline + "\n" + "\n".join(lines))
