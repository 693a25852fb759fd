"""Make sure every rank agrees on what is gathered *before* any data moves.

A mismatch that reaches the transport hangs NCCL and aborts gloo (SIGABRT). So each rank
first describes its input in four integers — a status, its row count, a hash of
(dtype, trailing shape, dim) and a hash of the ``sizes=`` it was given (0: none) — and one
small equal-size all-gather shares them. Every rank then sees the same table and either
proceeds with the sizes or raises the same error. Only on that error path a second exchange
fetches readable descriptions for the message.

Callers who pass ``sizes=`` skip this exchange. With the environment variable
``CONTRASTIVE_DIST_DEBUG=1`` (in the spirit of ``TORCH_DISTRIBUTED_DEBUG``) they take part in
it too, so ``sizes=`` that differ between ranks, are given on some ranks only, or do not match
the rows raise the same clear error on every rank, for one small collective per gather.
Set it on every rank.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._wire import all_gather_single

__all__ = [
    "DEBUG_VARIABLE",
    "Problem",
    "agree_on_sizes",
    "debug_checks",
    "describe",
    "local_problem",
    "raise_disagreement",
    "signature",
]

_OK, _PROBLEM = 0, 1
_NO_SIZES = 0

DEBUG_VARIABLE = "CONTRASTIVE_DIST_DEBUG"
"""Environment variable: ``1`` verifies caller-given ``sizes=`` with one extra exchange; ``0`` / unset: off."""


def debug_checks() -> bool:
    """Whether ``CONTRASTIVE_DIST_DEBUG=1``: caller-given sizes are verified across ranks."""
    value = os.environ.get(DEBUG_VARIABLE, "") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{DEBUG_VARIABLE} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"

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
            grad = " requires_grad" if _tracks_grad(tensor) else ""
            parts.append(f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}{grad}")
        else:
            parts.append(type(tensor).__name__)
    return ", ".join(parts)


def _tracks_grad(tensor: Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


def signature(tensors: Sequence[Tensor], dim: int) -> int:
    """63-bit digest of everything except the gathered size that must match across ranks.

    Whether autograd tracks each tensor is part of it: a rank whose gathered tensor has no
    graph never enters the backward reduce-scatter that the other ranks wait in, so a mismatch
    must fail here, loudly, rather than hang in backward.
    """
    parts = []
    for tensor in tensors:
        dim_index = dim % tensor.ndim
        trailing = tuple(size for axis, size in enumerate(tensor.shape) if axis != dim_index)
        parts.append((str(tensor.dtype), tensor.ndim, dim_index, trailing, _tracks_grad(tensor)))
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def metadata_device(tensors: Sequence[object], group: ProcessGroup | None) -> torch.device:
    """Where the small control tensor must live: beside the data, which the backend serves.

    The input's own device, not ``torch.cuda.current_device()``: a process that never called
    ``torch.cuda.set_device`` would otherwise put every rank's metadata on ``cuda:0``. A rank
    without a tensor (invalid input) falls back to what the backend needs.
    """
    first = tensors[0] if len(tensors) else None
    if isinstance(first, Tensor):
        return first.device
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sizes_digest(given: Sequence[int] | None) -> int:
    if given is None:
        return _NO_SIZES
    digest = hashlib.blake2b(repr(tuple(given)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) + 1  # never _NO_SIZES


def agree_on_sizes(
    tensors: Sequence[object],
    dim: int,
    problem: Problem | None,
    group: ProcessGroup | None,
    world_size: int,
    given: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Exchange row counts and input signatures; return the per-rank sizes or raise on all ranks.

    ``given``: the caller's ``sizes=`` (debug mode), checked to be the same on every rank and
    equal to the row counts.
    """
    if problem is None:
        checked = cast(Sequence[Tensor], tensors)
        row = [_OK, checked[0].shape[dim], signature(checked, dim), _sizes_digest(given)]
    else:
        row = [_PROBLEM, 0, 0, _sizes_digest(given)]
    local = torch.tensor([row], dtype=torch.int64, device=metadata_device(tensors, group))
    table = local.new_empty((world_size, 4))
    all_gather_single(table, local, group=group)
    rows = table.tolist()
    statuses = [status for status, _, _, _ in rows]
    signatures = {digest for status, _, digest, _ in rows if status == _OK}
    sizes = tuple(int(size) for _, size, _, _ in rows)
    # Every rank decides alike: the digests are the same table everywhere, and equal digests
    # mean equal given sizes, so the comparison with the row counts agrees too.
    given_everywhere = {digest for _, _, _, digest in rows}
    sizes_wrong = len(given_everywhere) > 1 or (given is not None and tuple(given) != sizes)
    if any(statuses) or len(signatures) > 1 or sizes_wrong:
        raise_disagreement(tensors, dim, problem, group, world_size, given=given, sizes_wrong=sizes_wrong)
    return sizes


def raise_disagreement(
    tensors: Sequence[object],
    dim: int,
    problem: Problem | None,
    group: ProcessGroup | None,
    world_size: int,
    *,
    given: Sequence[int] | None = None,
    sizes_wrong: bool = False,
) -> None:
    """Every rank calls this together: share readable descriptions, raise the same error."""
    described = f"{describe(tensors)}, dim={dim}"
    if sizes_wrong:
        described += f", sizes={tuple(given)}" if given is not None else ", no sizes="
    mine = (problem[0].__name__ if problem else "", problem[1] if problem else described)
    everyone: list[tuple[str, str] | None] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    entries = [cast(tuple[str, str], entry) for entry in everyone]
    lines = [f"  rank {rank}: {'ERROR ' if name else ''}{text}" for rank, (name, text) in enumerate(entries)]
    failing = [rank for rank, (name, _) in enumerate(entries) if name]
    if failing:
        # A rank found its own input invalid: its message leads, raised with its type everywhere.
        name, text = entries[failing[0]]
        kind: type[Exception] = TypeError if name == "TypeError" else ValueError
        headline = f"{text} (on rank {failing[0]}; raised on every rank of the group). Inputs per rank:"
    elif sizes_wrong:
        kind = ValueError
        headline = (
            f"all_gather: sizes= must be given on every rank or on none, be the same sequence on every rank, "
            f"and equal each rank's rows (checked because {DEBUG_VARIABLE}=1). Inputs per rank:"
        )
    else:
        kind = ValueError
        headline = (
            "all_gather: the ranks' inputs do not agree: the dtype, every dimension except the gathered "
            "one, and whether autograd tracks them must match on all ranks. Inputs per rank:"
        )
    raise kind(headline + "\n" + "\n".join(lines))
