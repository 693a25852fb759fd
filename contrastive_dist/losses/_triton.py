"""The fused block epilogues as Triton kernels (CUDA): what follows a block's product, one launch each.

Each op reads the raw product ``P = Q Kᵀ`` of a block (``(c, m)`` float32, any strides: a
direction seen transposed is passed as ``P.T``), a 0-d float32 ``scale`` and an optional 0-d
``bias`` (device tensors, so nothing waits on the host), and forms the logits ``l = s · P (+ b)``
inside the kernel. A row's targets are ``positive`` (``(c,)`` int64, its positive column, ``-1`` or
any index outside ``[0, m)``: none in this block), ``excluded`` (the same, a column whose logit
is ``-inf``) and, with keys (labels, ids), ``row_keys`` (``(c,)``) against ``column_keys`` (``(k,)``,
the block's first ``k ≤ m`` columns; the others have none), compared in the kernel, never formed as
a mask: with ``keys_positive`` every pair that shares a key is a positive (its excluded column
excepted; SupCon's anchors, without a positive column, keep the maxima's terms exact by counting
them), otherwise such pairs leave the row's candidates, its positive excepted. The formulas are those of
:mod:`._softmax` and :mod:`._sigmoid`, which remain the reference and the fallback; every op is one
``torch.library.custom_op`` (with a fake implementation), so it is one node to ``torch.compile``::

    sigmoid_block(product, scale, bias, positive, excluded, weights, grad, splits=0, *keys) -> (sums, grad_sums)
        sums (c,) Σ_j softplus(−z·l_ij); with grad (c, m) given: grad ← G = −z·σ(−z·l)·w (the
        unweighted G when weights is None) and grad_sums (c,) Σ_j G_ij (else zeros).
    softmax_state(product, scale, bias, positive, excluded, splits=0, *keys) -> state
        state (c, 5) float32: m, rest, exact, pos_sum, pos_count, as _softmax.block_state_.
    softmax_grad(product, scale, bias, state, positive, excluded, weights, grad, *keys) -> None
        grad ← w·(p − t) from the rows' final state (merged over blocks),
        the positive's entry without cancellation, as _softmax.gradient_; rows without positive: 0.
    softmax_block(product, scale, bias, positive, excluded, weights, grad, *keys) -> state
        softmax_state then softmax_grad in one launch (gather mode: each row complete in this block).
    softmax_pairs(product, scale, bias, positive, excluded, column_positive, column_excluded, width, splits=0,
                  *keys, column_shift=0) -> (state, column_state)
        the rows' state and the first ``width`` columns' (seen as rows: a symmetric loss's other direction)
        from one read: softmax_state of ``product`` and of ``product[:, :width].T``.
    softmax_pair_grad(product, scale, bias, state, positive, excluded, weights, column_state, column_positive,
                      column_excluded, column_weights, grad, *keys, column_shift=0) -> None
        grad ← the rows' gradient plus the columns' (transposed) from one read, written once.

``*keys``: ``row_keys=None, column_keys=None, keys_positive=False, positive_shift=0``; the
positive of a row is its ``positive`` entry less ``positive_shift`` (≥ 0): a direction seen
transposed passes the columns' positives as they are and the chunk's first row, no launch to shift them.
``grad``: ``(c, m)``, float32 / bf16 / fp16, any strides (the half dtypes hold the unweighted G:
apply the row weights after the product, where fp16 cannot underflow); ``weights``: ``(c,)`` float32
or ``None`` (1). ``grad`` may be ``product`` itself (float32) in ``sigmoid_block``, ``softmax_block`` and
``softmax_pair_grad``, whose programs each read their rows before writing them, and in
``softmax_grad``, where each program reads and writes its own tile only.
``splits``: how many column spans the rows' sums are cut into, for parallelism (0: chosen from the
shapes and the device); the spans' partial results are merged exactly as blocks are.

Memory traffic per logit (4-byte P read, G written at its dtype's size) and launches per call:

=================  ==========================================  ===============  ==========================
op                 reads / writes                              bytes per logit  launches
=================  ==========================================  ===============  ==========================
sigmoid_block      P (4), G (2 bf16 / 4 fp32)                  6 / 8 (4 alone)  1 (+1 row sum when split)
softmax_state      P (4)                                       4                1 (+1 merge when split)
softmax_grad       P (4), G (2 / 4)                            6 / 8            1
softmax_block      P twice (8), G (2 / 4)                      10 / 12          1
softmax_pairs      P (4), partial column states (see traffic)  4 (+ ~0.6)       1 (+1 merge)
softmax_pair_grad  P (4), G (2 / 4)                            6 / 8            1
=================  ==========================================  ===============  ==========================

Outputs are allocated empty (no fill launch); the per-row reads (targets, weights, state) add
``O(c)`` bytes. Per logit the kernels take fast arithmetic (the hardware's ``exp2`` and approximate
division, ``log1p`` from a series: a few ulp of float32, see :mod:`._triton_kernels`); under
``TRITON_INTERPRET=1`` (tests, on CPU tensors) the same formulas run in numpy. Each kernel's tile
and warps come from :func:`._triton_launch.tile`.
"""

import math
import os

import torch
from torch import Tensor

from contrastive_dist.losses import _triton_kernels as kernels
from contrastive_dist.losses import _triton_launch as launch
from contrastive_dist.losses._epilogue import EPILOGUE_VARIABLE
from contrastive_dist.losses._triton_pairs import softmax_pair_grad, softmax_pairs
from contrastive_dist.losses._triton_traffic import traffic

__all__ = [
    "EPILOGUE_VARIABLE",
    "available",
    "sigmoid_block",
    "softmax_block",
    "softmax_grad",
    "softmax_pair_grad",
    "softmax_pairs",
    "softmax_state",
    "traffic",
]

_CHOICES = ("auto", "eager", "triton")


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
    return choice == "triton" and launch.interpreting()


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
    row_keys: Tensor | None = None,
    column_keys: Tensor | None = None,
    keys_positive: bool = False,
    positive_shift: int = 0,
) -> tuple[Tensor, Tensor]:
    """SigLIP's pair terms of one block: the rows' sums and, into ``grad``, their logit gradient.

    Shape:
        product, grad: ``(c, m)``; scale, bias: ``()``; positive, excluded, weights, row_keys: ``(c,)``;
        column_keys: ``(k,)``, ``k ≤ m``; outputs: ``(c,)``, ``(c,)``.
    """
    launch.check(product, scale, bias, {"positive": positive, "excluded": excluded, "weights": weights, "grad": grad},
                 row_keys, column_keys, positive_shift)  # fmt: skip
    rows, columns = product.shape
    if not (rows and columns):
        return product.new_zeros(rows), product.new_zeros(rows)
    program = launch.tile(product, "sigmoid")
    tile_rows, tile_columns, warps = program
    splits, span = launch.span(product, splits, program)
    # Every slot is written by the kernel (grad_sums zeros without grad): no fill launch.
    sums, grad_sums = product.new_empty((splits, rows)), product.new_empty((splits, rows))
    g_strides = grad.stride() if grad is not None else (0, 0)
    with launch.on(product):
        kernels.sigmoid_kernel[(math.ceil(rows / tile_rows), splits)](
            product, *product.stride(), scale, bias, positive, excluded, positive_shift,
            *launch.keys(row_keys, column_keys), weights, grad, *g_strides, sums, grad_sums, rows, columns, span,
            **launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive),
            HAS_W=weights is not None, WRITE_G=grad is not None,
            BR=tile_rows, BC=tile_columns, num_warps=warps,
        )  # fmt: skip
    return (sums[0], grad_sums[0]) if splits == 1 else (sums.sum(0), grad_sums.sum(0))


@sigmoid_block.register_fake
def _(product, scale, bias, positive, excluded, weights, grad, splits=0, row_keys=None, column_keys=None,  # type: ignore[no-untyped-def]
      keys_positive=False, positive_shift=0):
    return product.new_empty(product.shape[0]), product.new_empty(product.shape[0])


@torch.library.custom_op("contrastive_dist::softmax_state", mutates_args=())
def softmax_state(
    product: Tensor, scale: Tensor, bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None,
    splits: int = 0, row_keys: Tensor | None = None, column_keys: Tensor | None = None, keys_positive: bool = False,
    positive_shift: int = 0,
) -> Tensor:  # fmt: skip
    """The softmax rows' state over one block (``_softmax.block_state_``).

    Shape:
        product: ``(c, m)``; scale, bias: ``()``; positive, excluded, row_keys: ``(c,)``; column_keys:
        ``(k,)``; output: ``(c, 5)``.
    """
    launch.check(product, scale, bias, {"positive": positive, "excluded": excluded}, row_keys, column_keys,
                 positive_shift)
    rows, columns = product.shape
    program = launch.tile(product, "state")
    tile_rows, tile_columns, warps = program
    splits, span = launch.span(product, splits, program)
    state = product.new_empty((rows, 5))
    if not rows:
        return state
    grid = (math.ceil(rows / tile_rows), splits)
    targets = launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive)
    with launch.on(product):
        out = state if splits == 1 else product.new_empty((splits, rows, 5))
        kernels.state_kernel[grid](
            product, *product.stride(), scale, bias, positive, excluded, positive_shift,
            *launch.keys(row_keys, column_keys), out,
            rows, columns, span,
            **targets, SINGLE=splits == 1, BR=tile_rows, BC=tile_columns, num_warps=warps,
        )  # fmt: skip
        if splits > 1:
            kernels.finish_kernel[grid[:1]](
                out, splits, positive, excluded, positive_shift, state, rows, columns, HAS_POS=targets["HAS_POS"],
                HAS_EXCL=targets["HAS_EXCL"], KEY_RULE=targets["KEY_RULE"], BR=tile_rows,
            )  # fmt: skip
    return state


@softmax_state.register_fake
def _(product, scale, bias, positive, excluded, splits=0, row_keys=None, column_keys=None,  # type: ignore[no-untyped-def]
      keys_positive=False, positive_shift=0):
    return product.new_empty((product.shape[0], 5))


@torch.library.custom_op("contrastive_dist::softmax_grad", mutates_args=("grad",))
def softmax_grad(
    product: Tensor, scale: Tensor, bias: Tensor | None, state: Tensor, positive: Tensor | None,
    excluded: Tensor | None, weights: Tensor | None, grad: Tensor,
    row_keys: Tensor | None = None, column_keys: Tensor | None = None, keys_positive: bool = False,
    positive_shift: int = 0,
) -> None:  # fmt: skip
    """``grad`` ← the softmax gradient of one block from the rows' final state.

    Shape:
        product, grad: ``(c, m)``; scale, bias: ``()``; state: ``(c, 5)``; positive, excluded, weights,
        row_keys: ``(c,)``; column_keys: ``(k,)``.
    """
    rows_in = {"positive": positive, "excluded": excluded, "weights": weights, "state": state, "grad": grad}
    launch.check(product, scale, bias, rows_in, row_keys, column_keys, positive_shift)
    rows, columns = product.shape
    tile_rows, tile_columns, warps = launch.tile(product, "grad")
    if not (rows and columns):
        return
    with launch.on(product):
        kernels.grad_kernel[(math.ceil(rows / tile_rows), math.ceil(columns / tile_columns))](
            product, *product.stride(), scale, bias, state, positive, excluded, positive_shift,
            *launch.keys(row_keys, column_keys),
            weights, grad, *grad.stride(), rows, columns,
            **launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive), HAS_W=weights is not None,
            BR=tile_rows, BC=tile_columns, num_warps=warps,
        )  # fmt: skip


@softmax_grad.register_fake
def _(product, scale, bias, state, positive, excluded, weights, grad,  # type: ignore[no-untyped-def]
      row_keys=None, column_keys=None, keys_positive=False, positive_shift=0):
    return None


@torch.library.custom_op("contrastive_dist::softmax_block", mutates_args=("grad",))
def softmax_block(
    product: Tensor, scale: Tensor, bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None,
    weights: Tensor | None, grad: Tensor, row_keys: Tensor | None = None, column_keys: Tensor | None = None,
    keys_positive: bool = False, positive_shift: int = 0,
) -> Tensor:  # fmt: skip
    """:func:`softmax_state` and :func:`softmax_grad` of a block that holds its rows' every column, one launch.

    Shape:
        product, grad: ``(c, m)``; scale, bias: ``()``; positive, excluded, weights, row_keys: ``(c,)``;
        column_keys: ``(k,)``; output: ``(c, 5)``.
    """
    launch.check(product, scale, bias, {"positive": positive, "excluded": excluded, "weights": weights, "grad": grad},
                 row_keys, column_keys, positive_shift)  # fmt: skip
    rows, columns = product.shape
    state = product.new_empty((rows, 5))
    tile_rows, tile_columns, warps = launch.tile(product, "block")
    if not rows:
        return state
    with launch.on(product):
        kernels.block_kernel[(math.ceil(rows / tile_rows),)](
            product, *product.stride(), scale, bias, positive, excluded, positive_shift,
            *launch.keys(row_keys, column_keys), weights, state, grad, *grad.stride(), rows, columns,
            **launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive), HAS_W=weights is not None,
            BR=tile_rows, BC=tile_columns, num_warps=warps,
        )  # fmt: skip
    return state


@softmax_block.register_fake
def _(product, scale, bias, positive, excluded, weights, grad, row_keys=None, column_keys=None,  # type: ignore[no-untyped-def]
      keys_positive=False, positive_shift=0):
    return product.new_empty((product.shape[0], 5))
