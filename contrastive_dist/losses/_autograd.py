"""What the driver's autograd functions need around them: their inputs as autograd takes them, once-only backward.

Example:
    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> wanted_gradients(x, None, torch.ones(1)), distinct_input(x, x) is x
    ((True, False, False), False)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.losses._options import full_precision

__all__ = ["distinct_input", "first_order_only", "wanted_gradients"]


def distinct_input(keys: Tensor, queries: Tensor) -> Tensor:
    """``keys``, as a tensor of its own where it is ``queries`` (NT-Xent's ring: the rows are their own columns).

    torch.compile cannot trace an autograd function given one tensor twice; a view is another input, and
    autograd still adds both of its gradients into the one tensor.
    """
    return keys.view_as(keys) if keys is queries else keys


def wanted_gradients(*tensors: Tensor | None) -> tuple[bool, ...]:
    """Which of ``tensors`` need a gradient (none under ``no_grad``): decided before the autograd function."""
    return tuple(tensor is not None and torch.is_grad_enabled() and tensor.requires_grad for tensor in tensors)


def first_order_only(backward: Callable[..., tuple[Tensor | None, ...]]) -> Callable[..., tuple[Tensor | None, ...]]:
    """A backward that raises under ``create_graph=True`` instead of being wrong, and runs with autocast off.

    ``once_differentiable`` alone stays silent when the incoming gradient is a constant (the usual
    ``grad(loss, x, create_graph=True)``): the second derivative would quietly miss this term.
    """
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def checked(ctx: Any, *grad_outputs: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("double backward (create_graph=True) through the contrastive losses' kernels is not "
                               "supported: their gradients are formed block by block (once_differentiable)")
        with full_precision(grad_outputs[0].device):  # inside autocast too: computed in forward's dtypes
            return once(ctx, *grad_outputs)

    return checked
