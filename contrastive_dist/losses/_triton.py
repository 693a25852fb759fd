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
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.losses import _triton_kernels as kernels
from contrastive_dist.losses import _triton_launch as launch
from contrastive_dist.losses._epilogue import EPILOGUE_VARIABLE

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


@torch.library.custom_op("contrastive_dist::softmax_pairs", mutates_args=())
def softmax_pairs(
    product: Tensor, scale: Tensor, bias: Tensor | None, positive: Tensor | None, excluded: Tensor | None,
    column_positive: Tensor | None, column_excluded: Tensor | None, width: int, splits: int = 0,
    row_keys: Tensor | None = None, column_keys: Tensor | None = None, keys_positive: bool = False,
    positive_shift: int = 0, column_shift: int = 0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The rows' softmax state and the first ``width`` columns' (seen as rows), from one read of the product.

    Equal to ``softmax_state`` of ``product`` and of ``product[:, :width].T``, whose targets the column
    arguments are: ``column_positive`` and ``column_excluded`` ``(width,)`` each column's positive and
    excluded row (less ``column_shift``), the same keys swapped (the columns' own ``column_keys[:width]``
    against ``row_keys``).

    Shape:
        product: ``(c, m)``; scale, bias: ``()``; positive, excluded, row_keys: ``(c,)``; column_positive,
        column_excluded: ``(width,)``, ``width ≤ m``; column_keys: ``(k,)``, ``width ≤ k`` with keys;
        outputs: ``(c, 5)``, ``(width, 5)``.
    """
    _check_pairs(product, scale, bias, {"positive": positive, "excluded": excluded},
                 {"positive": column_positive, "excluded": column_excluded}, width, row_keys, column_keys,
                 positive_shift, column_shift)  # fmt: skip
    rows, columns = product.shape
    program = launch.tile(product, "pairs")
    tile_rows, tile_columns, warps = program
    splits, span = launch.span(product, splits, program)
    row_programs = max(1, math.ceil(rows / tile_rows))  # one without rows still gives the columns their state
    state, column_state = product.new_empty((rows, 5)), product.new_empty((width, 5))
    targets = launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive)
    with launch.on(product):
        row_out = state if splits == 1 else product.new_empty((splits, rows, 5))
        column_out = column_state if row_programs == 1 else product.new_empty((row_programs, width, 5))
        kernels.pair_state_kernel[(row_programs, splits)](
            product, *product.stride(), scale, bias, positive, excluded, positive_shift,
            column_positive, column_excluded, column_shift, *launch.keys(row_keys, column_keys),
            row_out, column_out, rows, columns, width, span,
            **targets, HAS_CPOS=column_positive is not None, HAS_CEXCL=column_excluded is not None,
            ROWS_SINGLE=splits == 1, COLUMNS_SINGLE=row_programs == 1, BR=tile_rows, BC=tile_columns, num_warps=warps,
        )  # fmt: skip
        # The rows' spans and the columns' programs of rows merged in one launch (a state already final: none).
        row_blocks = math.ceil(rows / tile_rows) if splits > 1 else 0
        column_blocks = math.ceil(width / tile_rows) if row_programs > 1 else 0
        if row_blocks + column_blocks:
            kernels.pair_finish_kernel[(row_blocks + column_blocks,)](
                row_out, splits, positive, excluded, positive_shift, state, rows, columns, row_blocks,
                column_out, row_programs, column_positive, column_excluded, column_shift, column_state, width,
                HAS_POS=targets["HAS_POS"], HAS_EXCL=targets["HAS_EXCL"], HAS_CPOS=column_positive is not None,
                HAS_CEXCL=column_excluded is not None, KEY_RULE=targets["KEY_RULE"], BR=tile_rows,
            )  # fmt: skip
    return state, column_state


@softmax_pairs.register_fake
def _(product, scale, bias, positive, excluded, column_positive, column_excluded, width, splits=0,  # type: ignore[no-untyped-def]
      row_keys=None, column_keys=None, keys_positive=False, positive_shift=0, column_shift=0):
    return product.new_empty((product.shape[0], 5)), product.new_empty((width, 5))


@torch.library.custom_op("contrastive_dist::softmax_pair_grad", mutates_args=("grad",))
def softmax_pair_grad(
    product: Tensor, scale: Tensor, bias: Tensor | None, state: Tensor, positive: Tensor | None,
    excluded: Tensor | None, weights: Tensor | None, column_state: Tensor, column_positive: Tensor | None,
    column_excluded: Tensor | None, column_weights: Tensor | None, grad: Tensor, row_keys: Tensor | None = None,
    column_keys: Tensor | None = None, keys_positive: bool = False, positive_shift: int = 0, column_shift: int = 0,
) -> None:  # fmt: skip
    """``grad`` ← the rows' softmax gradient plus, on the first ``width`` columns, the columns' (transposed).

    Equal to ``softmax_grad`` of the rows, then of ``product[:, :width].T`` from the columns' final state
    ``column_state`` ``(width, 5)`` added onto ``grad[:, :width].T``: one read of the product, one write of
    ``grad``. Each program owns whole rows and reads each tile before writing it: ``grad`` may be
    ``product`` itself (float32), or its rows' first halves (bfloat16, strides ``(2m, 1)``).

    Shape:
        product, grad: ``(c, m)``; state: ``(c, 5)``; positive, excluded, weights, row_keys: ``(c,)``;
        column_state: ``(width, 5)``; column_positive, column_excluded, column_weights: ``(width,)``.
    """
    width = column_state.shape[0]
    _check_pairs(product, scale, bias, {"positive": positive, "excluded": excluded, "weights": weights,
                                        "state": state, "grad": grad},
                 {"positive": column_positive, "excluded": column_excluded, "weights": column_weights,
                  "state": column_state}, width, row_keys, column_keys, positive_shift, column_shift)  # fmt: skip
    rows, columns = product.shape
    tile_rows, tile_columns, warps = launch.tile(product, "pair_grad")
    if not (rows and columns):
        return
    with launch.on(product):
        kernels.pair_grad_kernel[(math.ceil(rows / tile_rows),)](
            product, *product.stride(), scale, bias, state, positive, excluded, positive_shift,
            column_state, column_positive, column_excluded, column_shift, *launch.keys(row_keys, column_keys),
            weights, column_weights, grad, *grad.stride(), rows, columns, width,
            **launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive),
            HAS_CPOS=column_positive is not None, HAS_CEXCL=column_excluded is not None, HAS_W=weights is not None,
            HAS_CW=column_weights is not None, BR=tile_rows, BC=tile_columns, num_warps=warps,
        )  # fmt: skip


@softmax_pair_grad.register_fake
def _(product, scale, bias, state, positive, excluded, weights, column_state, column_positive,  # type: ignore[no-untyped-def]
      column_excluded, column_weights, grad, row_keys=None, column_keys=None, keys_positive=False, positive_shift=0,
      column_shift=0):
    return None


def _check_pairs(
    product: Tensor, scale: Tensor, bias: Tensor | None, rows: dict[str, Tensor | None],
    columns: dict[str, Tensor | None], width: int, row_keys: Tensor | None, column_keys: Tensor | None,
    positive_shift: int, column_shift: int,
) -> None:  # fmt: skip
    """Both sides' inputs, as the kernels read them.

    The rows' against ``product``, the columns' against its first ``width`` columns seen as rows (their keys
    the columns' first ``width``).
    """
    if not 0 <= width <= product.shape[1]:
        raise ValueError(f"width must be between 0 and the block's {product.shape[1]} columns, got {width}")
    launch.check(product, scale, bias, rows, row_keys, column_keys, positive_shift)
    own_keys = None if column_keys is None else column_keys[:width]
    if own_keys is not None and own_keys.shape[0] < width:
        raise TypeError(f"column_keys must hold a key for each of the {width} columns with a side, got "
                        f"{column_keys.shape[0]}")  # type: ignore[union-attr]
    launch.check(product[:, :width].T, scale, bias, columns, own_keys, row_keys, column_shift)


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
        row_programs = max(1, math.ceil(rows / launch.tile(product, "pairs").rows))
        partial = 0 if row_programs == 1 else 2 * row_programs * bound["width"] * 20
        moved += 20 * bound["width"] + partial
    return int(moved)
