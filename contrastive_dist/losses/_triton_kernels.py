"""The Triton kernels behind :mod:`._triton`: one fused epilogue per family, on a block's raw product.

Every kernel reads the product ``P`` of a block (``c × m`` float32, any strides) and forms the
logits ``l = s · P (+ b)`` itself, tile by tile (``BR`` rows × ``BC`` columns); the rows' targets
are a positive column and an excluded column per row (``-1``: none). The formulas are those of
:mod:`._softmax` and :mod:`._sigmoid`, term for term; the shared pieces are written once here as
``@triton.jit`` helpers. Importable without Triton (the kernels are then absent).
"""

from __future__ import annotations

from typing import Any

from contrastive_dist.losses._targets import MASKED

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - the eager family functions serve instead
    triton = None

__all__ = ["block_kernel", "finish_kernel", "grad_kernel", "sigmoid_kernel", "state_kernel"]

block_kernel: Any = None
finish_kernel: Any = None
grad_kernel: Any = None
sigmoid_kernel: Any = None
state_kernel: Any = None

if triton is not None:
    _NO_CANDIDATE = tl.constexpr(-0.5 * MASKED)  # a row maximum below this: no candidate (see _targets.MASKED)
    _TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, as _softmax clamps by

    @triton.jit
    def _exp(x, ACCURATE: tl.constexpr):
        # libdevice's expf (≤ 2 ulp) on the device; the interpreter has no libdevice, and its exp is numpy's.
        if ACCURATE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _log1p(x, ACCURATE: tl.constexpr):
        if ACCURATE:
            return libdevice.log1p(x)
        else:
            # log1p from log, accurate for small x: log(u) · x / (u − 1) corrects the rounding of u = 1 + x.
            u = 1.0 + x
            return tl.where(u == 1.0, x, tl.log(u) * tl.math.div_rn(x, tl.where(u == 1.0, 1.0, u - 1.0)))

    @triton.jit
    def _row_targets(pos_ptr, excl_ptr, rows, row_ok, m, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr):
        """Each row's positive and excluded column in ``[0, m)``, or -1 (none in this block)."""
        pos = tl.full(rows.shape, -1, tl.int64)
        excl = tl.full(rows.shape, -1, tl.int64)
        if HAS_POS:
            pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
            pos = tl.where((pos >= 0) & (pos < m), pos, -1)
        if HAS_EXCL:
            excl = tl.load(excl_ptr + rows, mask=row_ok, other=-1)
            excl = tl.where((excl >= 0) & (excl < m), excl, -1)
        return pos, excl

    @triton.jit
    def _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS: tl.constexpr):
        """``s · P (+ b)`` of one tile; entries outside the block are 0 (every caller masks them)."""
        offsets = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
        product = tl.load(p_ptr + offsets, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        logits = product * scale
        if HAS_BIAS:
            logits = logits + bias
        return logits

    @triton.jit
    def _scalars(scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
        scale = tl.load(scale_ptr)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_ptr)
        return scale, bias

    @triton.jit
    def _candidates(logits, cols, col_ok, excl):
        """The tile's candidates' logits: the excluded column and the columns past the block are -inf."""
        return tl.where(col_ok[None, :] & (cols[None, :] != excl[:, None]), logits, float("-inf"))

    @triton.jit
    def _finite(row_max):
        return tl.where(row_max == float("-inf"), 0.0, row_max)

    @triton.jit
    def _stats(p_ptr, stride_r, stride_c, rows, row_ok, begin, end, scale, bias, pos, excl,
               HAS_BIAS: tl.constexpr, BC: tl.constexpr, ACCURATE: tl.constexpr):
        """Online over columns ``[begin, end)``: the maximum, Σ exp(l − max) and the positive's logit.

        The sum runs over the candidates but the positive (its term is kept exactly, from its logit);
        the positive's logit is 0 where it is not in the span.
        """
        row_max = tl.full(rows.shape, float("-inf"), tl.float32)
        rest = tl.zeros(rows.shape, tl.float32)
        positive = tl.zeros(rows.shape, tl.float32)
        for start in range(begin, end, BC):
            cols = start + tl.arange(0, BC)
            col_ok = cols < end
            logits = _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS)
            at_positive = cols[None, :] == pos[:, None]
            # Before the exclusion, as _softmax reads it; exactly one tile holds it: the sum adds zeros.
            positive += tl.sum(tl.where(at_positive, logits, 0.0), axis=1)
            candidates = _candidates(logits, cols, col_ok, excl)
            new_max = tl.maximum(row_max, tl.max(candidates, axis=1))
            shift = _finite(new_max)
            terms = tl.where(at_positive, 0.0, _exp(candidates - shift[:, None], ACCURATE))
            rest = rest * _exp(row_max - shift, ACCURATE) + tl.sum(terms, axis=1)
            row_max = new_max
        return row_max, rest, positive

    @triton.jit
    def _finish(row_max, rest, positive, pos, excl, ACCURATE: tl.constexpr):
        """The five numbers of _softmax.block_state_ from a row's maximum, rest and positive logit."""
        row_max = tl.where(row_max < _NO_CANDIDATE, float("-inf"), row_max)
        rest = tl.where(row_max == float("-inf"), 0.0, rest)
        present = pos >= 0
        own = tl.where(present & (pos != excl), _exp(positive - _finite(row_max), ACCURATE), 0.0)
        return row_max, rest, own, tl.where(present, positive, 0.0), present.to(tl.float32)

    @triton.jit
    def _store_state(state_ptr, rows, row_ok, row_max, rest, exact, pos_sum, pos_count):
        tl.store(state_ptr + rows * 5, row_max, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 1, rest, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 2, exact, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 3, pos_sum, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 4, pos_count, mask=row_ok)

    @triton.jit
    def _row_weights(w_ptr, rows, row_ok, pos_count, HAS_W: tl.constexpr):
        """``live``: the row's weight (1 unweighted), 0 for a row without positive (no loss, no gradient)."""
        weights = tl.full(rows.shape, 1.0, tl.float32)
        if HAS_W:
            weights = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        return tl.where(pos_count > 0, weights, 0.0)

    @triton.jit
    def _softmax_grad_tile(logits, cols, col_ok, pos, excl, row_max, rest, exact, live, ACCURATE: tl.constexpr):
        """``live · (p − t)`` of one tile; the positive's entry is −live (rest + (exact − own)) / Σ, as in gradient_."""
        numerators = _exp(_candidates(logits, cols, col_ok, excl) - _finite(row_max)[:, None], ACCURATE)
        at_positive = cols[None, :] == pos[:, None]
        # The positive's own numerator from this tile: only the tile holding it writes its entry.
        own = tl.sum(tl.where(at_positive, numerators, 0.0), axis=1)
        total = tl.maximum(rest + exact, _TINY)
        # IEEE divisions (div_rn), as the eager chain's: `/` is the approximate div.full on NVIDIA.
        softmax_weight = tl.math.div_rn(live, total)
        entry = tl.math.div_rn(-live * (rest + (exact - own)), total)
        return tl.where(at_positive, entry[:, None], numerators * softmax_weight[:, None])

    @triton.jit
    def _store_grad(g_ptr, stride_r, stride_c, rows, cols, row_ok, col_ok, grad, ACCUMULATE: tl.constexpr):
        offsets = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
        mask = row_ok[:, None] & col_ok[None, :]
        if ACCUMULATE:
            grad += tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(g_ptr + offsets, grad.to(g_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def sigmoid_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, w_ptr,
                       g_ptr, g_stride_r, g_stride_c, sums_ptr, grad_sums_ptr, c, m, span,
                       HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_W: tl.constexpr,
                       WRITE_G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ACCURATE: tl.constexpr):
        """Rows' Σ softplus(−z·l) over one span of columns and, with WRITE_G, G = −z·σ(−z·l)·w and its row sums."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < c
        begin = tl.program_id(1) * span
        end = tl.minimum(begin + span, m)
        scale, bias = _scalars(scale_ptr, bias_ptr, HAS_BIAS)
        pos, excl = _row_targets(pos_ptr, excl_ptr, rows, row_ok, m, HAS_POS, HAS_EXCL)
        weights = tl.full(rows.shape, 1.0, tl.float32)
        if HAS_W:
            weights = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        sums = tl.zeros(rows.shape, tl.float32)
        grad_sums = tl.zeros(rows.shape, tl.float32)
        for start in range(begin, end, BC):
            cols = start + tl.arange(0, BC)
            col_ok = cols < end
            logits = _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS)
            at_positive = cols[None, :] == pos[:, None]
            # The margins −z·l; the excluded pair and the columns past the span are no term (-inf).
            margins = _candidates(tl.where(at_positive, -logits, logits), cols, col_ok, excl)
            margins = tl.where(row_ok[:, None], margins, float("-inf"))
            # One exponential serves both: e = exp(−|x|) ∈ [0, 1] never overflows. softplus(x) =
            # max(x, 0) + log1p(e) (F.softplus's value, which takes log1p(exp(x)) up to x = 20, then x:
            # the same to rounding), and σ(x) = (1 or e) / (1 + e), precise for x ≪ 0 too.
            small = _exp(-tl.abs(margins), ACCURATE)
            sums += tl.sum(tl.maximum(margins, 0.0) + _log1p(small, ACCURATE), axis=1)  # 0 at -inf
            if WRITE_G:
                sigmoid = tl.math.div_rn(tl.where(margins >= 0, 1.0, small), 1.0 + small)
                grad = tl.where(at_positive, -sigmoid, sigmoid) * weights[:, None]
                grad_sums += tl.sum(grad, axis=1)
                _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad, False)
        slot = tl.program_id(1) * c + rows
        tl.store(sums_ptr + slot, sums, mask=row_ok)
        tl.store(grad_sums_ptr + slot, grad_sums, mask=row_ok)

    @triton.jit
    def state_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, out_ptr, c, m, span,
                     HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, SINGLE: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr, ACCURATE: tl.constexpr):
        """The rows' softmax state over one span of columns.

        Final ``(c, 5)`` when SINGLE, else a partial ``(splits, c, 3)`` (maximum, rest, positive logit)
        for :func:`finish_kernel`.
        """
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < c
        begin = tl.program_id(1) * span
        end = tl.minimum(begin + span, m)
        scale, bias = _scalars(scale_ptr, bias_ptr, HAS_BIAS)
        pos, excl = _row_targets(pos_ptr, excl_ptr, rows, row_ok, m, HAS_POS, HAS_EXCL)
        row_max, rest, positive = _stats(p_ptr, stride_r, stride_c, rows, row_ok, begin, end, scale, bias,
                                         pos, excl, HAS_BIAS, BC, ACCURATE)
        if SINGLE:
            row_max, rest, exact, pos_sum, pos_count = _finish(row_max, rest, positive, pos, excl, ACCURATE)
            _store_state(out_ptr, rows, row_ok, row_max, rest, exact, pos_sum, pos_count)
        else:
            slot = (tl.program_id(1) * c + rows) * 3
            tl.store(out_ptr + slot, row_max, mask=row_ok)
            tl.store(out_ptr + slot + 1, rest, mask=row_ok)
            tl.store(out_ptr + slot + 2, positive, mask=row_ok)

    @triton.jit
    def finish_kernel(partial_ptr, splits, pos_ptr, excl_ptr, state_ptr, c, m,
                      HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, BR: tl.constexpr, ACCURATE: tl.constexpr):
        """Merge the spans' partial states (as _softmax.merge_ moves the smaller maxima's terms) and finish."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < c
        pos, excl = _row_targets(pos_ptr, excl_ptr, rows, row_ok, m, HAS_POS, HAS_EXCL)
        row_max = tl.full(rows.shape, float("-inf"), tl.float32)
        for split in range(0, splits):
            row_max = tl.maximum(row_max, tl.load(partial_ptr + (split * c + rows) * 3, mask=row_ok, other=0.0))
        shift = _finite(row_max)
        rest = tl.zeros(rows.shape, tl.float32)
        positive = tl.zeros(rows.shape, tl.float32)
        for split in range(0, splits):
            slot = (split * c + rows) * 3
            part_max = tl.load(partial_ptr + slot, mask=row_ok, other=0.0)
            factor = tl.where(part_max == row_max, 1.0, _exp(part_max - shift, ACCURATE))
            rest += tl.load(partial_ptr + slot + 1, mask=row_ok, other=0.0) * factor
            positive += tl.load(partial_ptr + slot + 2, mask=row_ok, other=0.0)
        row_max, rest, exact, pos_sum, pos_count = _finish(row_max, rest, positive, pos, excl, ACCURATE)
        _store_state(state_ptr, rows, row_ok, row_max, rest, exact, pos_sum, pos_count)

    @triton.jit
    def grad_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, state_ptr, pos_ptr, excl_ptr, w_ptr,
                    g_ptr, g_stride_r, g_stride_c, c, m,
                    HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_W: tl.constexpr,
                    ACCUMULATE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ACCURATE: tl.constexpr):
        """One tile of the softmax gradient from the rows' final state: written, or added with ACCUMULATE."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < c
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        col_ok = cols < m
        scale, bias = _scalars(scale_ptr, bias_ptr, HAS_BIAS)
        pos, excl = _row_targets(pos_ptr, excl_ptr, rows, row_ok, m, HAS_POS, HAS_EXCL)
        row_max = tl.load(state_ptr + rows * 5, mask=row_ok, other=0.0)
        rest = tl.load(state_ptr + rows * 5 + 1, mask=row_ok, other=0.0)
        exact = tl.load(state_ptr + rows * 5 + 2, mask=row_ok, other=0.0)
        live = _row_weights(w_ptr, rows, row_ok, tl.load(state_ptr + rows * 5 + 4, mask=row_ok, other=0.0), HAS_W)
        logits = _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS)
        grad = _softmax_grad_tile(logits, cols, col_ok, pos, excl, row_max, rest, exact, live, ACCURATE)
        _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad, ACCUMULATE)

    @triton.jit
    def block_kernel(p_ptr, stride_r, stride_c, scale_ptr, bias_ptr, pos_ptr, excl_ptr, w_ptr, state_ptr,
                     g_ptr, g_stride_r, g_stride_c, c, m,
                     HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_W: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr, ACCURATE: tl.constexpr):
        """Whole rows: the state (first pass over the row), then the gradient from it (second pass)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < c
        scale, bias = _scalars(scale_ptr, bias_ptr, HAS_BIAS)
        pos, excl = _row_targets(pos_ptr, excl_ptr, rows, row_ok, m, HAS_POS, HAS_EXCL)
        row_max, rest, positive = _stats(p_ptr, stride_r, stride_c, rows, row_ok, 0, m, scale, bias,
                                         pos, excl, HAS_BIAS, BC, ACCURATE)
        row_max, rest, exact, pos_sum, pos_count = _finish(row_max, rest, positive, pos, excl, ACCURATE)
        _store_state(state_ptr, rows, row_ok, row_max, rest, exact, pos_sum, pos_count)
        live = _row_weights(w_ptr, rows, row_ok, pos_count, HAS_W)
        for start in range(0, m, BC):
            cols = start + tl.arange(0, BC)
            col_ok = cols < m
            logits = _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS)
            grad = _softmax_grad_tile(logits, cols, col_ok, pos, excl, row_max, rest, exact, live, ACCURATE)
            _store_grad(g_ptr, g_stride_r, g_stride_c, rows, cols, row_ok, col_ok, grad, False)
