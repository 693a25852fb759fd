"""The loss modules: they hold a loss function's options; the computation lives in the functional form."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from contrastive_dist.losses._options import (
    check_bool,
    check_chunk_size,
    check_communication,
    check_reduction,
    check_same_id,
    check_temperature,
)

__all__ = ["HeldOptions"]

_CHECKS: dict[str, Callable[[Any], object]] = {
    "temperature": check_temperature,
    "chunk_size": check_chunk_size,
    "reduction": lambda reduction: check_reduction(reduction, None),
    "communication": check_communication,
    "same_id": check_same_id,
    "symmetric": lambda symmetric: check_bool("symmetric", symmetric),
}


class HeldOptions(nn.Module):
    """Holds the options of a loss function, checked here (a bad one fails at construction, not at the first step).

    ``forward`` passes :meth:`options` to the function with the call's tensors; ``group`` is held as
    given and left out of ``repr``.

    Example:
        >>> held = HeldOptions(temperature=0.1, chunk_size=None, group=None, reduction="mean")
        >>> held
        HeldOptions(temperature=0.1, chunk_size=None, reduction='mean')
        >>> held.options()["temperature"]
        0.1
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        for name, value in options.items():
            setattr(self, name, _CHECKS.get(name, lambda same: same)(value))
        self._option_names = tuple(options)

    def options(self) -> dict[str, Any]:
        """The options as the loss function takes them (keyword arguments)."""
        return {name: getattr(self, name) for name in self._option_names}

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return ", ".join(f"{name}={value!r}" for name, value in self.options().items() if name != "group")
