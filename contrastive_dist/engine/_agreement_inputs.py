"""What the agreement knows of a rank's inputs before any exchange: their problems, digest, description and device.

Everything here is judged on this rank alone and touches no device memory: the agreement
(:mod:`~contrastive_dist.engine._agreement`) first learns whether this rank's inputs live on a
device type its process group serves (:func:`device_problem`), and only then builds anything on
that device. A rank whose input sits on another device type (``meta``, or ``cuda`` under a
CPU-only group) would otherwise fail alone in its first device operation (pinning its row asks
for a CUDA driver) and leave the others waiting in the exchange.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._validation import Problem

__all__ = ["describe", "device_problem", "digest", "local_problem", "signature", "table_device"]


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
    """Short human description of the inputs, e.g. ``float32 (5, 8)`` (``float32 (5, 8) on meta`` off the CPU)."""
    parts = []
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            grad = " requires_grad" if _tracks_grad(tensor) else ""
            where = "" if tensor.device.type == "cpu" else f" on {tensor.device.type}"
            parts.append(f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}{grad}{where}")
        else:
            parts.append(type(tensor).__name__)
    return ", ".join(parts)


def digest(value: object) -> int:
    """A 62-bit digest of ``repr(value)``, never 0."""
    return (int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2) + 1


def signature(tensors: Sequence[Tensor], dim: int) -> int:
    """Digest of everything except the size along ``dim`` that must match across ranks.

    Whether autograd tracks each tensor is part of it: a rank whose gathered tensor has no graph
    never enters the backward collective the other ranks wait in, so a mismatch must fail here.
    So is each tensor's device type: the transports choose their collectives by it.
    """
    parts = []
    for tensor in tensors:
        dim_index = dim % tensor.ndim
        trailing = tuple(size for axis, size in enumerate(tensor.shape) if axis != dim_index)
        parts.append((str(tensor.dtype), tensor.ndim, dim_index, trailing, _tracks_grad(tensor), tensor.device.type))
    return digest(parts)


def _served(group: ProcessGroup | None) -> tuple[str, ...] | None:
    """The device types the group's backends serve (``None``: this torch does not say)."""
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)
    return None if types is None else tuple(sorted(str(device.type) for device in types))


def device_problem(tensors: Sequence[object], group: ProcessGroup | None) -> Problem | None:
    """A problem when this rank's first input lives on a device type the group's backends do not serve."""
    first = tensors[0] if len(tensors) else None
    served = _served(group)
    if not isinstance(first, Tensor) or served is None or first.device.type in served:
        return None
    backend = dist.get_backend(group)
    return ValueError, (
        f"the inputs are on device type {first.device.type!r}, which the process group ({backend}) does not "
        f"serve: it serves {list(served)}. Every rank must pass its inputs on a device type the group serves"
    )


def table_device(tensors: Sequence[object], group: ProcessGroup | None) -> torch.device:
    """Where the small table lives: beside the data when the group serves its device, else where the backend is.

    The input's own device, not ``torch.cuda.current_device()``: a process that never called
    ``torch.cuda.set_device`` would otherwise put every rank's table on ``cuda:0``.
    """
    first = tensors[0] if len(tensors) else None
    if isinstance(first, Tensor) and device_problem(tensors, group) is None:
        return first.device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
