"""The product route: ``torch.mm(..., out_dtype=)`` where the installed torch has it, the upcast path where not.

torch 2.4–2.7 (allowed by the package's requirements) lack the overload; a missing one is
simulated here by hiding it, and by a ``torch.mm`` that rejects ``out_dtype=`` as those versions do.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contrastive_dist.losses import _options
from contrastive_dist.losses._options import PRODUCTS_VARIABLE, product_route
from contrastive_dist.losses._visit import product

CUDA, META = torch.device("cuda"), torch.device("meta")


@pytest.fixture
def torch_2_7(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if torch were older than 2.8: no ``mm.dtype`` overload, and ``torch.mm`` rejects ``out_dtype=``."""
    mm, overloads = torch.mm, [name for name in torch.ops.aten.mm.overloads() if name != "dtype"]

    def old_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "out_dtype" in kwargs:
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        return mm(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten.mm, "overloads", lambda: overloads)
    monkeypatch.setattr(torch, "mm", old_mm)


def _half_meta_operands() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(5, 8, dtype=torch.bfloat16, device=META), torch.empty(8, 3, dtype=torch.bfloat16, device=META)


def test_the_route_names_the_tensor_core_products_where_the_overload_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PRODUCTS_VARIABLE, raising=False)
    assert product_route(torch.bfloat16, CUDA) == "bfloat16 operands, float32 results (mm out_dtype, tensor cores)"
    assert product_route(torch.bfloat16, torch.device("cpu")) == "bfloat16 upcast to float32 before the products"
    monkeypatch.setenv(PRODUCTS_VARIABLE, "full")
    assert product_route(torch.float16, CUDA) == "float16 upcast to float32 before the products"


def test_without_the_overload_the_route_and_the_product_fall_back_to_upcasting(
        monkeypatch: pytest.MonkeyPatch, torch_2_7: None) -> None:
    monkeypatch.delenv(PRODUCTS_VARIABLE, raising=False)
    assert not _options.out_dtype_products(CUDA)
    assert product_route(torch.bfloat16, CUDA) == (
        "bfloat16 operands, each product upcasts them (no mm out_dtype on this device or torch)")
    # Half operands are kept (CONTRASTIVE_DIST_PRODUCTS=half); the meta device has the overload's
    # kernel, so the product would call it, and the old torch.mm would raise, if the check were missing.
    monkeypatch.setenv(PRODUCTS_VARIABLE, "half")
    result = product(*_half_meta_operands())
    assert result.dtype == torch.float32 and result.shape == (5, 3)


def test_with_the_overload_the_product_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    mm = torch.mm

    def recording_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("out_dtype"))
        return mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    result = product(*_half_meta_operands())
    assert calls == [torch.float32] and result.dtype == torch.float32
