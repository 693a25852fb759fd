"""The dtype the loss core computes in, written once for every loss and both transports.

The core runs in float32 (float64 stays float64) with autocast off: inputs are upcast with
differentiable casts, so their gradients come back in their own dtype. Half-precision logits,
sums and gradient accumulators would overflow (fp16) or drift by percents over many blocks (bf16);
the running state of a row (its maximum and sums) is always kept in the core's dtype.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["compute_dtype", "full_precision", "upcast"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss core runs in: float64 stays float64, everything else becomes float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def full_precision(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``device``: the loss core chooses its own dtype (see :func:`upcast`)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def upcast(tensor: Tensor) -> Tensor:
    """``tensor`` in the core's dtype (float64 stays, the rest becomes float32); differentiable."""
    return tensor.to(compute_dtype(tensor.dtype))
