"""What ``grad_cache``'s encoder returns: its checks, and its description for a rank that encodes nothing.

A module returns a tensor, a tuple of tensors or a dict of tensors, with the mini-batch's rows
first; every mini-batch must give the same kind, number, dtypes and trailing shapes. A rank whose
batch is empty does not call the module at all (a Hugging Face model or open_clip's ViT cannot take
0 rows), so it learns what to return — 0 rows of the same kind, dtypes and trailing shapes — from
a rank that did encode: one small exchange of descriptions, run only when some rank holds no rows,
which every rank knows from the agreement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._validation import Problem
from contrastive_dist.engine._faults import naming_peers

__all__ = ["Description", "as_outputs", "described", "empty_outputs", "kind_of", "output_problem", "unlike_first"]

Description = tuple[tuple[object, ...], tuple[tuple[str, tuple[int, ...]], ...]]
"""The module's kind (:func:`kind_of`) and each output's dtype name and trailing shape."""


def kind_of(outputs: object) -> tuple[object, ...]:
    """What the module returned: a tensor, a tuple of ``n``, or a mapping with these keys."""
    if isinstance(outputs, Tensor):
        return ("tensor",)
    if isinstance(outputs, Mapping):
        return ("mapping", *outputs.keys())
    return ("tuple", len(cast(tuple[Tensor, ...], outputs)))


def as_outputs(outputs: object) -> tuple[Tensor, ...]:
    """A module's result as a tuple of tensors (the caller has checked it)."""
    if isinstance(outputs, Mapping):
        return tuple(outputs.values())
    return (outputs,) if isinstance(outputs, Tensor) else tuple(cast(tuple[Tensor, ...], outputs))


def output_problem(outputs: object, rows: int) -> Problem | None:
    """A problem when ``outputs`` is not a tensor, tuple or dict of tensors with ``rows`` leading rows each."""
    is_tuple = isinstance(outputs, tuple) and len(outputs) > 0 and all(isinstance(x, Tensor) for x in outputs)
    is_mapping = isinstance(outputs, Mapping) and len(outputs) > 0 and all(
        isinstance(key, str) and isinstance(x, Tensor) for key, x in outputs.items())
    if not (isinstance(outputs, Tensor) or is_tuple or is_mapping):
        return TypeError, (f"the module must return a tensor, a tuple of tensors or a dict of tensors, got "
                           f"{type(outputs).__name__}")
    shapes = [tuple(out.shape) for out in as_outputs(outputs)]
    if any(len(shape) == 0 or shape[0] != rows for shape in shapes):
        return ValueError, (f"every output must have the inputs' leading size ({rows} rows in this "
                            f"mini-batch), got shapes {shapes}")
    return None


def unlike_first(outputs: object, kind: tuple[object, ...], buffers: Sequence[Tensor]) -> Problem | None:
    """A problem when a mini-batch's outputs differ in kind, number, dtype or trailing shape from the first's."""
    parts = as_outputs(outputs)
    if kind_of(outputs) == kind and len(parts) == len(buffers):
        if all(out.dtype == buf.dtype and out.shape[1:] == buf.shape[1:] for out, buf in zip(parts, buffers)):
            return None
    described = [(str(out.dtype), tuple(out.shape[1:])) for out in parts]
    first = [(str(buf.dtype), tuple(buf.shape[1:])) for buf in buffers]
    return ValueError, (
        "grad_cache: the module must return outputs of the same kind, number, dtype and trailing shape for every "
        f"mini-batch; the first gave {first}, a later one {described}"
    )


def described(mine: Description | None, group: ProcessGroup | None) -> Description:
    """The description of a rank that encoded (the lowest such), from every rank's own or ``None``.

    Every rank of ``group`` calls this together; at least one must have encoded.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with naming_peers("grad_cache (exchange of the outputs' description for a rank without rows)", group):
        dist.all_gather_object(gathered, mine, group=group)
    return cast(Description, next(entry for entry in gathered if entry is not None))


def empty_outputs(description: Description, device: torch.device) -> list[Tensor]:
    """0 rows of every output the description names, on ``device``."""
    return [torch.empty((0, *shape), dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
            for dtype, shape in description[1]]
