"""Run a computation on a ``DistributedDataParallel`` model's inner module inside one forward of the wrapper.

DDP learns what its backward must reduce in its forward: with ``find_unused_parameters=True`` it
walks the graph of the forward's outputs and marks the parameters it does not reach ready at once.
The gradient cache calls the module once per mini-batch, and again per mini-batch in the backward;
through the wrapper each call would be a forward of its own — parameters marked ready once per call
(``"marked as ready twice"``), or with a frozen layer a reduction that never completes. Past the
wrapper (on ``ddp.module``) no DDP forward runs at all, and its reducer expects no gradient: the
ranks' gradients would not be averaged, silently. So the encodes run inside exactly one forward of
the wrapper: the inner module's ``forward`` is this computation for that one call, and DDP sees
one forward whose outputs are the cache's, as when ``grad_cache`` is called inside a model's own
``forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["inside_forward"]

Result = TypeVar("Result")


def inside_forward(wrapper: DistributedDataParallel, compute: Callable[[nn.Module], Result]) -> Result:
    """``compute(wrapper.module)``, run as the inner module's forward inside one call of ``wrapper``."""
    inner = wrapper.module
    shadowed = inner.__dict__.get("forward")  # an instance's own forward (a decorator's), put back after

    def restore() -> None:
        if shadowed is not None:
            inner.forward = shadowed  # type: ignore[method-assign]
        elif "forward" in inner.__dict__:
            del inner.forward

    def forward(*_: Any, **__: Any) -> Result:
        restore()  # the computation calls the inner module itself, with its own forward
        return compute(inner)

    inner.forward = forward  # type: ignore[method-assign]  # this one call: nn.Module.__call__ reads self.forward
    try:
        return wrapper()  # type: ignore[no-any-return]
    finally:
        restore()
