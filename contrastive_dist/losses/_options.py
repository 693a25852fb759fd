"""The options every loss takes, checked once, and the dtypes they make the core compute in.

**Checks.** Scale, temperature, chunk size, mode, reduction, weights, ids: each raises
``ValueError``/``TypeError`` saying what was expected and what came; the losses run them through
:func:`contrastive_dist._validation.collect`, so a bad option on one rank is raised on every rank by the
agreement exchange.

**Dtypes**, decided once per call (:func:`compute_dtype`, :func:`operands`) and passed down:
**Running state and sums** — every row's maximum, sums, gradient accumulators and the logits
themselves — are float32 (float64 stays float64), with autocast off: half-precision sums and
accumulators would overflow (fp16) or drift by percents over many blocks (bf16).

**Products** (the logits ``Q Kᵀ`` and the gradients ``G K``, ``Gᵀ Q``):

* float32 / float64 features: products in that dtype. On CUDA, float32 products honour
  ``torch.backends.cuda.matmul.allow_tf32`` as any float32 matmul does (off by default).
* bf16 / fp16 features on CUDA: the features stay in their dtype and every product runs on the
  tensor cores with float32 accumulation and a float32 result (``torch.mm(..., out_dtype=float32)``).
  The logits are then exactly what the upcast path computes (a product of two bf16 numbers is exact
  in float32; only the order of the float32 additions may differ). A block's logit gradient is
  rounded to the features' dtype before its two products, as flash attention rounds its
  probabilities: the gradients handed back to bf16/fp16 features carry that dtype's precision anyway.
* NT-Xent and DCL normalise their features themselves, in float32; on the half-products route the
  unit vectors are then rounded to the features' dtype, as a half-precision model's would be, so that
  their products run on the tensor cores too (NT-Xent's H200 step 8.4× faster). The loss is then
  exact to that rounding: at bf16, NT-Xent within 1e-4 relative in the tests, DCL (a smaller loss)
  2e-4. ``CONTRASTIVE_DIST_PRODUCTS=full`` keeps float32 unit vectors and float32 products.
* bf16 / fp16 features on CPU: upcast to float32 first (a half product with a float32 result,
  ``torch.mm(..., out_dtype=float32)``, runs on CUDA only).
* torch before 2.8 has no ``torch.mm(..., out_dtype=)``: there every product upcasts its two
  operands first (the same numbers, without the tensor-core speed). :func:`product_route` says
  which route a call takes.

``CONTRASTIVE_DIST_PRODUCTS`` chooses for any device: ``auto`` (the default, as above), ``full``
(always upcast first) or ``half`` (always keep half features; on CPU each product then upcasts its
two operands itself, the same numbers as the tensor-core path, so the half route is tested there).
Every rank must see the same value.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from typing import Any, Literal, cast, get_args

import torch
from torch import Tensor

__all__ = [
    "PRODUCTS_VARIABLE",
    "Communication",
    "Reduction",
    "SameId",
    "check_bool",
    "check_chunk_size",
    "check_communication",
    "check_ids",
    "check_reduction",
    "check_same_id",
    "check_temperature",
    "check_weight",
    "compute_dtype",
    "full_precision",
    "half_products",
    "operands",
    "out_dtype_products",
    "positive_scalar",
    "product_route",
    "resolve_scale",
    "scalar_tensor",
    "upcast",
]

Communication = Literal["gather", "ring"]
Reduction = Literal["mean", "none"]


def check_communication(communication: object) -> Communication:
    """Check ``communication`` is one of the allowed modes."""
    allowed = get_args(Communication)
    if communication not in allowed:
        raise ValueError(f"communication must be one of {allowed}, got {communication!r}")
    return cast(Communication, communication)


def check_reduction(reduction: object, weight: object) -> Reduction:
    """Check ``reduction`` is ``"mean"`` or ``"none"``, and that ``weight`` comes only with ``"mean"``."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if reduction == "none" and weight is not None:
        raise ValueError(
            "weight= applies to reduction='mean' only; with reduction='none' the per-row losses come back "
            "unweighted and the caller weights and normalises them"
        )
    return cast(Reduction, reduction)


def check_bool(name: str, value: object) -> bool:
    """Check for a ``bool``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


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
    return _filled(float(value), like)


def _filled(value: float, like: Tensor) -> Tensor:
    """A number the host holds as a 0-d tensor on ``like``'s device: filled there, not copied (no host sync).

    Under ``torch.compile`` the number is a constant of the graph, as before: no copy happens there either.
    """
    if torch.compiler.is_compiling():
        return torch.tensor(value, dtype=compute_dtype(like.dtype), device=like.device)
    return torch.full((), value, dtype=compute_dtype(like.dtype), device=like.device)


def positive_scalar(name: str, value: object, like: Tensor) -> Tensor:
    """:func:`scalar_tensor`, and > 0 when given as a number (checked on the host; a tensor is not synced)."""
    scale = scalar_tensor(name, value, like)
    if not isinstance(value, Tensor) and not float(cast(float, value)) > 0:
        raise ValueError(f"{name} must be > 0 (it multiplies the similarities), got {value}")
    return scale


def resolve_scale(logit_scale: object, temperature: float, like: Tensor) -> Tensor:
    """Return the similarity multiplier: ``logit_scale`` if given (already exponentiated), else ``1/temperature``."""
    if logit_scale is None:
        return _filled(1.0 / temperature, like)
    return positive_scalar("logit_scale", logit_scale, like)


def check_weight(weight: object, rows: int, like: Tensor, name: str = "weight") -> Tensor | None:
    """Return ``weight`` detached, in ``like``'s compute dtype and device, after checking it.

    Expected: a real tensor of shape ``(rows,)``, every entry finite and ≥ 0.
    """
    if weight is None:
        return None
    if not isinstance(weight, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape ({rows},), got {type(weight).__name__}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise TypeError(f"{name} must be a real (float or integer) tensor, got {weight.dtype}")
    if weight.shape != (rows,):
        raise ValueError(f"{name} must have one entry per local row, shape ({rows},), got {tuple(weight.shape)}")
    values = weight.detach().to(dtype=compute_dtype(like.dtype), device=like.device)
    if torch.compiler.is_compiling():
        return values  # the values are data: under torch.compile they are trusted, like sizes=
    for bad, what in ((~torch.isfinite(values), "finite"), (values < 0, ">= 0")):
        if bool(bad.any()):
            index = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"{name} must be {what}, got {name}[{index}] = {values[index].item()}")
    return values


SameId = Literal["mask", "positive"]
"""What two rows with the same id are to each other: ``"mask"`` (neither pushed apart nor pulled
together) or ``"positive"`` (positives of each other)."""


def check_same_id(same_id: object) -> SameId:
    """Check ``same_id`` is ``"mask"`` or ``"positive"``."""
    allowed = get_args(SameId)
    if same_id not in allowed:
        raise ValueError(f"same_id must be one of {allowed}, got {same_id!r}")
    return cast(SameId, same_id)


def check_ids(name: str, ids: object, rows: int, like: Tensor) -> Tensor | None:
    """Check for one int64 id per row, on ``like``'s device (``None`` passes)."""
    if ids is None:
        return None
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be an int64 torch.Tensor of shape ({rows},), got {type(ids).__name__}")
    if ids.dtype != torch.int64:
        raise TypeError(f"{name} must be an int64 tensor (one id per row), got {ids.dtype}")
    if ids.shape != (rows,):
        raise ValueError(f"{name} must have one id per row, shape ({rows},), got {tuple(ids.shape)}")
    return ids.to(like.device)


# The dtypes.

PRODUCTS_VARIABLE = "CONTRASTIVE_DIST_PRODUCTS"
"""Environment variable: ``auto`` / unset, ``full`` or ``half``; see the module docstring."""
_CHOICES = ("auto", "full", "half")
_HALF = (torch.bfloat16, torch.float16)


def out_dtype_products(device: torch.device) -> bool:
    """Whether ``torch.mm(..., out_dtype=)`` runs on ``device``: torch ≥ 2.8 has it, for CUDA and Meta only."""
    return device.type in ("cuda", "meta") and "dtype" in torch.ops.aten.mm.overloads()


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


def half_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether features of ``dtype`` on ``device`` enter the products as they are (see the module docstring).

    Example:
        >>> import torch
        >>> half_products(torch.bfloat16, torch.device("cpu")), half_products(torch.float32, torch.device("cpu"))
        (False, False)
    """
    choice = os.environ.get(PRODUCTS_VARIABLE, "") or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{PRODUCTS_VARIABLE} must be one of {_CHOICES} (or unset), got {choice!r}")
    if dtype not in _HALF or choice == "full":
        return False
    return choice == "half" or device.type == "cuda"


def operands(tensor: Tensor) -> Tensor:
    """``tensor`` in the dtype it enters the products in: as it is for half products, else :func:`upcast`."""
    return tensor if half_products(tensor.dtype, tensor.device) else upcast(tensor)


def product_route(dtype: torch.dtype, device: torch.device) -> str:
    """How products of features of ``dtype`` on ``device`` are computed, as :func:`operands` and :func:`product` do.

    Reads ``CONTRASTIVE_DIST_PRODUCTS`` and what the installed torch offers, so a benchmark row
    can say what it measured.

    Example:
        >>> import torch
        >>> product_route(torch.bfloat16, torch.device("cpu"))
        'bfloat16 upcast to float32 before the products'
        >>> product_route(torch.float32, torch.device("cpu"))
        'float32 products'
    """
    name = str(dtype).removeprefix("torch.")
    if dtype not in _HALF:
        return f"{name} products"
    if not half_products(dtype, device):
        return f"{name} upcast to float32 before the products"
    if out_dtype_products(device):
        return f"{name} operands, float32 results (mm out_dtype, tensor cores)"
    return f"{name} operands, each product upcasts them (no mm out_dtype on this device or torch)"
