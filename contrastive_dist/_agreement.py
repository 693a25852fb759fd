"""Make sure every rank agrees on what is gathered *before* any data moves.

A mismatch that reaches the transport hangs NCCL and aborts gloo (SIGABRT). So each rank
first describes its input in three integers — a status, its row count and a hash of
(dtype, trailing shape, dim) — and one small equal-size all-gather shares them. Every rank
then sees the same table and either proceeds with the sizes or raises the same error. Only
on that error path a second exchange fetches readable descriptions for the message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._wire import _all_gather_single

__all__ = ["Problem", "agree_on_sizes", "describe", "local_problem", "raise_disagreement", "signature"]

_OK, _PROBLEM = 0, 1

Problem = tuple[type[Exception], str]
"""An exception class and its message, found on one rank and raised on all of them."""


def local_problem(tensors: Sequence[object], dim: int) -> Problem | None:
    """What is wrong with this rank's inputs, judged without talking to other ranks."""
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
    checked = cast(Sequence[Tensor], tensors)
    first = checked[0]
    for index, tensor in enumerate(checked):
        if tensor.shape[dim] != first.shape[dim]:
            return ValueError, (
                f"all tensors must have the same size along dim={dim}: tensors[0] has "
                f"{first.shape[dim]}, tensors[{index}] has {tensor.shape[dim]}"
            )
    return None


def describe(tensors: Sequence[object]) -> str:
    """Short human description of the inputs, e.g. ``float32 (5, 8)``."""
    parts = []
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            parts.append(f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}")
        else:
            parts.append(type(tensor).__name__)
    return ", ".join(parts)


def signature(tensors: Sequence[Tensor], dim: int) -> int:
    """63-bit digest of everything except the gathered size that must match across ranks."""
    parts = []
    for tensor in tensors:
        dim_index = dim % tensor.ndim
        trailing = tuple(size for axis, size in enumerate(tensor.shape) if axis != dim_index)
        parts.append((str(tensor.dtype), tensor.ndim, dim_index, trailing))
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def metadata_device(group: ProcessGroup | None) -> torch.device:
    """Where a small control tensor must live for the group's backend."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_sizes(
    tensors: Sequence[object],
    dim: int,
    problem: Problem | None,
    group: ProcessGroup | None,
    world_size: int,
) -> tuple[int, ...]:
    """Exchange row counts and input signatures; return the per-rank sizes or raise on all ranks."""
    if problem is None:
        checked = cast(Sequence[Tensor], tensors)
        row = [_OK, checked[0].shape[dim], signature(checked, dim)]
    else:
        row = [_PROBLEM, 0, 0]
    local = torch.tensor([row], dtype=torch.int64, device=metadata_device(group))
    table = local.new_empty((world_size, 3))
    _all_gather_single(table, local, group=group)
    rows = table.tolist()
    statuses = [status for status, _, _ in rows]
    signatures = {digest for status, _, digest in rows if status == _OK}
    if any(statuses) or len(signatures) > 1:
        raise_disagreement(tensors, dim, problem, group, world_size)
    return tuple(int(size) for _, size, _ in rows)


def raise_disagreement(
    tensors: Sequence[object],
    dim: int,
    problem: Problem | None,
    group: ProcessGroup | None,
    world_size: int,
) -> None:
    """Every rank calls this together: share readable descriptions, raise the same error."""
    mine = (problem[0].__name__ if problem else "", problem[1] if problem else f"{describe(tensors)}, dim={dim}")
    everyone: list[tuple[str, str] | None] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    lines = []
    kind: type[Exception] = ValueError
    for rank, entry in enumerate(everyone):
        error_name, text = cast(tuple[str, str], entry)
        if error_name == "TypeError":
            kind = TypeError
        lines.append(f"  rank {rank}: {'ERROR ' if error_name else ''}{text}")
    raise kind(
        "all_gather: the ranks' inputs do not agree (each rank must pass a tensor; the dtype and every "
        "dimension except the gathered one must match on all ranks, and so must any given sizes):\n"
        + "\n".join(lines)
    )
