"""The agreement's row: one rank's fields as int64, built beside its data, and every rank's row read back.

A row is :data:`FIELDS` int64 values, the same number in every agreement, whatever the operation,
so that two ranks that reach the exchange from different calls still exchange rows of one size
(the transport aborts on sizes that differ) and learn it from the rows themselves:

    status, rows, extra rows, flags, signature, options digest, given-sizes digest, call,
    total, scalar 0, scalar 1

``call`` numbers the rank's agreements on the group (:mod:`~contrastive_dist.engine._progress`);
``total`` and the two scalars (a loss's ``logit_scale`` and ``logit_bias``) are float64 bits. On an
accelerator the row leaves pinned host memory without waiting, and the fields only the device holds
(the total, the scalars, flags computed from device data) are written into it on the device: the
exchange's one host sync stays the read of the table.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple, cast

import torch
from torch import Tensor

__all__ = ["FIELDS", "MAX_SCALARS", "OK", "PROBLEM", "Row", "local_row"]

OK, PROBLEM = 0, 1
_NAMES = ("status", "rows", "extra", "flags", "signature", "options", "sizes", "call", "total", "scalar0", "scalar1")
FIELDS = len(_NAMES)
_TOTAL = _NAMES.index("total")
_FLAGS = _NAMES.index("flags")
_SCALARS = (_NAMES.index("scalar0"), _NAMES.index("scalar1"))
MAX_SCALARS = len(_SCALARS)


class Row(NamedTuple):
    """One rank's row, read back: its host fields, and the device-written ones as numbers."""

    status: int
    rows: int
    extra: int
    flags: int
    signature: int
    options: int
    sizes: int
    call: int
    total: float
    scalars: tuple[float, ...]

    @classmethod
    def read(cls, values: Sequence[int]) -> Row:
        """A row of the table (``table.tolist()``), its float fields decoded."""
        status, rows, extra, flags, signature, options, sizes, call = (int(value) for value in values[:_TOTAL])
        total = _bits_float(int(values[_TOTAL]))
        scalars = tuple(_bits_float(int(values[index])) for index in _SCALARS)
        return cls(status, rows, extra, flags, signature, options, sizes, call, total, scalars)

    def same_scalars(self, other: Row) -> bool:
        """Whether two ranks passed the same scalar values (NaN equals NaN: the same bits went in)."""
        return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(self.scalars, other.scalars))


def _bits_float(bits: int) -> float:
    return cast(float, struct.unpack("<d", struct.pack("<q", bits))[0])


def _as_bits(value: Tensor, device: torch.device) -> Tensor:
    """A 0-d tensor's float64 bits as an int64 on ``device``, without reading it on the host."""
    return value.detach().to(device=device, dtype=torch.float64).reshape(()).view(torch.int64)


def local_row(
    fields: Mapping[str, int],
    device: torch.device,
    *,
    total: Tensor | None = None,
    flags: Tensor | None = None,
    scalars: Sequence[Tensor] = (),
) -> Tensor:
    """The ``(1, FIELDS)`` row of this rank on ``device``: the host ``fields``, then the device-held values.

    ``fields`` names host values (the others are 0); ``total``, ``flags`` and ``scalars`` are 0-d tensors on the
    data's device (at most :data:`MAX_SCALARS` scalars).
    """
    if len(scalars) > MAX_SCALARS:
        raise ValueError(f"the agreement carries at most {MAX_SCALARS} scalars, got {len(scalars)}")
    row = torch.tensor([[fields.get(name, 0) for name in _NAMES]], dtype=torch.int64)
    if device.type != "cpu":
        pinned = torch.empty(row.shape, dtype=torch.int64, pin_memory=True)
        pinned.copy_(row)
        row = pinned.to(device, non_blocking=True)
    if total is not None:
        row[0, _TOTAL] = _as_bits(total, device)
    if flags is not None:
        row[0, _FLAGS] = flags.to(device=device, dtype=torch.int64).reshape(())
    for index, scalar in zip(_SCALARS, scalars):
        row[0, index] = _as_bits(scalar, device)
    return row
