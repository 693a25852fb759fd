"""A symmetric loss's two directions from one read of each product: the pair kernels and their ops (CUDA).

A visit's rows and its column side (the block's first ``width`` columns seen as rows: InfoNCE's texts
against its images) share one product ``P``. Each tile of ``P`` is read once a pass and serves both:
``softmax_pairs`` gives both states, ``softmax_pair_grad`` both gradients, written once (signatures in
:mod:`._triton`, which re-exports them). The formulas are the single-direction kernels', reduced along
either axis of a tile (:func:`._triton_tiles._stats_step`), each side's targets from one function
(:func:`._triton_tiles._side_targets`); partial states merge as ``finish_kernel`` merges spans.
Importable without Triton (the kernels are then absent).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.losses import _triton_launch as launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the eager family functions serve instead
    triton = None

__all__ = ["pair_finish_kernel", "pair_grad_kernel", "pair_state_kernel", "programs_of_rows", "softmax_pair_grad",
           "softmax_pairs"]

pair_finish_kernel: Any = None
pair_grad_kernel: Any = None
pair_state_kernel: Any = None

if triton is not None:
    from contrastive_dist.losses._triton_kernels import _merge  # noqa: F401 - the kernels' globals, for Triton
    from contrastive_dist.losses._triton_tiles import (  # noqa: F401 - the kernels' globals, for Triton
        _empty_stats,
        _finish,
        _load_state,
        _logits,
        _program_rows,
        _row_targets,
        _row_weights,
        _same_keys,
        _side_targets,
        _softmax_grad_tile,
        _stats_step,
        _store_grad,
        _store_state,
    )

    @triton.jit
    def _pair_tile(p_ptr, stride_r, stride_c, rows, row_ok, start, end, width, scale, bias, pos, excl, row_keys,
                   ck_ptr, keyed, cpos_ptr, cexcl_ptr, cpos_shift, c, HAS_BIAS: tl.constexpr, HAS_CPOS: tl.constexpr,
                   HAS_CEXCL: tl.constexpr, KEY_RULE: tl.constexpr, BC: tl.constexpr):
        """The tile of columns ``[start, start + BC)`` read once, with both sides' targets, all ``(BR, BC)``.

        Returns ``(cols, col_ok, side_ok, logits, row targets ×3, column targets ×3)``: the rows' as
        :func:`_tile` gives them; the column side's (``side_ok``: one of the block's first ``width``
        columns) with rows and columns swapped: its positive and excluded rows (less ``cpos_shift``), the
        tile's rows past the block outside, the same keys.
        """
        cols = start + tl.arange(0, BC)
        col_ok = cols < end
        side_ok = col_ok & (cols < width)
        logits = _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS)
        same = _same_keys(row_keys, ck_ptr, cols, col_ok, keyed, KEY_RULE)
        at_positive, by_key, left_out = _side_targets(cols[None, :] == pos[:, None], cols[None, :] == excl[:, None],
                                                      ~col_ok[None, :], same, KEY_RULE)
        cpos, cexcl = _row_targets(cpos_ptr, cexcl_ptr, cpos_shift, cols, side_ok, c, HAS_CPOS, HAS_CEXCL)
        c_at, c_key, c_left = _side_targets(rows[:, None] == cpos[None, :], rows[:, None] == cexcl[None, :],
                                            ~row_ok[:, None] | ~side_ok[None, :], same, KEY_RULE)
        return cols, col_ok, side_ok, logits, at_positive, by_key, left_out, c_at, c_key, c_left

    @triton.jit
    def pair_state_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift,
                          cpos_ptr, cexcl_ptr, cpos_shift, rk_ptr, ck_ptr, keyed, row_out_ptr, column_out_ptr,
                          c, m, width, span,
                          HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr,
                          HAS_CPOS: tl.constexpr, HAS_CEXCL: tl.constexpr, KEY_RULE: tl.constexpr,
                          ROWS_SINGLE: tl.constexpr, COLUMNS_SINGLE: tl.constexpr, BR: tl.constexpr,
                          BC: tl.constexpr):
        """The rows' softmax state and the first ``width`` columns' from one read of each tile.

        Each program reads its rows' span of columns once: the rows' five numbers run along the span (final
        ``(c, 5)`` when ROWS_SINGLE, else partial ``(splits, c, 5)``), each tile's columns take the
        program's rows (final ``(width, 5)`` when COLUMNS_SINGLE, one program of rows, else partial
        ``(row programs, width, 5)``); :func:`finish_kernel` merges partials.
        """
        rows, row_ok, scale, bias, pos, excl, row_keys = _program_rows(
            scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR, HAS_BIAS, HAS_POS, HAS_EXCL, KEY_RULE)
        begin = tl.program_id(1) * span
        end = tl.minimum(begin + span, m)
        row_max, rest, exact, key_sum, key_count = _empty_stats(rows)
        for start in range(begin, end, BC):
            cols, col_ok, side_ok, logits, at_positive, by_key, left_out, c_at, c_key, c_left = _pair_tile(
                p_ptr, stride_r, stride_c, rows, row_ok, start, end, width, scale, bias, pos, excl, row_keys, ck_ptr,
                keyed, cpos_ptr, cexcl_ptr, cpos_shift, c, HAS_BIAS, HAS_CPOS, HAS_CEXCL, KEY_RULE, BC,
            )
            row_max, rest, exact, key_sum, key_count = _stats_step(
                row_max, rest, exact, key_sum, key_count, logits, at_positive, by_key, left_out, HAS_POS, KEY_RULE, 1)
            c_max, c_rest, c_exact, c_sum, c_count = _empty_stats(cols)
            c_max, c_rest, c_exact, c_sum, c_count = _stats_step(
                c_max, c_rest, c_exact, c_sum, c_count, logits, c_at, c_key, c_left, HAS_CPOS, KEY_RULE, 0)
            if COLUMNS_SINGLE:
                cpos, cexcl = _row_targets(cpos_ptr, cexcl_ptr, cpos_shift, cols, side_ok, c, HAS_CPOS, HAS_CEXCL)
                c_max, c_rest, c_exact, c_sum, c_count = _finish(c_max, c_rest, c_exact, c_sum, c_count, cpos, cexcl,
                                                                 HAS_CPOS, KEY_RULE)
                _store_state(column_out_ptr, cols, side_ok, c_max, c_rest, c_exact, c_sum, c_count)
            else:
                _store_state(column_out_ptr + tl.program_id(0) * width * 5, cols, side_ok, c_max, c_rest, c_exact,
                             c_sum, c_count)
        if ROWS_SINGLE:
            row_max, rest, exact, key_sum, key_count = _finish(row_max, rest, exact, key_sum, key_count, pos, excl,
                                                               HAS_POS, KEY_RULE)
            _store_state(row_out_ptr, rows, row_ok, row_max, rest, exact, key_sum, key_count)
        else:
            _store_state(row_out_ptr + tl.program_id(1) * c * 5, rows, row_ok, row_max, rest, exact, key_sum,
                         key_count)

    @triton.jit
    def pair_finish_kernel(partial_ptr, splits, pos_ptr, excl_ptr, pos_shift, state_ptr, c, m, row_blocks,
                           cpartial_ptr, row_programs, cpos_ptr, cexcl_ptr, cpos_shift, cstate_ptr, width,
                           HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_CPOS: tl.constexpr,
                           HAS_CEXCL: tl.constexpr, KEY_RULE: tl.constexpr, BR: tl.constexpr):
        """:func:`pair_state_kernel`'s merges in one launch.

        Its first ``row_blocks`` programs merge the rows' spans, the others the columns' programs of rows.
        """
        block = tl.program_id(0)
        if block < row_blocks:
            rows = block * BR + tl.arange(0, BR)
            _merge(partial_ptr, splits, pos_ptr, excl_ptr, pos_shift, state_ptr, rows, c, m, HAS_POS, HAS_EXCL,
                   KEY_RULE)
        else:
            cols = (block - row_blocks) * BR + tl.arange(0, BR)
            _merge(cpartial_ptr, row_programs, cpos_ptr, cexcl_ptr, cpos_shift, cstate_ptr, cols, width, c, HAS_CPOS,
                   HAS_CEXCL, KEY_RULE)

    @triton.jit
    def pair_grad_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, state_ptr, pos_ptr, excl_ptr, pos_shift,
                         cstate_ptr, cpos_ptr, cexcl_ptr, cpos_shift, rk_ptr, ck_ptr, keyed, w_ptr, cw_ptr,
                         g_ptr, g_stride_r, g_stride_c, c, m, width,
                         HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr,
                         HAS_CPOS: tl.constexpr, HAS_CEXCL: tl.constexpr, KEY_RULE: tl.constexpr,
                         HAS_W: tl.constexpr, HAS_CW: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """Whole rows, their columns in order: each tile's rows' gradient plus its columns', written once.

        A program reads each tile before it writes its gradient, and only its own rows: ``G`` may be written
        over the product (float32), or into the first half of each of its rows' bytes (bfloat16).
        """
        rows, row_ok, scale, bias, pos, excl, row_keys = _program_rows(
            scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR, HAS_BIAS, HAS_POS, HAS_EXCL, KEY_RULE)
        row_max, rest, exact, pos_count = _load_state(state_ptr, rows, row_ok)
        live = _row_weights(w_ptr, rows, row_ok, pos_count, HAS_W)
        for start in range(0, m, BC):
            cols, col_ok, side_ok, logits, at_positive, by_key, left_out, c_at, c_key, c_left = _pair_tile(
                p_ptr, stride_r, stride_c, rows, row_ok, start, m, width, scale, bias, pos, excl, row_keys, ck_ptr,
                keyed, cpos_ptr, cexcl_ptr, cpos_shift, c, HAS_BIAS, HAS_CPOS, HAS_CEXCL, KEY_RULE, BC,
            )
            grad = _softmax_grad_tile(logits, at_positive, by_key, left_out, row_max, rest, exact, pos_count, live,
                                      KEY_RULE, 1)
            c_max, c_rest, c_exact, c_count = _load_state(cstate_ptr, cols, side_ok)
            c_live = _row_weights(cw_ptr, cols, side_ok, c_count, HAS_CW)
            grad += _softmax_grad_tile(logits, c_at, c_key, c_left, c_max, c_rest, c_exact, c_count, c_live,
                                       KEY_RULE, 0)
            _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad)


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
    row_programs = programs_of_rows(product)
    state, column_state = product.new_empty((rows, 5)), product.new_empty((width, 5))
    targets = launch.flags(bias, positive, excluded, row_keys, column_keys, keys_positive)
    with launch.on(product):
        row_out = state if splits == 1 else product.new_empty((splits, rows, 5))
        column_out = column_state if row_programs == 1 else product.new_empty((row_programs, width, 5))
        pair_state_kernel[(row_programs, splits)](
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
            pair_finish_kernel[(row_blocks + column_blocks,)](
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
        pair_grad_kernel[(math.ceil(rows / tile_rows),)](
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


def programs_of_rows(product: Tensor) -> int:
    """How many programs of rows :func:`softmax_pairs` takes: each leaves a partial state of every column.

    At least one: a block without rows still gives its columns their (empty) state.
    """
    return max(1, math.ceil(product.shape[0] / launch.tile(product, "pairs").rows))
