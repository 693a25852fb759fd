"""The pieces every fused epilogue kernel is made of, written once.

A tile's logits and targets, the softmax statistics of a span of columns, a tile's gradients:
:mod:`._triton_kernels` composes them.

Per logit, the arithmetic is the GPU's fast kind: ``tl.exp`` (the hardware's ``ex2``), ``/`` (its
approximate division) and :func:`_log1p`'s series, each within a few ulp of float32, far inside the
logits' own error (a product's rounding times the scale); the rows' statistics keep IEEE divisions.
Importable without Triton (the pieces are then absent).
"""

from __future__ import annotations

from contrastive_dist.losses._targets import MASKED

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the eager family functions serve instead
    triton = None

__all__ = [
    "_NO_KEYS", "_KEYS_POSITIVE", "_KEYS_MASKED", "_NO_CANDIDATE", "_TINY", "_log1p", "_row_targets", "_logits",
    "_scalars", "_row_keys", "_same_keys", "_side_targets", "_tile_targets", "_program_rows", "_tile", "_finite",
    "_empty_stats", "_stats_step", "_stats", "_finish", "_store_state", "_load_state", "_row_weights",
    "_softmax_grad_tile", "_store_grad"
]  # fmt: skip

if triton is not None:
    _NO_KEYS, _KEYS_POSITIVE, _KEYS_MASKED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # KEY_RULE
    _NO_CANDIDATE = tl.constexpr(-0.5 * MASKED)  # a row maximum below this: no candidate (see _targets.MASKED)
    _TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, as _softmax clamps by

    @triton.jit
    def _log1p(x):
        """``log1p(x)`` for ``x ∈ [0, 1]``: ``2 atanh(s)``, ``s = x / (2 + x) ∈ [0, 1/3]``, by its series.

        Fast arithmetic rather than libdevice's: one division, seven multiply-adds and three products,
        the terms to ``s¹⁵/15`` (the next is below ``2⁻²⁹`` of the sum). Relative error a few ulp for
        every ``x``, ``x → 0`` too (``log(1 + x)`` from an approximate ``log`` is not: its error is
        absolute).
        """
        s = x / (2.0 + x)
        t = s * s
        series = t * (1.0 / 15.0) + 1.0 / 13.0
        series = series * t + 1.0 / 11.0
        series = series * t + 1.0 / 9.0
        series = series * t + 1.0 / 7.0
        series = series * t + 1.0 / 5.0
        series = series * t + 1.0 / 3.0
        series = series * t + 1.0
        return 2.0 * s * series

    @triton.jit
    def _row_targets(pos_ptr, excl_ptr, pos_shift, rows, row_ok, m, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr):
        """Each row's positive (its stored index less ``pos_shift``) and excluded column in ``[0, m)``, or -1."""
        pos = tl.full(rows.shape, -1, tl.int64)
        excl = tl.full(rows.shape, -1, tl.int64)
        if HAS_POS:
            pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1) - pos_shift
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
    def _row_keys(rk_ptr, rows, row_ok, KEY_RULE: tl.constexpr):
        """The rows' keys (0 without keys: never compared)."""
        if KEY_RULE != _NO_KEYS:
            return tl.load(rk_ptr + rows, mask=row_ok, other=0)
        else:
            return tl.zeros(rows.shape, tl.int64)

    @triton.jit
    def _same_keys(row_keys, ck_ptr, cols, col_ok, keyed, KEY_RULE: tl.constexpr):
        """``(BR, BC)``: the pairs whose row and column share a key (the block's columns past ``keyed`` have none).

        Without keys (KEY_RULE 0): none, never loaded.
        """
        if KEY_RULE != _NO_KEYS:
            keyed_here = col_ok & (cols < keyed)
            column_keys = tl.load(ck_ptr + cols, mask=keyed_here, other=0)
            return (row_keys[:, None] == column_keys[None, :]) & keyed_here[None, :]
        else:
            return (row_keys[:, None] < 0) & (cols[None, :] < 0)  # none

    @triton.jit
    def _side_targets(at_positive, excluded, outside, same, KEY_RULE: tl.constexpr):
        """``(at_positive, by_key, left_out)`` of one side of a tile, from its positives, exclusions and keys.

        ``outside``: the pairs past the block (no term). ``by_key``: with KEY_RULE 1 the pairs that share a
        key, the excluded and outside ones excepted; else none. ``left_out``: no candidate (excluded, outside
        and, KEY_RULE 2, the pairs that share a key but the positive). Written once for both sides of a tile:
        a row's side reads it as it is, a column's side with the roles of rows and columns swapped.
        """
        left_out = excluded | outside
        by_key = same & ~same  # none
        if KEY_RULE == _KEYS_POSITIVE:
            by_key = same & ~left_out
        if KEY_RULE == _KEYS_MASKED:
            left_out = left_out | (same & ~at_positive)
        return at_positive, by_key, left_out

    @triton.jit
    def _tile_targets(rows, cols, col_ok, pos, excl, row_keys, ck_ptr, keyed, KEY_RULE: tl.constexpr):
        """``(at_positive, by_key, left_out)`` of one tile's rows, each ``(BR, BC)``.

        ``at_positive``: the row's positive column; ``by_key``: its positives by key (KEY_RULE 1: the
        pairs that share its key, its excluded column excepted; else none); ``left_out``: no candidate
        (its excluded column, the columns past the block and, KEY_RULE 2, the pairs that share its key
        but its positive). The block's columns past ``keyed`` have no key.
        """
        same = _same_keys(row_keys, ck_ptr, cols, col_ok, keyed, KEY_RULE)
        return _side_targets(cols[None, :] == pos[:, None], cols[None, :] == excl[:, None], ~col_ok[None, :], same,
                             KEY_RULE)

    @triton.jit
    def _program_rows(scale_ptr, bias_ptr, pos_ptr, excl_ptr, pos_shift, rk_ptr, c, m, BR: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, HAS_EXCL: tl.constexpr, KEY_RULE: tl.constexpr):
        """The program's rows and what every kernel reads of them: ``(rows, row_ok, scale, bias, pos, excl, keys)``."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < c
        scale, bias = _scalars(scale_ptr, bias_ptr, HAS_BIAS)
        pos, excl = _row_targets(pos_ptr, excl_ptr, pos_shift, rows, row_ok, m, HAS_POS, HAS_EXCL)
        return rows, row_ok, scale, bias, pos, excl, _row_keys(rk_ptr, rows, row_ok, KEY_RULE)

    @triton.jit
    def _tile(p_ptr, stride_r, stride_c, rows, row_ok, start, end, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
              HAS_BIAS: tl.constexpr, KEY_RULE: tl.constexpr, BC: tl.constexpr):
        """The tile of columns ``[start, start + BC)`` (those before ``end``): ``(cols, col_ok, logits, *targets)``."""
        cols = start + tl.arange(0, BC)
        col_ok = cols < end
        logits = _logits(p_ptr, rows, cols, stride_r, stride_c, row_ok, col_ok, scale, bias, HAS_BIAS)
        at_positive, by_key, left_out = _tile_targets(rows, cols, col_ok, pos, excl, row_keys, ck_ptr, keyed, KEY_RULE)
        return cols, col_ok, logits, at_positive, by_key, left_out

    @triton.jit
    def _finite(row_max):
        return tl.where(row_max == float("-inf"), 0.0, row_max)

    @triton.jit
    def _empty_stats(rows):
        """:func:`_stats`' five numbers over no column: ``(-inf, 0, 0, 0, 0)`` per row."""
        zeros = tl.zeros(rows.shape, tl.float32)
        return zeros + float("-inf"), zeros, zeros, zeros, zeros

    @triton.jit
    def _stats_step(row_max, rest, exact, key_sum, key_count, logits, at_positive, by_key, left_out,
                    HAS_POS: tl.constexpr, KEY_RULE: tl.constexpr, AXIS: tl.constexpr):
        """One tile's update of :func:`_stats`' five numbers, reduced along ``AXIS``.

        AXIS 1: the tile's rows take its columns (their state); AXIS 0: its columns take its rows, the
        same formulas with the roles swapped (a column side read from the same tile: no transposed pass).
        """
        if KEY_RULE == _KEYS_POSITIVE:  # before the exclusion, as _softmax reads them
            key_sum += tl.sum(tl.where(by_key, logits, 0.0), axis=AXIS)
            key_count += tl.sum(by_key.to(tl.float32), axis=AXIS)
        candidates = tl.where(left_out, float("-inf"), logits)
        new_max = tl.maximum(row_max, tl.max(candidates, axis=AXIS))
        shift = _finite(new_max)
        terms = tl.exp(candidates - tl.expand_dims(shift, AXIS))
        factor = tl.exp(row_max - shift)
        if HAS_POS or KEY_RULE != _KEYS_POSITIVE:
            # Before the exclusion, as _softmax reads it; exactly one tile holds it: the sum adds zeros.
            exact += tl.sum(tl.where(at_positive, logits, 0.0), axis=AXIS)
            terms = tl.where(at_positive, 0.0, terms)
            rest = rest * factor + tl.sum(terms, axis=AXIS)
        else:
            at_max = (candidates == tl.expand_dims(new_max, AXIS)) & tl.expand_dims(new_max > float("-inf"), AXIS)
            grew = new_max > row_max  # the maxima counted so far move into the sum, scaled
            terms = tl.where(at_max, 0.0, terms)
            rest = rest * factor + tl.where(grew, exact * factor, 0.0) + tl.sum(terms, axis=AXIS)
            exact = tl.where(grew, 0.0, exact) + tl.sum(at_max.to(tl.float32), axis=AXIS)
        return new_max, rest, exact, key_sum, key_count

    @triton.jit
    def _stats(p_ptr, stride_r, stride_c, rows, row_ok, begin, end, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
               HAS_BIAS: tl.constexpr, HAS_POS: tl.constexpr, KEY_RULE: tl.constexpr, BC: tl.constexpr):
        """Online over columns ``[begin, end)``: the maximum, Σ exp(l − max), the exact part and the positives.

        Returns ``(max, rest, exact, key_sum, key_count)``. With a positive column (HAS_POS) the sum
        runs over the candidates but the positive, and ``exact`` is its logit (0 where it is not in the
        span), its term kept exactly; with positives by key and no positive column (SupCon's anchors),
        ``exact`` counts the candidates equal to the maximum (each term exactly 1), left out of the
        sum. ``key_sum``, ``key_count``: the positives by key's logits and number (KEY_RULE 1).
        """
        row_max, rest, exact, key_sum, key_count = _empty_stats(rows)
        for start in range(begin, end, BC):
            _, _, logits, at_positive, by_key, left_out = _tile(
                p_ptr, stride_r, stride_c, rows, row_ok, start, end, scale, bias, pos, excl, row_keys, ck_ptr, keyed,
                HAS_BIAS, KEY_RULE, BC,
            )
            row_max, rest, exact, key_sum, key_count = _stats_step(
                row_max, rest, exact, key_sum, key_count, logits, at_positive, by_key, left_out, HAS_POS, KEY_RULE, 1)
        return row_max, rest, exact, key_sum, key_count

    @triton.jit
    def _finish(row_max, rest, exact, key_sum, key_count, pos, excl, HAS_POS: tl.constexpr,
                KEY_RULE: tl.constexpr):
        """The five numbers of _softmax.block_state_ from :func:`_stats`' (merged over spans)."""
        row_max = tl.where(row_max < _NO_CANDIDATE, float("-inf"), row_max)
        rest = tl.where(row_max == float("-inf"), 0.0, rest)
        if HAS_POS or KEY_RULE != _KEYS_POSITIVE:  # exact: the positive's logit, its term formed now
            present = pos >= 0
            positive = exact
            exact = tl.where(present & (pos != excl), tl.exp(positive - _finite(row_max)), 0.0)
            if KEY_RULE != _KEYS_POSITIVE:  # the positive column is the row's one positive
                key_sum = tl.where(present, positive, 0.0)
                key_count = present.to(tl.float32)
        return row_max, rest, exact, key_sum, key_count

    @triton.jit
    def _store_state(state_ptr, rows, row_ok, row_max, rest, exact, pos_sum, pos_count):
        tl.store(state_ptr + rows * 5, row_max, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 1, rest, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 2, exact, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 3, pos_sum, mask=row_ok)
        tl.store(state_ptr + rows * 5 + 4, pos_count, mask=row_ok)

    @triton.jit
    def _load_state(state_ptr, rows, row_ok):
        """What a gradient reads of the rows' final state: ``(max, rest, exact, pos_count)``."""
        row_max = tl.load(state_ptr + rows * 5, mask=row_ok, other=0.0)
        rest = tl.load(state_ptr + rows * 5 + 1, mask=row_ok, other=0.0)
        exact = tl.load(state_ptr + rows * 5 + 2, mask=row_ok, other=0.0)
        pos_count = tl.load(state_ptr + rows * 5 + 4, mask=row_ok, other=0.0)
        return row_max, rest, exact, pos_count

    @triton.jit
    def _row_weights(w_ptr, rows, row_ok, pos_count, HAS_W: tl.constexpr):
        """``live``: the row's weight (1 unweighted), 0 for a row without positive (no loss, no gradient)."""
        weights = tl.full(rows.shape, 1.0, tl.float32)
        if HAS_W:
            weights = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        return tl.where(pos_count > 0, weights, 0.0)

    @triton.jit
    def _softmax_grad_tile(logits, at_positive, by_key, left_out, row_max, rest, exact, pos_count, live,
                           KEY_RULE: tl.constexpr, AXIS: tl.constexpr):
        """``live · (p − t)`` of one tile, as in gradient_, for the side whose statistics run along ``AXIS``.

        A positive column's entry is −live (rest + (exact − own)) / Σ, without cancellation; positives by
        key (KEY_RULE 1) take ``live · p − live / count`` each. AXIS 1: the rows' gradient; AXIS 0: the
        columns' (their state per column, see :func:`_stats_step`).
        """
        numerators = tl.exp(tl.where(left_out, float("-inf"), logits) - tl.expand_dims(_finite(row_max), AXIS))
        total = tl.maximum(rest + exact, _TINY)
        # The rows' statistics take IEEE divisions (div_rn), as the eager chain's: once per row, not per logit.
        softmax_weight = tl.expand_dims(tl.math.div_rn(live, total), AXIS)
        if KEY_RULE == _KEYS_POSITIVE:
            per_positive = tl.expand_dims(tl.math.div_rn(live, tl.maximum(pos_count, 1.0)), AXIS)
            return numerators * softmax_weight - tl.where(by_key, per_positive, 0.0)
        else:
            # The positive's own numerator from this tile: only the tile holding it writes its entry.
            own = tl.sum(tl.where(at_positive, numerators, 0.0), axis=AXIS)
            entry = tl.math.div_rn(-live * (rest + (exact - own)), total)
            return tl.where(at_positive, tl.expand_dims(entry, AXIS), numerators * softmax_weight)

    @triton.jit
    def _store_grad(g_ptr, stride_r, stride_c, rows, cols, row_ok, col_ok, grad):
        offsets = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
        tl.store(g_ptr + offsets, grad.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
