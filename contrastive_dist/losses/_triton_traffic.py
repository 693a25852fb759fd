"""The bytes each fused epilogue op moves through memory, from its arguments' shapes: for traffic counters.

The model of :mod:`._triton`'s table (its module docstring): each op reads the product once a pass,
writes ``G`` at its dtype's size and each row's state or sums, and reads the per-row inputs once.
"""

from __future__ import annotations

from typing import Any

import torch

from contrastive_dist.losses._triton_pairs import programs_of_rows

__all__ = ["traffic"]

_PASSES = {"sigmoid_block": 1, "softmax_state": 1, "softmax_grad": 1, "softmax_block": 2, "softmax_pairs": 1,
           "softmax_pair_grad": 1}  # fmt: skip
"""How many times each op reads the product (softmax_block: the state's pass, then the gradient's)."""
_STATE_WRITTEN = {"sigmoid_block": 8, "softmax_state": 20, "softmax_grad": 0, "softmax_block": 20, "softmax_pairs": 20,
                  "softmax_pair_grad": 0}  # fmt: skip
"""Bytes per row each op writes besides G: the row sums (two float32) or the state (five)."""
_SIDE_INPUTS = ("positive", "excluded", "weights", "state", "row_keys", "column_keys", "column_positive",
                "column_excluded", "column_weights", "column_state")  # fmt: skip
"""The per-row and per-column inputs, each read once (a few bytes a row: they stay in cache across programs)."""


def traffic(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> int:
    """The bytes one call of an epilogue op moves through memory, from its arguments' shapes.

    For a dispatch-mode counter: ``op`` is the op (or its name) as the mode sees it, ``args`` and
    ``kwargs`` its arguments (meta or fake tensors do); the table of the module docstring, plus the
    per-row reads and writes (and the columns' keys). Column spans' partial sums (``O(c)``) are left out;
    ``softmax_pairs``' partial column states (20 bytes a column for each program of rows but one,
    written and read again) are counted.

    Example:
        >>> import torch
        >>> product, grad = torch.empty(256, 4096, device="meta"), torch.empty(256, 4096, device="meta").bfloat16()
        >>> traffic("softmax_block", (product, torch.empty(()), None, None, None, None, grad)) / product.numel()
        10.0048828125
    """
    name = (op if isinstance(op, str) else op._schema.name).split("::")[-1]
    schema = getattr(torch.ops.contrastive_dist, name).default._schema
    bound = {argument.name: argument.default_value for argument in schema.arguments}
    bound.update(zip((argument.name for argument in schema.arguments), args))
    bound.update(kwargs or {})
    product, grad = bound["product"], bound.get("grad")
    rows = product.shape[0]
    moved = _PASSES[name] * product.numel() * product.element_size() + _STATE_WRITTEN[name] * rows
    if grad is not None:
        moved += grad.numel() * grad.element_size()
    for side_input in _SIDE_INPUTS:
        if bound.get(side_input) is not None:
            moved += bound[side_input].numel() * bound[side_input].element_size()
    if name == "softmax_pairs":
        row_programs = programs_of_rows(product)
        partial = 0 if row_programs == 1 else 2 * row_programs * bound["width"] * 20
        moved += 20 * bound["width"] + partial
    return int(moved)
