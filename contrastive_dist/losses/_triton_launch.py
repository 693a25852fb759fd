"""How the Triton epilogues of :mod:`._triton` are launched: tiles, column spans, device, input checks."""

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["KERNELS", "Tile", "check", "flags", "interpreting", "keys", "on", "span", "tile"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_TILES_PER_SPLIT = 4  # a span shorter than this pays more in merging than it gains in programs


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET``): numpy on CPU tensors, no libdevice."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Enough programs to fill the device: four per streaming multiprocessor."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


class Tile(NamedTuple):
    """A program's tile, ``rows × columns`` of the block, and the warps that run it."""

    rows: int
    columns: int
    warps: int


# A contiguous block's tile per kernel, the fastest of a sweep on an H200 (a 4096 × 65536 float32
# product, bfloat16 G: `python benchmarks/gpu_tiles.py`, docs/benchmarks.md#gpu). A kernel that owns
# whole rows (`block`) takes the first tile that still makes enough programs for the device.
_TILES: dict[str, tuple[Tile, ...]] = {
    "sigmoid": (Tile(8, 256, 8),),
    "state": (Tile(1, 2048, 4),),
    "grad": (Tile(8, 256, 8),),
    "block": (Tile(8, 256, 8), Tile(2, 1024, 4), Tile(1, 2048, 4)),
    # Not yet swept on a GPU. The rows' and the columns' state from one read reduce along both directions
    # of a tile: a square one, whose 64 rows make each column's partial state (20 bytes, written and merged)
    # 0.6 bytes a logit. The gradient of both owns whole rows (written in place) and reads each tile's
    # columns' states (20 bytes a column, from the cache): 8 rows keep that to 2.5 bytes a logit.
    "pairs": (Tile(64, 64, 4),),
    "pair_grad": (Tile(8, 256, 8),),
}
KERNELS = tuple(_TILES)
# A direction seen transposed (P.T: a symmetric loss's columns, which take the state and gradient
# kernels only): the same sweep with --transposed, 32 × 64 the fastest for the state, 64 × 64 for G.
_TRANSPOSED: dict[str, Tile] = {"state": Tile(32, 64, 4)}
_TRANSPOSED_DEFAULT = Tile(64, 64, 4)
_INTERPRETED = Tile(16, 32, 4)  # small tiles: the tests cover several tiles, tails and spans on small blocks


def tile(product: Tensor, kernel: str) -> Tile:
    """The tile of ``kernel`` (one of :data:`KERNELS`) on ``product``: long along its contiguous direction.

    Example:
        >>> import torch
        >>> tile(torch.empty(4096, 65536, device="meta"), "sigmoid")
        Tile(rows=8, columns=256, warps=8)
        >>> tile(torch.empty(16, 4096, device="meta"), "block")  # 2 programs of 8 rows too few (4 off CUDA)
        Tile(rows=2, columns=1024, warps=4)
        >>> tile(torch.empty(65536, 4096, device="meta").T, "state")  # the columns' direction
        Tile(rows=32, columns=64, warps=4)
    """
    if interpreting():
        return _INTERPRETED
    if product.stride(1) != 1:
        return _TRANSPOSED.get(kernel, _TRANSPOSED_DEFAULT)
    candidates = _TILES[kernel]
    wanted = _programs_wanted(product.device)
    return next((choice for choice in candidates if math.ceil(product.shape[0] / choice.rows) >= wanted),
                candidates[-1])


def span(product: Tensor, splits: int, program: Tile) -> tuple[int, int]:
    """``(splits, span)``: the column spans of the rows' sums (``span`` a multiple of ``program``'s width).

    ``splits`` 0: enough spans for the device, each at least a few tiles wide.
    """
    rows, columns = product.shape
    tile_rows, tile_columns, _ = program
    column_tiles = max(1, math.ceil(columns / tile_columns))
    if splits <= 0:
        splits = math.ceil(_programs_wanted(product.device) / math.ceil(max(rows, 1) / tile_rows))
        splits = min(splits, column_tiles // _MIN_TILES_PER_SPLIT)
    span = math.ceil(column_tiles / max(1, min(splits, column_tiles))) * tile_columns
    return max(1, math.ceil(columns / span)), span


@contextlib.contextmanager
def on(product: Tensor) -> Iterator[None]:
    """Launch on ``product``'s device (Triton launches on the current one)."""
    with torch.cuda.device(product.device) if product.is_cuda else contextlib.nullcontext():
        yield


def check(
    product: Tensor, scale: Tensor, bias: Tensor | None, rows: dict[str, Tensor | None],
    row_keys: Tensor | None = None, column_keys: Tensor | None = None, positive_shift: int = 0,
) -> None:  # fmt: skip
    """The ops' inputs, as the kernels read them: raise naming the expected and the given."""
    if positive_shift < 0:
        raise ValueError(f"positive_shift must be >= 0 (a chunk's first row), got {positive_shift}")
    if (row_keys is None) != (column_keys is None):
        raise TypeError("row_keys and column_keys go together: give both or neither")
    if row_keys is not None and column_keys is not None:
        if row_keys.shape != (product.shape[0],) or not row_keys.is_contiguous():
            raise TypeError(f"row_keys must be a contiguous ({product.shape[0]},) tensor, got {tuple(row_keys.shape)}")
        if column_keys.dim() != 1 or column_keys.shape[0] > product.shape[1] or not column_keys.is_contiguous():
            raise TypeError(
                f"column_keys must be a contiguous 1-D tensor of at most {product.shape[1]} keys, "
                f"got {tuple(column_keys.shape)}"
            )
        if column_keys.dtype != row_keys.dtype:
            raise TypeError(
                f"row_keys and column_keys must share a dtype, got {row_keys.dtype} and {column_keys.dtype}"
            )
    if product.dim() != 2 or product.dtype != torch.float32:
        raise TypeError(f"product must be a 2-D float32 tensor, got {product.dim()}-D {product.dtype}")
    for name, scalar in (("scale", scale), ("bias", bias)):
        if scalar is not None and (scalar.dim() != 0 or scalar.dtype != torch.float32):
            raise TypeError(f"{name} must be a 0-d float32 tensor, got shape {tuple(scalar.shape)} {scalar.dtype}")
    dtypes = {"positive": torch.int64, "excluded": torch.int64, "weights": torch.float32, "state": torch.float32}
    for name, tensor in rows.items():
        if tensor is None:
            continue
        if name == "grad":
            if tensor.shape != product.shape or tensor.dtype not in _GRAD_DTYPES:
                raise TypeError(
                    f"grad must be {tuple(product.shape)} in one of {_GRAD_DTYPES}, "
                    f"got {tuple(tensor.shape)} {tensor.dtype}"
                )
            continue
        shape = (product.shape[0], 5) if name == "state" else (product.shape[0],)
        if tuple(tensor.shape) != shape or tensor.dtype != dtypes[name] or not tensor.is_contiguous():
            raise TypeError(
                f"{name} must be a contiguous {shape} {dtypes[name]} tensor, got {tuple(tensor.shape)} {tensor.dtype}"
            )


def flags(
    bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None,
    row_keys: Tensor | None = None, column_keys: Tensor | None = None, keys_positive: bool = False,
) -> dict[str, int]:  # fmt: skip
    """The kernels' switches for the optional inputs (an absent one is a ``None`` pointer, never read).

    ``KEY_RULE``: 0 without keys, 1 when pairs that share a key are positives, 2 when they are left out.
    """
    rule = 0 if row_keys is None or column_keys is None else (1 if keys_positive else 2)
    return {"HAS_BIAS": bias is not None, "HAS_POS": positive is not None, "HAS_EXCL": excluded is not None,
            "KEY_RULE": rule}  # fmt: skip


def keys(row_keys: Tensor | None, column_keys: Tensor | None) -> tuple[Tensor | None, Tensor | None, int]:
    """The kernels' key arguments: the rows' keys, the columns' and how many columns have one."""
    if row_keys is None or column_keys is None:
        return None, None, 0
    return row_keys, column_keys, column_keys.shape[0]
