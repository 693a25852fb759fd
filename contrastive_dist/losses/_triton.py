"""The fused block epilogues as Triton kernels (CUDA): what follows a block's product, one launch each.

Each op reads the raw product ``P = Q Kᵀ`` of a block (``(c, m)`` float32, any strides: a
direction seen transposed is passed as ``P.T``), a 0-d float32 ``scale`` and an optional 0-d
``bias`` (device tensors, so nothing waits on the host), and forms the logits ``l = s · P (+ b)``
inside the kernel. A row's targets are ``positive`` (``(c,)`` int64, its positive column, ``-1`` or
any index outside ``[0, m)``: none in this block) and ``excluded`` (the same, a column whose logit
is ``-inf``); key masks (ids, labels) stay on the eager path. The formulas are those of
:mod:`._softmax` and :mod:`._sigmoid`, which remain the reference and the fallback; every op is one
``torch.library.custom_op`` (with a fake implementation), so it is one node to ``torch.compile``::

    sigmoid_block(product, scale, bias, positive, excluded, weights, grad, splits=0) -> (sums, grad_sums)
        sums (c,) Σ_j softplus(−z·l_ij); with grad (c, m) given: grad ← G = −z·σ(−z·l)·w (the
        unweighted G when weights is None) and grad_sums (c,) Σ_j G_ij (else zeros).
    softmax_state(product, scale, bias, positive, excluded, splits=0) -> state
        state (c, 5) float32: m, rest, exact, pos_sum, pos_count, as _softmax.block_state_.
    softmax_grad(product, scale, bias, state, positive, excluded, weights, grad, accumulate=False) -> None
        grad ← (or += with accumulate) w·(p − t) from the rows' final state (merged over blocks),
        the positive's entry without cancellation, as _softmax.gradient_; rows without positive: 0.
    softmax_block(product, scale, bias, positive, excluded, weights, grad) -> state
        softmax_state then softmax_grad in one launch (gather mode: each row complete in this block).

``grad``: ``(c, m)``, float32 / bf16 / fp16, any strides (the half dtypes hold the unweighted G:
apply the row weights after the product, where fp16 cannot underflow); ``weights``: ``(c,)`` float32
or ``None`` (1). ``grad`` may be ``product`` itself (float32) in ``sigmoid_block`` and
``softmax_block``, whose programs each read their rows before writing them, and in
``softmax_grad`` without ``accumulate``, where each program reads and writes its own tile only.
``splits``: how many column spans the rows' sums are cut into, for parallelism (0: chosen from the
shapes and the device); the spans' partial results are merged exactly as blocks are.

Memory traffic per logit (4-byte P read, G written at its dtype's size):

=================  ==========================================  ===============
op                 reads / writes                              bytes per logit
=================  ==========================================  ===============
sigmoid_block      P (4), G (2 bf16 / 4 fp32)                  6 / 8 (4 alone)
softmax_state      P (4)                                       4
softmax_grad       P (4), G (2 / 4; accumulate reads G: +2/4)  6 / 8 (8 / 12)
softmax_block      P twice (8), G (2 / 4)                      10 / 12
=================  ==========================================  ===============

On CUDA the kernels take libdevice's ``exp`` and ``log1p`` (within 2 ulp of the eager ones); under
``TRITON_INTERPRET=1`` (tests, on CPU tensors) numpy's, with ``log1p`` formed from ``log``.
"""

import contextlib
import functools
import math
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from contrastive_dist.losses import _triton_kernels as kernels

__all__ = ["EPILOGUE_VARIABLE", "available", "sigmoid_block", "softmax_block", "softmax_grad", "softmax_state"]

EPILOGUE_VARIABLE = "CONTRASTIVE_DIST_EPILOGUE"
"""``auto`` / unset: the Triton epilogues on CUDA tensors, the eager chain elsewhere; ``eager``: never
Triton; ``triton``: Triton wherever it runs, CPU tensors included when ``TRITON_INTERPRET=1``."""
_CHOICES = ("auto", "eager", "triton")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_TILES_PER_SPLIT = 4  # a span shorter than this pays more in merging than it gains in programs


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available(tensor: Tensor) -> bool:
    """Whether the blocks of ``tensor``'s device take the Triton epilogues (see :data:`EPILOGUE_VARIABLE`).

    Example:
        >>> import torch
        >>> available(torch.zeros(2, 3))  # a CPU tensor: the eager chain, unless asked otherwise
        False
    """
    choice = os.environ.get(EPILOGUE_VARIABLE, "") or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{EPILOGUE_VARIABLE} must be one of {_CHOICES} (or unset), got {choice!r}")
    if choice == "eager" or kernels.triton is None:
        return False
    if tensor.is_cuda:
        return True
    return choice == "triton" and _interpreting()


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Enough programs to fill the device: four per streaming multiprocessor."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _tile(product: Tensor, whole_rows: bool = False) -> tuple[int, int]:
    """Rows × columns of a program's tile: long along whichever direction the product is contiguous in.

    ``whole_rows``: each program owns whole rows (:func:`softmax_block`), so fewer rows per tile keep
    enough programs running when the block has few rows.
    """
    if _interpreting():
        return 16, 32  # small tiles: the tests cover several tiles, tails and spans on small blocks
    if product.stride(1) != 1:
        return 64, 64
    rows = 8
    while whole_rows and rows > 1 and math.ceil(product.shape[0] / rows) < _programs_wanted(product.device):
        rows //= 2
    return rows, 2048 // rows


def _span(product: Tensor, splits: int) -> tuple[int, int]:
    """``(splits, span)``: the column spans of the rows' sums (``span`` a multiple of the tile's width)."""
    rows, columns = product.shape
    tile_rows, tile_columns = _tile(product)
    column_tiles = max(1, math.ceil(columns / tile_columns))
    if splits <= 0:
        splits = math.ceil(_programs_wanted(product.device) / math.ceil(max(rows, 1) / tile_rows))
        splits = min(splits, column_tiles // _MIN_TILES_PER_SPLIT)
    span = math.ceil(column_tiles / max(1, min(splits, column_tiles))) * tile_columns
    return max(1, math.ceil(columns / span)), span


@contextlib.contextmanager
def _on(product: Tensor) -> Iterator[None]:
    """Launch on ``product``'s device (Triton launches on the current one)."""
    with torch.cuda.device(product.device) if product.is_cuda else contextlib.nullcontext():
        yield


def _check(product: Tensor, scale: Tensor, bias: Tensor | None, rows: dict[str, Tensor | None]) -> None:
    """The ops' inputs, as the kernels read them: raise naming the expected and the given."""
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


def _flags(bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None) -> dict[str, bool]:
    return {"HAS_BIAS": bias is not None, "HAS_POS": positive is not None, "HAS_EXCL": excluded is not None}


@torch.library.custom_op("contrastive_dist::sigmoid_block", mutates_args=("grad",))
def sigmoid_block(
    product: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    positive: Tensor | None,
    excluded: Tensor | None,
    weights: Tensor | None,
    grad: Tensor | None,
    splits: int = 0,
) -> tuple[Tensor, Tensor]:
    """SigLIP's pair terms of one block: the rows' sums and, into ``grad``, their logit gradient.

    Shape:
        product, grad: ``(c, m)``; scale, bias: ``()``; positive, excluded, weights: ``(c,)``;
        outputs: ``(c,)``, ``(c,)``.
    """
    _check(product, scale, bias, {"positive": positive, "excluded": excluded, "weights": weights, "grad": grad})
    rows, columns = product.shape
    if not (rows and columns):
        return product.new_zeros(rows), product.new_zeros(rows)
    splits, span = _span(product, splits)
    # Every slot is written by the kernel (grad_sums zeros without grad): no fill launch.
    sums, grad_sums = product.new_empty((splits, rows)), product.new_empty((splits, rows))
    tile_rows, tile_columns = _tile(product)
    g_strides = grad.stride() if grad is not None else (0, 0)
    with _on(product):
        kernels.sigmoid_kernel[(math.ceil(rows / tile_rows), splits)](
            product, *product.stride(), scale, bias, positive, excluded, weights,
            grad, *g_strides, sums, grad_sums, rows, columns, span,
            **_flags(bias, positive, excluded), HAS_W=weights is not None, WRITE_G=grad is not None,
            BR=tile_rows, BC=tile_columns, ACCURATE=not _interpreting(),
        )  # fmt: skip
    return (sums[0], grad_sums[0]) if splits == 1 else (sums.sum(0), grad_sums.sum(0))


@sigmoid_block.register_fake
def _(product, scale, bias, positive, excluded, weights, grad, splits=0):  # type: ignore[no-untyped-def]
    return product.new_empty(product.shape[0]), product.new_empty(product.shape[0])


@torch.library.custom_op("contrastive_dist::softmax_state", mutates_args=())
def softmax_state(
    product: Tensor, scale: Tensor, bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None,
    splits: int = 0,
) -> Tensor:  # fmt: skip
    """The softmax rows' state over one block (``_softmax.block_state_`` with one positive per row).

    Shape:
        product: ``(c, m)``; scale, bias: ``()``; positive, excluded: ``(c,)``; output: ``(c, 5)``.
    """
    _check(product, scale, bias, {"positive": positive, "excluded": excluded})
    rows, columns = product.shape
    splits, span = _span(product, splits)
    state = product.new_empty((rows, 5))
    tile_rows, tile_columns = _tile(product)
    if not rows:
        return state
    grid = (math.ceil(rows / tile_rows), splits)
    flags = _flags(bias, positive, excluded)
    with _on(product):
        out = state if splits == 1 else product.new_empty((splits, rows, 3))
        kernels.state_kernel[grid](
            product, *product.stride(), scale, bias, positive, excluded, out, rows, columns, span,
            **flags, SINGLE=splits == 1, BR=tile_rows, BC=tile_columns, ACCURATE=not _interpreting(),
        )  # fmt: skip
        if splits > 1:
            kernels.finish_kernel[grid[:1]](
                out, splits, positive, excluded, state, rows, columns, HAS_POS=flags["HAS_POS"],
                HAS_EXCL=flags["HAS_EXCL"], BR=tile_rows, ACCURATE=not _interpreting(),
            )  # fmt: skip
    return state


@softmax_state.register_fake
def _(product, scale, bias, positive, excluded, splits=0):  # type: ignore[no-untyped-def]
    return product.new_empty((product.shape[0], 5))


@torch.library.custom_op("contrastive_dist::softmax_grad", mutates_args=("grad",))
def softmax_grad(
    product: Tensor, scale: Tensor, bias: Tensor | None, state: Tensor, positive: Tensor | None,
    excluded: Tensor | None, weights: Tensor | None, grad: Tensor, accumulate: bool = False,
) -> None:  # fmt: skip
    """``grad`` ← (``+=`` with ``accumulate``) the softmax gradient of one block from the rows' final state.

    Shape:
        product, grad: ``(c, m)``; scale, bias: ``()``; state: ``(c, 5)``; positive, excluded, weights: ``(c,)``.
    """
    _check(product, scale, bias, {"positive": positive, "excluded": excluded, "weights": weights,
                                  "state": state, "grad": grad})  # fmt: skip
    rows, columns = product.shape
    tile_rows, tile_columns = _tile(product)
    if not (rows and columns):
        return
    with _on(product):
        kernels.grad_kernel[(math.ceil(rows / tile_rows), math.ceil(columns / tile_columns))](
            product, *product.stride(), scale, bias, state, positive, excluded, weights,
            grad, *grad.stride(), rows, columns, **_flags(bias, positive, excluded), HAS_W=weights is not None,
            ACCUMULATE=accumulate, BR=tile_rows, BC=tile_columns, ACCURATE=not _interpreting(),
        )  # fmt: skip


@softmax_grad.register_fake
def _(product, scale, bias, state, positive, excluded, weights, grad, accumulate=False):  # type: ignore[no-untyped-def]
    return None


@torch.library.custom_op("contrastive_dist::softmax_block", mutates_args=("grad",))
def softmax_block(
    product: Tensor, scale: Tensor, bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None,
    weights: Tensor | None, grad: Tensor,
) -> Tensor:  # fmt: skip
    """:func:`softmax_state` and :func:`softmax_grad` of a block that holds its rows' every column, one launch.

    Shape:
        product, grad: ``(c, m)``; scale, bias: ``()``; positive, excluded, weights: ``(c,)``; output: ``(c, 5)``.
    """
    _check(product, scale, bias, {"positive": positive, "excluded": excluded, "weights": weights, "grad": grad})
    rows, columns = product.shape
    state = product.new_empty((rows, 5))
    tile_rows, tile_columns = _tile(product, whole_rows=True)
    if not rows:
        return state
    with _on(product):
        kernels.block_kernel[(math.ceil(rows / tile_rows),)](
            product, *product.stride(), scale, bias, positive, excluded, weights, state,
            grad, *grad.stride(), rows, columns, **_flags(bias, positive, excluded), HAS_W=weights is not None,
            BR=tile_rows, BC=tile_columns, ACCURATE=not _interpreting(),
        )  # fmt: skip
    return state


@softmax_block.register_fake
def _(product, scale, bias, positive, excluded, weights, grad):  # type: ignore[no-untyped-def]
    return product.new_empty((product.shape[0], 5))
