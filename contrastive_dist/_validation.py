"""Input checks that several layers share (the gather, the losses, the metrics), and how a problem is collected.

Every check raises ``ValueError``/``TypeError`` with a message that says what was expected and
what came. Distributed callers do not raise it at once: :func:`collect` turns it into a problem
that the agreement exchange (:mod:`contrastive_dist.engine._agreement`) raises on every rank, so
that a rank with bad input never leaves the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor

__all__ = ["Problem", "check_features", "check_pair", "collect", "sizes_problem"]

T = TypeVar("T")
Problem = tuple[type[Exception], str]
"""An exception class and its message, found on one rank and raised on all of them."""


def collect(check: Callable[[], T]) -> tuple[T | None, Problem | None]:
    """Run ``check``; return its result and no problem, or no result and the ``ValueError``/``TypeError`` it raised.

    Example:
        >>> collect(lambda: int("3"))
        (3, None)
        >>> collect(lambda: int("three"))
        (None, (<class 'ValueError'>, "invalid literal for int() with base 10: 'three'"))
    """
    try:
        return check(), None
    except (ValueError, TypeError) as error:
        return None, (type(error), str(error))


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


def sizes_problem(sizes: Sequence[int], world_size: int, name: str = "sizes") -> Problem | None:
    """What is wrong with a caller's ``sizes=`` (one non-negative Python int per rank), or ``None``."""
    if isinstance(sizes, Tensor) or not all(isinstance(size, int) and size >= 0 for size in sizes):
        return TypeError, f"{name} must be a sequence of non-negative Python ints, got {sizes!r}"
    if len(sizes) != world_size:
        return ValueError, f"{name} must have one entry per rank ({world_size}), got {len(sizes)}: {tuple(sizes)}"
    return None
