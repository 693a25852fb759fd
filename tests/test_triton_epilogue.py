"""The Triton block epilogues against the eager family functions and a float64 reference.

The kernels run in Triton's interpreter on CPU tensors, in a process of their own: Triton decides
between compiling and interpreting when a function is defined, its own library included, so
``TRITON_INTERPRET=1`` must be set before it is first imported. :func:`test_in_interpreter` runs
this file's checks in such a process. Blocks are small (the interpreter is slow) but span several
tiles, ragged tails and column spans.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

pytest.importorskip("triton")

import background  # noqa: E402

from contrastive_dist.losses import _sigmoid, _softmax  # noqa: E402
from contrastive_dist.losses import _triton as epilogue  # noqa: E402
from contrastive_dist.losses._targets import Located, Targets  # noqa: E402

_CHILD = "CONTRASTIVE_DIST_TRITON_CHECKS"
"""Set in the interpreter's process: the checks run there, and only there."""
INTERPRETER_CHECKS = "triton epilogue checks"
"""This file's checks in Triton's interpreter: a command of the suite's background (declared at the end)."""
interpreted = pytest.mark.in_background(INTERPRETER_CHECKS)


outside_interpreter = pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="this is the interpreter's process")


@outside_interpreter
@pytest.mark.timeout(960)
@pytest.mark.background(INTERPRETER_CHECKS)
def test_in_interpreter() -> None:
    """Every check below, in a fresh process under ``TRITON_INTERPRET=1``."""
    background.assert_every_check_passed(INTERPRETER_CHECKS)


class Block(NamedTuple):
    product: Tensor  # (c, m) float32, possibly a transposed view
    scale: Tensor
    bias: Tensor | None
    positive: Tensor  # (c,) int64, -1: none
    excluded: Tensor | None

    @property
    def logits(self) -> Tensor:
        """The float32 logits as the kernels form them: the references start from the same numbers."""
        logits = self.product * self.scale
        return logits if self.bias is None else logits + self.bias

    def targets(self) -> Targets:
        def located(index: Tensor | None) -> Located | None:
            if index is None:
                return None
            return Located(index.clamp(0, self.product.shape[1] - 1)[:, None], index >= 0)

        return Targets(located(self.positive), located(self.excluded))


def _block(case: str, seed: int = 0) -> Block:
    """A block with the edge cases named by ``case``; positives absent in some rows, excluded columns elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    c, m = {"single_row": (1, 53), "only_candidate": (3, 2)}.get(case, (37, 53))
    product = torch.randn(c, m, generator=generator)
    if case == "transposed":
        product = torch.randn(m, c, generator=generator).T  # strides (1, c): the column direction
    scale = torch.tensor(100.0 if case == "large" else 3.0)
    bias = None if case == "transposed" else torch.tensor(-2.5)
    positive = torch.randint(0, m, (c,), generator=generator)
    positive[::4] = -1
    excluded = (positive + 1 + torch.randint(0, m - 1, (c,), generator=generator)) % m  # never the positive
    excluded[1::3] = -1
    if case == "only_candidate":  # row 0's positive is its only candidate: loss exactly 0
        positive, excluded = torch.tensor([0, 1, -1]), torch.tensor([1, -1, 0])
    return Block(product, scale, bias, positive, None if case == "single_row" else excluded)


CASES = ["random", "single_row", "only_candidate", "large", "transposed"]


def _candidates(block: Block) -> Tensor:
    keep = torch.ones(block.product.shape, dtype=torch.bool)
    if block.excluded is not None:
        rows = torch.nonzero(block.excluded >= 0).squeeze(1)
        keep[rows, block.excluded[rows]] = False
    return keep


def softmax_reference(block: Block, weights: Tensor) -> tuple[Tensor, Tensor]:
    """float64, row by row: ``ℓ_i = logsumexp_j l_ij − l_ip`` over the candidates, and ``w_i (p_ij − t_ij)``."""
    logits, keep = block.logits.double(), _candidates(block)
    losses, grad = torch.zeros(logits.shape[0], dtype=torch.float64), torch.zeros_like(logits)
    for row, positive in enumerate(block.positive.tolist()):
        if positive < 0:
            continue  # no positive: no loss, no gradient
        losses[row] = torch.logsumexp(logits[row][keep[row]], 0) - logits[row, positive]
        grad[row][keep[row]] = torch.softmax(logits[row][keep[row]], 0)
        grad[row, positive] -= 1.0
        grad[row] *= weights[row].double()
    return losses, grad


def sigmoid_reference(block: Block, weights: Tensor) -> tuple[Tensor, Tensor]:
    """float64: ``Σ_j softplus(−z l)`` over the pairs that are terms, and ``−z σ(−z l) w``."""
    logits, keep = block.logits.double(), _candidates(block)
    signs = -torch.ones_like(logits)
    rows = torch.nonzero(block.positive >= 0).squeeze(1)
    signs[rows, block.positive[rows]] = 1.0
    terms = torch.where(keep, F.softplus(-signs * logits), 0.0)
    grad = torch.where(keep, -signs * torch.sigmoid(-signs * logits), 0.0) * weights.double()[:, None]
    return terms.sum(1), grad


def _close(actual: Tensor, expected: Tensor, rtol: float = 2e-6, atol: float = 1e-7) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


def _weights(block: Block) -> Tensor:
    return torch.rand(block.product.shape[0], generator=torch.Generator().manual_seed(1)) + 0.5


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_softmax_state_and_gradient(case: str) -> None:
    """State (one span and several), gradient and the fused block equal the eager chain and float64."""
    block, weights = _block(case), None
    eager_numerators = block.logits.clone()
    eager_state = _softmax.block_state_(eager_numerators, block.targets(), None)
    weights = _weights(block)
    eager_grad = _softmax.gradient_(eager_numerators, eager_state, block.targets(), None, weights)
    losses, grad = softmax_reference(block, weights)
    args = (block.product, block.scale, block.bias, block.positive, block.excluded)
    for splits in (1, 3):
        state = epilogue.softmax_state(*args, splits=splits)
        _close(state, eager_state)
        _close(_softmax.finish(state), losses, rtol=1e-5, atol=1e-6)
    fused_grad = torch.empty_like(block.product)
    fused_state = epilogue.softmax_block(*args, weights, fused_grad)
    _close(fused_state, eager_state)
    separate_grad = torch.empty_like(block.product)
    epilogue.softmax_grad(*args[:3], fused_state, *args[3:], weights, separate_grad)
    assert torch.equal(separate_grad, fused_grad)
    _close(fused_grad, eager_grad)
    _close(fused_grad, grad, rtol=1e-5, atol=1e-6)
    if case == "only_candidate":
        assert _softmax.finish(fused_state)[0].item() == 0.0 and not fused_grad[0].any()


def _rounded(values: Tensor, dtype: torch.dtype) -> Tensor:
    """``values`` (float32) as the kernels store them in ``dtype``, within what the interpreter can show.

    CUDA rounds to nearest even; Triton's interpreter truncates float32 to bf16: one bf16 ulp apart.
    """
    if dtype != torch.bfloat16:
        return values.to(dtype)
    return values.to(dtype), values.view(torch.int32).bitwise_and(-65536).view(torch.float32).to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_softmax_gradient_dtypes(dtype: torch.dtype) -> None:
    """The unweighted G rounded once to the output dtype."""
    block = _block("random")
    args = (block.product, block.scale, block.bias)
    state = epilogue.softmax_state(*args, block.positive, block.excluded)
    full = torch.empty(block.product.shape)
    epilogue.softmax_grad(*args, state, block.positive, block.excluded, None, full)
    _close(full, softmax_reference(block, torch.ones(37))[1], rtol=1e-5, atol=1e-6)
    grad = torch.empty(block.product.shape, dtype=dtype)
    epilogue.softmax_grad(*args, state, block.positive, block.excluded, None, grad)
    _assert_rounded(grad, full)


def _assert_rounded(stored: Tensor, values: Tensor) -> None:
    """``stored`` is float32 ``values`` rounded once to its dtype (see :func:`_rounded`)."""
    if stored.dtype != torch.bfloat16:
        assert torch.equal(stored, values.to(stored.dtype))
        return
    nearest, truncated = _rounded(values, stored.dtype)
    assert bool(((stored == nearest) | (stored == truncated)).all())


@interpreted
def test_softmax_states_merged_over_two_blocks() -> None:
    """Two column blocks' states merged by _softmax.merge_ give each block's gradient of the whole row."""
    block, weights = _block("random"), torch.ones(37)
    losses, grad = softmax_reference(block, weights)
    halves = []
    state = _softmax.empty_state(37, block.product)
    for start, stop in ((0, 30), (30, 53)):

        def shifted(index: Tensor | None, start: int = start, stop: int = stop) -> Tensor | None:
            inside = (index >= start) & (index < stop) if index is not None else None
            return None if index is None else torch.where(inside, index - start, -1)  # type: ignore[arg-type]

        part = (block.product[:, start:stop], block.scale, block.bias, shifted(block.positive), shifted(block.excluded))
        _softmax.merge_(state, epilogue.softmax_state(*part))
        halves.append(part)
    _close(_softmax.finish(state), losses, rtol=1e-5, atol=1e-6)
    out = torch.empty_like(block.product)
    for (start, stop), part in zip(((0, 30), (30, 53)), halves):
        epilogue.softmax_grad(*part[:3], state, *part[3:], None, out[:, start:stop])
    _close(out, grad, rtol=1e-5, atol=1e-6)


@interpreted
@pytest.mark.parametrize(
    ("case", "dtype"), [(case, torch.float32) for case in CASES] + [("random", torch.bfloat16)], ids=str
)
def test_sigmoid_block(case: str, dtype: torch.dtype) -> None:
    """Row sums, G and its row sums equal the eager chain and float64, in one span and several."""
    block = _block(case)
    weights = _weights(block)
    margins = block.logits.clone()
    eager_sums = _sigmoid.block_state_(margins, block.targets(), None)[:, 0]
    eager_grad = _sigmoid.gradient_(margins, eager_sums[:, None], block.targets(), None, weights)
    sums, grad = sigmoid_reference(block, weights)
    args = (block.product, block.scale, block.bias, block.positive, block.excluded)
    for splits in (1, 2):
        out = torch.empty(block.product.shape, dtype=dtype)
        row_sums, grad_sums = epilogue.sigmoid_block(*args, weights, out, splits=splits)
        _close(row_sums, eager_sums, rtol=1e-6, atol=1e-6)
        _close(row_sums, sums, rtol=1e-6, atol=1e-6)
        _close(out.float(), eager_grad, rtol=torch.finfo(dtype).eps, atol=1e-7)
        _close(grad_sums, grad.sum(1), rtol=1e-5, atol=1e-5)
    unweighted, _ = epilogue.sigmoid_block(*args, None, None)
    _close(unweighted, sums, rtol=1e-6, atol=1e-6)


KEYED = ["supcon", "supcon_ties", "supcon_transposed", "ids_positive", "ids_mask"]
"""Blocks with keys (six distinct ones, and one no column has; the last five columns have none):
SupCon's anchors (positives by label, no positive column; with many logits tied at the maximum; seen
transposed), sample ids as positives beside the row's positive column, and as pairs left out."""


def _keyed(case: str, key_dtype: torch.dtype = torch.float32) -> tuple[Block, Targets, dict[str, object]]:
    """A block, its targets as the eager chain takes them and the ops' key arguments (keys in ``key_dtype``)."""
    block = _block("transposed" if case.endswith("transposed") else "random", seed=2)
    generator = torch.Generator().manual_seed(3)
    c, m = block.product.shape
    if case == "supcon_ties":  # integer products: logits s·P + b tie exactly, at the maximum too
        block = block._replace(product=(block.product * 2).round())
    if case.startswith("supcon"):
        block = block._replace(positive=torch.full((c,), -1))
    row_keys = torch.randint(0, 6, (c,), generator=generator).float()
    row_keys[::5] = 99.0  # a key no column has: SupCon's anchor without positives
    column_keys = torch.randint(0, 6, (m - 5,), generator=generator).float()
    row_keys, column_keys = row_keys.to(key_dtype), column_keys.to(key_dtype)
    rule = "mask" if case == "ids_mask" else "positive"

    def located(index: Tensor | None) -> Located | None:
        if index is None or not bool((index >= 0).any()):
            return None
        return Located(index.clamp(0, m - 1)[:, None], index >= 0)

    targets = Targets(located(block.positive), located(block.excluded), row_keys, column_keys, rule)  # type: ignore[arg-type]
    keys = {"row_keys": row_keys, "column_keys": column_keys, "keys_positive": rule == "positive"}
    return block, targets, keys


def _eager_softmax(block: Block, targets: Targets, weights: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    numerators = block.logits.to(dtype)
    mask = targets.positive_mask(numerators)
    state = _softmax.block_state_(numerators, targets, mask)
    return state, _softmax.gradient_(numerators, state, targets, mask, weights.to(dtype))


def _same_state(actual: Tensor, expected: Tensor, rtol: float = 2e-6, atol: float = 1e-7) -> None:
    """Equal states: the maximum, the whole sum, the positives; and the loss.

    The exact part may differ in what it holds (tied maxima: counted, or one of them exact and the
    others summed), never in the sum.
    """
    for numbers in (lambda s: s[:, 0], lambda s: s[:, 1] + s[:, 2], lambda s: s[:, 3:], _softmax.finish):
        _close(numbers(actual), numbers(expected), rtol=rtol, atol=atol)


@interpreted
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.int64])  # small keys as floats; keys as they came
@pytest.mark.parametrize("case", KEYED)
def test_keys_compared_in_the_kernels(case: str, key_dtype: torch.dtype) -> None:
    """States (one span and several, merged), gradients and SigLIP's terms with keys equal the eager chain."""
    block, targets, keys = _keyed(case, key_dtype)
    weights = _weights(block)
    eager_state, eager_grad = _eager_softmax(block, targets, weights, torch.float32)
    exact_state, exact_grad = _eager_softmax(block, targets, weights, torch.float64)
    positive = None if targets.positive is None else block.positive
    args = (block.product, block.scale, block.bias, positive, block.excluded)
    assert bool((_softmax.has_positive(exact_state)).any()) and not bool(_softmax.has_positive(exact_state).all())
    for splits in (1, 3):
        state = epilogue.softmax_state(*args, splits=splits, **keys)
        _same_state(state, eager_state)
        _same_state(state, exact_state, rtol=1e-5, atol=1e-6)
    fused_grad = torch.empty_like(block.product)
    fused_state = epilogue.softmax_block(*args, weights, fused_grad, **keys)
    _same_state(fused_state, eager_state)
    separate_grad = torch.empty_like(block.product)
    epilogue.softmax_grad(*args[:3], fused_state, *args[3:], weights, separate_grad, **keys)
    assert torch.equal(separate_grad, fused_grad)
    _close(fused_grad, eager_grad)
    _close(fused_grad, exact_grad, rtol=1e-5, atol=1e-6)
    margins = block.logits.clone()
    mask = targets.positive_mask(margins)
    eager_sums = _sigmoid.block_state_(margins, targets, mask)[:, 0]
    eager_sigmoid = _sigmoid.gradient_(margins, eager_sums[:, None], targets, mask, weights)
    for splits in (1, 2):
        out = torch.empty_like(block.product)
        sums, grad_sums = epilogue.sigmoid_block(*args, weights, out, splits=splits, **keys)
        _close(sums, eager_sums, rtol=1e-6, atol=1e-6)
        _close(out, eager_sigmoid, rtol=1e-6, atol=1e-7)
        _close(grad_sums, eager_sigmoid.sum(1), rtol=1e-5, atol=1e-5)


class Pairs(NamedTuple):
    """A block whose first ``width`` columns are a side of their own (seen as rows), its targets and keys."""

    block: Block
    positive: Tensor | None  # the rows' (None: positives by key alone)
    column_positive: Tensor | None  # (width,) each column's positive row, less column_shift; -1: none
    column_excluded: Tensor | None
    width: int
    keys: dict[str, object]


PAIRS = ["positives", "one_program_of_rows", "narrow_side", "keys_left_out", "keys_positive", "keys_alone", "shifted"]
"""Both sides with positives and excluded pairs (a symmetric InfoNCE's); the rows in one program (the columns'
state finished in the kernel); a side narrower than the block; keys that leave pairs out; keys as positives
beside the positives; keys alone (SupCon's anchors, a Gram loss's pair of tiles); positives stored shifted."""


def _pairs(case: str) -> Pairs:
    generator = torch.Generator().manual_seed(4)
    block = _block("random", seed=5)
    c, m = block.product.shape
    if case == "one_program_of_rows":  # (the interpreter's tile has 16 rows)
        block = Block(*(field[:12] if field is not None and field.dim() else field for field in block))
        c = 12
    width = 29 if case == "narrow_side" else m
    column_positive = torch.randint(0, c, (width,), generator=generator)
    column_positive[::4] = -1
    column_excluded = (column_positive + 1 + torch.randint(0, c - 1, (width,), generator=generator)) % c
    column_excluded[1::3] = -1
    keys: dict[str, object] = {}
    positive: Tensor | None = block.positive
    if case.startswith("keys"):
        row_keys = torch.randint(0, 6, (c,), generator=generator)
        row_keys[::5] = 99  # a key no column has
        keys = {"row_keys": row_keys, "column_keys": torch.randint(0, 6, (m - 5,), generator=generator),
                "keys_positive": case != "keys_left_out"}  # fmt: skip
        width = min(width, m - 5)  # every column with a side has a key
        column_positive, column_excluded = column_positive[:width], column_excluded[:width]
    if case == "keys_alone":
        positive = column_positive = None
        block = block._replace(product=(block.product * 2).round())  # logits tied at the maximum too
    if case == "shifted":
        keys = {"positive_shift": 3, "column_shift": 7}
        positive = torch.where(block.positive >= 0, block.positive + 3, -1)
        column_positive = torch.where(column_positive >= 0, column_positive + 7, -1)
        column_excluded = torch.where(column_excluded >= 0, column_excluded - 7, -1)  # as _fused passes them
    return Pairs(block, positive, column_positive, column_excluded, width, keys)


def _one_side(pairs: Pairs, columns: bool) -> tuple[tuple[object, ...], dict[str, object]]:
    """The single-direction ops' arguments for the rows (``columns`` False) or the columns seen as rows."""
    block, keys = pairs.block, dict(pairs.keys)
    column_shift = keys.pop("column_shift", 0)
    if not columns:
        return (block.product, block.scale, block.bias, pairs.positive, block.excluded), keys
    swapped = {**keys, "positive_shift": column_shift}
    if "row_keys" in keys:
        swapped["row_keys"], swapped["column_keys"] = keys["column_keys"][: pairs.width], keys["row_keys"]  # type: ignore[index]
    product = block.product[:, : pairs.width].T
    return (product, block.scale, block.bias, pairs.column_positive, pairs.column_excluded), swapped


@interpreted
@pytest.mark.parametrize("case", PAIRS)
def test_rows_and_columns_from_one_read(case: str) -> None:
    """softmax_pairs and softmax_pair_grad equal the rows' ops and the columns' (on ``P.T``), added.

    The single-direction ops are checked above against the eager chain and float64. Several spans and
    several programs of rows (partial states merged), and ``G`` over the product itself (float32) and in
    its rows' first halves (bfloat16).
    """
    pairs = _pairs(case)
    rows_args, rows_keys = _one_side(pairs, columns=False)
    columns_args, columns_keys = _one_side(pairs, columns=True)
    row_state = epilogue.softmax_state(*rows_args, **rows_keys)
    column_state = epilogue.softmax_state(*columns_args, **columns_keys)
    assert bool(_softmax.has_positive(column_state).any())
    arguments = (*rows_args, pairs.column_positive, pairs.column_excluded, pairs.width)
    for splits in (1, 3):
        states = epilogue.softmax_pairs(*arguments, splits=splits, **pairs.keys)
        _same_state(states[0], row_state)
        _same_state(states[1], column_state)
    row_weights, column_weights = _weights(pairs.block), torch.rand(pairs.width) + 0.5
    expected = torch.empty_like(pairs.block.product)
    epilogue.softmax_grad(*rows_args[:3], row_state, *rows_args[3:], row_weights, expected, **rows_keys)
    column_grad = torch.empty(pairs.width, pairs.block.product.shape[0])
    epilogue.softmax_grad(*columns_args[:3], column_state, *columns_args[3:], column_weights, column_grad,
                          **columns_keys)  # fmt: skip
    expected[:, : pairs.width] += column_grad.T
    for dtype in (torch.float32, torch.bfloat16):
        product = pairs.block.product.clone()
        grad = product if dtype == torch.float32 else product.view(dtype)[:, : product.shape[1]]
        epilogue.softmax_pair_grad(product, *rows_args[1:3], row_state, *rows_args[3:], row_weights, column_state,
                                   pairs.column_positive, pairs.column_excluded, column_weights, grad, **pairs.keys)
        _close(grad.float(), expected, rtol=torch.finfo(dtype).eps, atol=1e-7)


@interpreted
def test_rows_and_columns_of_an_empty_side() -> None:
    """No rows: the columns' state is the empty one; no column with a side: the rows' state alone."""
    pairs = _pairs("positives")
    scale, block = pairs.block.scale, pairs.block
    _, columns = epilogue.softmax_pairs(block.product[:0], scale, None, None, None, pairs.column_positive, None,
                                        pairs.width)  # fmt: skip
    assert torch.equal(columns, _softmax.empty_state(pairs.width, columns))
    rows, columns = epilogue.softmax_pairs(block.product, scale, block.bias, block.positive, None, None, None, 0)
    torch.testing.assert_close(rows, epilogue.softmax_state(block.product, scale, block.bias, block.positive, None),
                               rtol=0, atol=0)  # fmt: skip
    assert columns.shape == (0, 5)
    with pytest.raises(ValueError, match="width must be between 0 and the block's 53 columns, got 54"):
        epilogue.softmax_pairs(block.product, scale, None, None, None, None, None, 54)


@interpreted
def test_gradient_written_in_place() -> None:
    """``grad`` may be the product itself: each program reads its rows before it writes them."""
    block = _block("random")
    args = (block.scale, block.bias, block.positive, block.excluded, None)
    expected_sums, expected_grad = sigmoid_reference(block, torch.ones(37))
    product = block.product.clone()
    sums, _ = epilogue.sigmoid_block(product, *args, product)
    _close(sums, expected_sums, rtol=1e-6, atol=1e-6)
    _close(product, expected_grad)
    expected_grad = softmax_reference(block, torch.ones(37))[1]
    product = block.product.clone()
    state = epilogue.softmax_block(product, *args, product)
    _close(product, expected_grad, rtol=1e-5, atol=1e-6)
    product = block.product.clone()
    epilogue.softmax_grad(product, *args[:2], state, *args[2:], product)
    _close(product, expected_grad, rtol=1e-5, atol=1e-6)


@interpreted
def test_custom_ops_pass_opcheck() -> None:
    """Schemas, fake implementations and autograd registration agree with the kernels."""
    block = _block("single_row")
    args = (block.product, block.scale, block.bias, block.positive, block.excluded)
    state = epilogue.softmax_state(*args)
    grad = torch.empty_like(block.product)
    weights = torch.rand(1)
    calls = [
        (epilogue.sigmoid_block, (*args, None, grad.clone()), {}),
        (epilogue.sigmoid_block, (*args, weights, None), {"splits": 2}),
        (epilogue.softmax_state, args, {"splits": 2}),
        (epilogue.softmax_grad, (*args[:3], state, *args[3:], None, grad.clone()), {}),
        (epilogue.softmax_grad, (*args[:3], state, *args[3:], weights, grad.clone().bfloat16()), {}),
        (epilogue.softmax_block, (*args, weights, grad.clone()), {}),
    ]
    keyed, _, keys = _keyed("supcon")  # keys as positives, SupCon's anchors
    keyed_args = (keyed.product, keyed.scale, keyed.bias, None, keyed.excluded)
    keyed_state = epilogue.softmax_state(*keyed_args, **keys)
    masked = {**keys, "keys_positive": False}  # keys that leave pairs out
    calls += [
        (epilogue.softmax_state, keyed_args, {"splits": 2, **keys}),
        (epilogue.softmax_block, (*keyed_args, None, torch.empty_like(keyed.product)), keys),
        (epilogue.softmax_grad, (*keyed_args[:3], keyed_state, *keyed_args[3:], None, torch.empty_like(keyed.product)),
         masked),
        (epilogue.sigmoid_block, (*keyed_args, None, torch.empty_like(keyed.product)), masked),
    ]
    pairs = _pairs("keys_positive")
    pair_args = (*pairs.block[:3], pairs.positive, pairs.block.excluded, pairs.column_positive, pairs.column_excluded)
    row_state, column_state = epilogue.softmax_pairs(*pair_args, pairs.width, **pairs.keys)
    calls += [
        (epilogue.softmax_pairs, (*pair_args, pairs.width), {"splits": 2, **pairs.keys}),
        (epilogue.softmax_pair_grad, (*pair_args[:3], row_state, *pair_args[3:5], None, column_state,
                                      *pair_args[5:], None, torch.empty_like(pairs.block.product)), pairs.keys),
    ]
    for op, op_args, op_kwargs in calls:
        torch.library.opcheck(op, op_args, op_kwargs)


@interpreted
def test_ops_trace_as_one_node_under_compile() -> None:
    block = _block("single_row")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def loss(product: Tensor) -> Tensor:
        grad = torch.empty_like(product)
        state = epilogue.softmax_block(product, block.scale, block.bias, block.positive, block.excluded, None, grad)
        return _softmax.finish(state).sum() + grad.sum()

    expected = _softmax.finish(epilogue.softmax_state(*block[:4], block.excluded)).sum()
    torch.testing.assert_close(loss(block.product), expected, atol=1e-5, rtol=1e-5)


@interpreted
def test_bad_inputs_are_named() -> None:
    block = _block("single_row")
    with pytest.raises(TypeError, match="product must be a 2-D float32"):
        epilogue.softmax_state(block.product.double(), block.scale, None, None, None)
    with pytest.raises(TypeError, match="positive must be a contiguous"):
        epilogue.softmax_state(block.product, block.scale, None, block.positive.int(), None)
    with pytest.raises(TypeError, match="grad must be"):
        epilogue.sigmoid_block(block.product, block.scale, None, None, None, None, torch.empty(2, 2))
    with pytest.raises(ValueError, match="positive_shift must be >= 0"):
        epilogue.softmax_state(block.product, block.scale, None, block.positive, None, positive_shift=-1)


@interpreted
def test_the_positives_shift_is_subtracted_in_the_kernel() -> None:
    """Positives passed unshifted with ``positive_shift`` (a chunk's first row): every op gives what the shifted
    positives give, and stored indices that fall outside the block after the shift are none."""
    block = _block("transposed")
    shift = 5
    stored = torch.where(block.positive >= 0, block.positive + shift, block.positive)
    stored[2] = shift - 1  # before the block once shifted: none, as the -1 it becomes
    shifted = torch.where(torch.arange(len(stored)) == 2, -1, block.positive)
    args = (block.product, block.scale, block.bias)
    state = epilogue.softmax_state(*args, stored, block.excluded, positive_shift=shift)
    torch.testing.assert_close(state, epilogue.softmax_state(*args, shifted, block.excluded), rtol=0, atol=0)
    for op in (epilogue.softmax_grad, epilogue.softmax_block, epilogue.sigmoid_block):
        grads = [torch.zeros(block.product.shape), torch.zeros(block.product.shape)]
        if op is epilogue.softmax_grad:
            op(*args, state, stored, block.excluded, None, grads[0], positive_shift=shift)
            op(*args, state, shifted, block.excluded, None, grads[1])
        else:
            op(*args, stored, block.excluded, None, grads[0], positive_shift=shift)
            op(*args, shifted, block.excluded, None, grads[1])
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0, msg=str(op))


@interpreted
def test_available(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(2)
    monkeypatch.setenv(epilogue.EPILOGUE_VARIABLE, "triton")
    assert epilogue.available(cpu)  # TRITON_INTERPRET=1 here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not epilogue.available(cpu)
    monkeypatch.setenv(epilogue.EPILOGUE_VARIABLE, "auto")
    assert not epilogue.available(cpu)
    monkeypatch.setenv(epilogue.EPILOGUE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="CONTRASTIVE_DIST_EPILOGUE must be one of"):
        epilogue.available(cpu)


_POINTERS = {"pos_ptr": "*i64", "excl_ptr": "*i64", "cpos_ptr": "*i64", "cexcl_ptr": "*i64"}
_OPTIONAL = {"bias_ptr": "HAS_BIAS", "pos_ptr": "HAS_POS", "excl_ptr": "HAS_EXCL", "w_ptr": "HAS_W", "g_ptr": "WRITE_G",
             "rk_ptr": "KEY_RULE", "ck_ptr": "KEY_RULE", "cpos_ptr": "HAS_CPOS", "cexcl_ptr": "HAS_CEXCL",
             "cw_ptr": "HAS_CW"}  # fmt: skip
_INPUTS = {  # every optional input (keys as positives, float keys), the fewest, keys that leave pairs out (int64 keys)
    "every_input": (True, 1, "*fp32"),
    "fewest_inputs": (False, 0, "*fp32"),
    "keys_left_out": (True, 2, "*i64"),
}


@outside_interpreter
@pytest.mark.parametrize("inputs", list(_INPUTS))
def test_kernels_compile_for_cuda(inputs: str) -> None:
    """Each kernel compiles to a cubin for sm_90 (no GPU needed): what the interpreter cannot check.

    The absent inputs are ``None`` pointers, as the ops pass them.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from contrastive_dist.losses import _triton_kernels as kernels
    from contrastive_dist.losses import _triton_pairs as pairs

    if kernels.triton is None or not Path(kernels.triton.__file__).parent.joinpath("backends", "nvidia").exists():
        pytest.skip("Triton without its NVIDIA backend")
    every_input, key_rule, key_type = _INPUTS[inputs]
    flags = {"HAS_BIAS": every_input, "HAS_POS": every_input, "HAS_EXCL": every_input, "HAS_W": every_input,
             "WRITE_G": every_input, "SINGLE": every_input, "HAS_CPOS": every_input, "HAS_CEXCL": every_input,
             "HAS_CW": every_input, "ROWS_SINGLE": every_input, "COLUMNS_SINGLE": not every_input,
             "KEY_RULE": key_rule}  # fmt: skip
    tile = {"BR": 8, "BC": 256} if every_input else {"BR": 1, "BC": 2048}  # the widest and the narrowest
    for kernel in (kernels.sigmoid_kernel, kernels.state_kernel, kernels.finish_kernel, kernels.grad_kernel,
                   kernels.block_kernel, pairs.pair_state_kernel, pairs.pair_finish_kernel,
                   pairs.pair_grad_kernel):  # fmt: skip
        signature: dict[str, str] = {}
        constants: dict[str, object] = {}
        for name in kernel.arg_names:
            if name in flags or name in ("BR", "BC"):
                signature[name], constants[name] = "constexpr", flags.get(name, tile.get(name))
            elif _OPTIONAL.get(name) in kernel.arg_names and not flags[_OPTIONAL[name]]:
                signature[name], constants[name] = "constexpr", None  # an input the op was not given
            elif name in ("rk_ptr", "ck_ptr"):
                signature[name] = key_type
            elif name.endswith("_ptr"):
                signature[name] = _POINTERS.get(name, "*bf16" if name == "g_ptr" else "*fp32")
            else:
                signature[name] = "i32"
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        assert compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"], kernel.fn.__name__


@interpreted
def test_empty_blocks() -> None:
    """No columns: the rows' state is the empty one, their sums 0; no rows: empty outputs."""
    scale, positive = torch.tensor(2.0), torch.tensor([0, -1, 1])
    state = epilogue.softmax_state(torch.empty(3, 0), scale, None, positive, None)
    assert torch.equal(state, _softmax.empty_state(3, state))
    sums, grad_sums = epilogue.sigmoid_block(torch.empty(3, 0), scale, None, positive, None, None, torch.empty(3, 0))
    assert not sums.any() and not grad_sums.any() and sums.shape == (3,)
    assert epilogue.softmax_state(torch.empty(0, 4), scale, None, None, None).shape == (0, 5)


@outside_interpreter
def test_traffic_counted_on_the_meta_device() -> None:
    """Each op is one call to a dispatch mode, and moves the bytes per logit of the module's table."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Traffic(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "contrastive_dist":
                self.calls.append((func._schema.name, epilogue.traffic(func, args, kwargs)))
            return func(*args, **(kwargs or {}))

    rows, columns = 256, 4096
    product = torch.empty(rows, columns, device="meta")
    grad = torch.empty(rows, columns, device="meta", dtype=torch.bfloat16)
    scale, bias, positive = torch.empty((), device="meta"), None, torch.empty(rows, device="meta", dtype=torch.int64)
    with Traffic() as counter:
        epilogue.sigmoid_block(product, scale, bias, positive, None, None, grad)
        state = epilogue.softmax_state(product, scale, bias, positive, None)
        epilogue.softmax_grad(product, scale, bias, state, positive, None, None, grad)
        epilogue.softmax_block(product, scale, bias, positive, None, None, grad)
        state, column_state = epilogue.softmax_pairs(product, scale, bias, positive, None, positive, None, rows)
        epilogue.softmax_pair_grad(product, scale, bias, state, positive, None, None, column_state, positive, None,
                                   None, grad)  # fmt: skip
    per_logit = [(name.split("::")[1], round(moved / product.numel())) for name, moved in counter.calls]
    assert per_logit == [("sigmoid_block", 6), ("softmax_state", 4), ("softmax_grad", 6), ("softmax_block", 10),
                         ("softmax_pairs", 4), ("softmax_pair_grad", 6)]  # fmt: skip


def _interpreter_command() -> None:
    """Declare the interpreter's run of every check of this file but those that run here."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, _CHILD: "1", "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    env.pop(epilogue.EPILOGUE_VARIABLE, None)
    here = [name for name, test in globals().items() if outside_interpreter.mark in getattr(test, "pytestmark", [])]
    checks = " and ".join(f"not {name}" for name in here)  # the others run in this process
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", checks]
    background.command(INTERPRETER_CHECKS, argv, cwd=root, env=env)


if os.environ.get(_CHILD) != "1":
    _interpreter_command()
