"""The Triton kernels behind :mod:`._triton`: one fused epilogue per family, on a block's raw product.

Every kernel reads the product ``P`` of a block (``c × m`` float32, any strides) and forms the
logits ``l = s · P (+ b)`` itself, tile by tile (``BR`` rows × ``BC`` columns); the rows' targets
are a positive column and an excluded column per row (``-1``: none) and, with keys (labels, ids), the
pairs whose row and column keys are equal, compared in the tile (``KEY_RULE``: 1, they are positives;
2, they leave the row's candidates, its positive excepted; 0, no keys). The formulas are those of
:mod:`._softmax` and :mod:`._sigmoid`, term for term; the shared pieces are written once here as
``@triton.jit`` helpers in :mod:`._triton_tiles`. Importable without Triton (the kernels are then absent).

Per logit, the arithmetic is the GPU's fast kind: ``tl.exp`` (the hardware's ``ex2``), ``/`` (its
approximate division) and :func:`_log1p`'s series, each within a few ulp of float32, far inside the
logits' own error (a product's rounding times the scale); the rows' statistics keep IEEE divisions.
With libdevice's ``exp``, ``log1p`` and IEEE divisions a SigLIP block took 2.3× the time of reading
and writing its bytes on an H200; 1.8× with these (docs/benchmarks.md#gpu). Triton's interpreter
runs the same formulas in numpy: the tests on the CPU check the formulas, the CUDA run of the same
tests the hardware's approximations.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the eager family functions serve instead
    triton = None

__all__ = ["block_kernel", "finish_kernel", "grad_kernel", "sigmoid_kernel", "state_kernel"]

block_kernel: Any = None
finish_kernel: Any = None
grad_kernel: Any = None
sigmoid_kernel: Any = None
state_kernel: Any = None

if triton is not None:
    from contrastive_dist.losses._triton_tiles import (  # noqa: F401 - the kernels' globals, for Triton
        _KEYS_MASKED,
        _KEYS_POSITIVE,
        _NO_CANDIDATE,
        _NO_KEYS,
        _TINY,
        _empty_stats,
        _finish,
        _finite,
        _load_state,
        _log1p,
        _logits,
        _program_rows,
        _row_keys,
        _row_targets,
        _row_weights,
        _same_keys,
        _scalars,
        _side_targets,
        _softmax_grad_tile,
        _stats,
        _stats_step,
        _store_grad,
        _store_state,
        _tile,
        _tile_targets,
    )

    @triton.jit
    def sigmoid_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, ck_ptr,
                       keyed, w_ptr, g_ptr, g_stride_r, g_stride_c, sums_ptr, grad_sums_ptr, c, m, span,
                       HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr,
                       HAS_W: tl.constexpr, WRITE_G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """Rows' Σ softplus(−z·l) over one span of columns and, with WRITE_G, G = −z·σ(−z·l)·w and its row sums."""
        rows, row_ok, scale, bias, pos, excl, row_keys = _program_rows(
            scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR, HAS_BIAS, HAS_POS, HAS_EXCL, KEY_RULE)
        begin = tl.program_id(1) * span
        end = tl.minimum(begin + span, m)
        weights = tl.full(rows.shape, 1.0, tl.float32)
        if HAS_W:
            weights = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        sums = tl.zeros(rows.shape, tl.float32)
        grad_sums = tl.zeros(rows.shape, tl.float32)
        for start in range(begin, end, BC):
            cols, col_ok, logits, at_positive, by_key, left_out = _tile(
                p_ptr, stride_r, stride_c, rows, row_ok, start, end, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
                HAS_BIAS, KEY_RULE, BC,
            )
            if KEY_RULE == _KEYS_POSITIVE:  # every pair that shares the row's key is a positive, its own among them
                at_positive = by_key
            # The margins −z·l; the pairs left out and the columns past the span are no term (-inf).
            margins = tl.where(left_out | ~row_ok[:, None], float("-inf"), tl.where(at_positive, -logits, logits))
            # One exponential serves both: e = exp(−|x|) ∈ [0, 1] never overflows. softplus(x) =
            # max(x, 0) + log1p(e) (F.softplus's value, which takes log1p(exp(x)) up to x = 20, then x:
            # the same to rounding), and σ(x) = (1 or e) / (1 + e), precise for x ≪ 0 too.
            small = tl.exp(-tl.abs(margins))
            sums += tl.sum(tl.maximum(margins, 0.0) + _log1p(small), axis=1)  # 0 at -inf
            if WRITE_G:
                sigmoid = tl.where(margins >= 0, 1.0, small) / (1.0 + small)
                grad = tl.where(at_positive, -sigmoid, sigmoid) * weights[:, None]
                grad_sums += tl.sum(grad, axis=1)
                _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad)
        slot = tl.program_id(1) * c + rows
        tl.store(sums_ptr + slot, sums, mask=row_ok)
        tl.store(grad_sums_ptr + slot, grad_sums, mask=row_ok)

    @triton.jit
    def state_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, ck_ptr,
                     keyed, out_ptr, c, m, span,
                     HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr,
                     SINGLE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """The rows' softmax state over one span of columns.

        Final ``(c, 5)`` when SINGLE, else a partial ``(splits, c, 5)`` (:func:`_stats`' five numbers)
        for :func:`finish_kernel`.
        """
        rows, row_ok, scale, bias, pos, excl, row_keys = _program_rows(
            scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR, HAS_BIAS, HAS_POS, HAS_EXCL, KEY_RULE)
        begin = tl.program_id(1) * span
        end = tl.minimum(begin + span, m)
        row_max, rest, exact, key_sum, key_count = _stats(
            p_ptr, stride_r, stride_c, rows, row_ok, begin, end, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
            HAS_BIAS, HAS_POS, KEY_RULE, BC,
        )
        if SINGLE:
            row_max, rest, exact, key_sum, key_count = _finish(row_max, rest, exact, key_sum, key_count, pos, excl,
                                                               HAS_POS, KEY_RULE)
            _store_state(out_ptr, rows, row_ok, row_max, rest, exact, key_sum, key_count)
        else:
            _store_state(out_ptr + tl.program_id(1) * c * 5, rows, row_ok, row_max, rest, exact, key_sum, key_count)

    @triton.jit
    def _merge(partial_ptr, splits, pos_ptr, excl_ptr, pos_shift, state_ptr, rows, c, m, HAS_POS: tl.constexpr,
               HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr):
        """Merge ``rows``' partial states ``(splits, c, 5)``, finish them and store them in ``(c, 5)``.

        As _softmax.merged, the smaller maxima's terms move into the sum, scaled.
        """
        row_ok = rows < c
        pos, excl = _row_targets(pos_ptr, excl_ptr, pos_shift, rows, row_ok, m, HAS_POS, HAS_EXCL)
        row_max = tl.full(rows.shape, float("-inf"), tl.float32)
        for split in range(0, splits):
            row_max = tl.maximum(row_max, tl.load(partial_ptr + (split * c + rows) * 5, mask=row_ok, other=0.0))
        shift = _finite(row_max)
        _, rest, exact, key_sum, key_count = _empty_stats(rows)
        for split in range(0, splits):
            slot = (split * c + rows) * 5
            part_max = tl.load(partial_ptr + slot, mask=row_ok, other=0.0)
            leads = part_max == row_max
            factor = tl.where(leads, 1.0, tl.exp(part_max - shift))
            rest += tl.load(partial_ptr + slot + 1, mask=row_ok, other=0.0) * factor
            part_exact = tl.load(partial_ptr + slot + 2, mask=row_ok, other=0.0)
            if HAS_POS or KEY_RULE != _KEYS_POSITIVE:  # the positive's logit, from the one span that holds it
                exact += part_exact
            else:  # the count of maxima: the leading spans' stay exact, the others' terms join the sum
                exact += tl.where(leads, part_exact, 0.0)
                rest += tl.where(leads, 0.0, part_exact * factor)
            key_sum += tl.load(partial_ptr + slot + 3, mask=row_ok, other=0.0)
            key_count += tl.load(partial_ptr + slot + 4, mask=row_ok, other=0.0)
        row_max, rest, exact, key_sum, key_count = _finish(row_max, rest, exact, key_sum, key_count, pos, excl,
                                                           HAS_POS, KEY_RULE)
        _store_state(state_ptr, rows, row_ok, row_max, rest, exact, key_sum, key_count)

    @triton.jit
    def finish_kernel(partial_ptr, splits, pos_ptr, excl_ptr, pos_shift, state_ptr, c, m,
                      HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr, BR: tl.constexpr):
        """Merge the spans' partial states and finish them, ``BR`` rows a program."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        _merge(partial_ptr, splits, pos_ptr, excl_ptr, pos_shift, state_ptr, rows, c, m, HAS_POS, HAS_EXCL, KEY_RULE)

    @triton.jit
    def grad_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, state_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr,
                    ck_ptr, keyed, w_ptr, g_ptr, g_stride_r, g_stride_c, c, m,
                    HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr,
                    HAS_W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """One tile of the softmax gradient from the rows' final state."""
        rows, row_ok, scale, bias, pos, excl, row_keys = _program_rows(
            scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR, HAS_BIAS, HAS_POS, HAS_EXCL, KEY_RULE)
        row_max, rest, exact, pos_count = _load_state(state_ptr, rows, row_ok)
        live = _row_weights(w_ptr, rows, row_ok, pos_count, HAS_W)
        cols, col_ok, logits, at_positive, by_key, left_out = _tile(
            p_ptr, stride_r, stride_c, rows, row_ok, tl.program_id(1) * BC, m, scale, bias, pos, excl, row_keys, ck_ptr,
            keyed, HAS_BIAS, KEY_RULE, BC,
        )
        grad = _softmax_grad_tile(logits, at_positive, by_key, left_out, row_max, rest, exact, pos_count, live,
                                  KEY_RULE, 1)
        _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad)

    @triton.jit
    def block_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, ck_ptr,
                     keyed, w_ptr, state_ptr, g_ptr, g_stride_r, g_stride_c, c, m,
                     HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr,
                     HAS_W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """Whole rows: the state (first pass over the row), then the gradient from it (second pass)."""
        rows, row_ok, scale, bias, pos, excl, row_keys = _program_rows(
            scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR, HAS_BIAS, HAS_POS, HAS_EXCL, KEY_RULE)
        row_max, rest, exact, key_sum, key_count = _stats(
            p_ptr, stride_r, stride_c, rows, row_ok, 0, m, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
            HAS_BIAS, HAS_POS, KEY_RULE, BC,
        )
        row_max, rest, exact, pos_sum, pos_count = _finish(row_max, rest, exact, key_sum, key_count, pos, excl,
                                                           HAS_POS, KEY_RULE)
        _store_state(state_ptr, rows, row_ok, row_max, rest, exact, pos_sum, pos_count)
        live = _row_weights(w_ptr, rows, row_ok, pos_count, HAS_W)
        for start in range(0, m, BC):
            cols, col_ok, logits, at_positive, by_key, left_out = _tile(
                p_ptr, stride_r, stride_c, rows, row_ok, start, m, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
                HAS_BIAS, KEY_RULE, BC,
            )
            grad = _softmax_grad_tile(logits, at_positive, by_key, left_out, row_max, rest, exact, pos_count, live,
                                      KEY_RULE, 1)
            _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad)
