"""The dtypes the loss core computes in, written once for every loss and both transports.

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
import os
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "add_product_",
    "PRODUCTS_VARIABLE",
    "compute_dtype",
    "full_precision",
    "half_products",
    "operands",
    "product",
    "product_route",
    "upcast",
]

PRODUCTS_VARIABLE = "CONTRASTIVE_DIST_PRODUCTS"
"""Environment variable: ``auto`` / unset, ``full`` or ``half``; see the module docstring."""
_CHOICES = ("auto", "full", "half")
_HALF = (torch.bfloat16, torch.float16)


def _out_dtype_products(device: torch.device) -> bool:
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


def product(first: Tensor, second: Tensor) -> Tensor:
    """``first @ second`` in the core's dtype; operands of one half dtype are multiplied as they are.

    On CUDA two bf16/fp16 operands take the tensor cores with a float32 result (on the meta device
    the same overload, for counting); elsewhere, on a torch without that overload, or when the
    dtypes differ, both are upcast first.

    Shape:
        first: ``(a, k)``; second: ``(k, b)``; output: ``(a, b)``, float32 (float64 for float64 operands).

    Example:
        >>> import torch
        >>> a, b = torch.randn(2, 3).bfloat16(), torch.randn(3, 4).bfloat16()
        >>> product(a, b).dtype, torch.equal(product(a, b), a.float() @ b.float())
        (torch.float32, True)
    """
    if first.dtype == second.dtype and first.dtype in _HALF and _out_dtype_products(first.device):
        return torch.mm(first, second, out_dtype=torch.float32)
    return upcast(first) @ upcast(second)


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
    if _out_dtype_products(device):
        return f"{name} operands, float32 results (mm out_dtype, tensor cores)"
    return f"{name} operands, each product upcasts them (no mm out_dtype on this device or torch)"


def add_product_(out: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """``out += first @ second`` in place, in ``out``'s dtype (the core's): no temporary of the product.

    Two half operands on CUDA accumulate on the tensor cores straight into the float32 ``out``
    (``addmm`` with ``out_dtype``); elsewhere both are upcast first, like :func:`product`.

    Shape:
        out: ``(a, b)``; first: ``(a, k)``; second: ``(k, b)``.

    Example:
        >>> import torch
        >>> out, a, b = torch.ones(2, 4), torch.randn(2, 3).bfloat16(), torch.randn(3, 4).bfloat16()
        >>> torch.equal(add_product_(out.clone(), a, b), out + a.float() @ b.float())
        True
    """
    if first.dtype == second.dtype and first.dtype in _HALF and _out_dtype_products(first.device):
        return torch.addmm(out, first, second, out_dtype=out.dtype, out=out)
    return out.addmm_(upcast(first), upcast(second))
