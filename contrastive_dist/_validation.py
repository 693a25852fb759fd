"""Argument checks shared by the losses: clear ``ValueError``/``TypeError`` instead of shape errors later."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine.gather import raise_on_all_ranks

__all__ = [
    "check_chunk_size",
    "check_features",
    "check_pair",
    "check_temperature",
    "compute_dtype",
    "positive_scalar",
    "resolve_scale",
    "scalar_tensor",
    "validated_on_all_ranks",
]


@contextmanager
def validated_on_all_ranks(
    tensors: Sequence[object], *, group: ProcessGroup | None, sizes: Sequence[int] | None
) -> Iterator[None]:
    """Run a loss's per-call checks so that a ``ValueError``/``TypeError`` is raised on every rank.

    A check that fails on one rank only would otherwise leave the other ranks waiting in the
    gather; ``tensors`` (what the loss would gather) describe this rank's inputs in the message.
    """
    try:
        yield
    except (ValueError, TypeError) as error:
        raise_on_all_ranks(error, tensors, group=group, sizes=sizes)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss core runs in: float64 stays float64, everything else becomes float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_temperature(temperature: object) -> float:
    """Return ``temperature`` as a float after checking it is a real number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    value = float(temperature)
    if not value > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return value


def check_chunk_size(chunk_size: object) -> int | None:
    """Check that ``chunk_size`` is ``None`` or a positive int."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be None or a positive int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size}")
    return chunk_size


def check_features(name: str, features: object, ndims: tuple[int, ...] = (2,)) -> Tensor:
    """Check for a floating-point tensor with one of the allowed numbers of dimensions."""
    if not isinstance(features, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(features).__name__}")
    if features.ndim not in ndims:
        expected = " or ".join(f"{ndim}-d" for ndim in ndims)
        raise ValueError(f"{name} must be {expected} (batch first), got shape {tuple(features.shape)}")
    if not features.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {features.dtype}")
    return features


def check_pair(first_name: str, first: object, second_name: str, second: object) -> tuple[Tensor, Tensor]:
    """Check for two ``(batch, dim)`` feature tensors of the same shape and dtype."""
    first_tensor = check_features(first_name, first)
    second_tensor = check_features(second_name, second)
    if first_tensor.shape != second_tensor.shape:
        raise ValueError(
            f"{first_name} and {second_name} must have the same shape (batch, dim), got "
            f"{tuple(first_tensor.shape)} and {tuple(second_tensor.shape)}"
        )
    if first_tensor.dtype != second_tensor.dtype:
        raise TypeError(
            f"{first_name} and {second_name} must share a dtype, got {first_tensor.dtype} and {second_tensor.dtype}"
        )
    return first_tensor, second_tensor


def scalar_tensor(name: str, value: object, like: Tensor) -> Tensor:
    """A one-element tensor (kept in the graph) or a real number as a 0-d tensor in ``like``'s compute dtype."""
    dtype = compute_dtype(like.dtype)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor or a real number, got {value.dtype}")
        return value.reshape(()).to(dtype=dtype, device=like.device)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a scalar tensor or a real number, got {type(value).__name__}")
    return torch.tensor(float(value), dtype=dtype, device=like.device)


def resolve_scale(logit_scale: object, temperature: float, like: Tensor) -> Tensor:
    """Return the similarity multiplier: ``logit_scale`` if given (already exponentiated), else ``1/temperature``."""
    if logit_scale is None:
        return torch.tensor(1.0 / temperature, dtype=compute_dtype(like.dtype), device=like.device)
    return positive_scalar("logit_scale", logit_scale, like)


def positive_scalar(name: str, value: object, like: Tensor) -> Tensor:
    """:func:`scalar_tensor`, and > 0 when given as a number (a tensor is not synced to check it)."""
    scale = scalar_tensor(name, value, like)
    if not isinstance(value, Tensor) and not float(scale) > 0:
        raise ValueError(f"{name} must be > 0 (it multiplies the similarities), got {value}")
    return scale
