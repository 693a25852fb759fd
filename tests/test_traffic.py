"""Memory traffic and launches of every loss on the CUDA path, counted on fake tensors (``tests/traffic.py``).

The counter is checked first against hand-computed cases and its backward walk against the autograd
engine; then each loss's block epilogue (everything but the matrix products), with half features on
fake CUDA tensors (half products: the route a GPU takes), against the targets below. The counts are
a property of the code, not of a machine: exact and the same on every run.

``python tests/test_traffic.py`` prints the counts of every loss, call and dtype as a Markdown table, then the
peak memory of SigLIP and InfoNCE at a GPU's sizes.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

import contrastive_dist

sys.path.insert(0, str(Path(__file__).parent))
import traffic  # noqa: E402 - a helper module of the tests, beside this file

SIGLIP_BYTES_PER_LOGIT = 16
"""SigLIP's epilogue: at most this many bytes read and written per logit, forward + backward."""
INFONCE_BYTES_PER_LOGIT = 16
"""Symmetric InfoNCE's epilogue, both directions, per logit of its ``n × n`` matrix: the rows' and the columns'
statistics from one read of each product, their gradients in one more (13.4 today; two reads of each, 23.4)."""
EAGER_SIGLIP_BYTES_PER_LOGIT = 80
"""SigLIP's eager chain (float16 features, chunks of :data:`CHUNK` rows): 78 bytes per logit today."""
LAUNCHES_PER_CHUNK_VISIT = {
    ("info_nce", "mean"): 2, ("info_nce", "none"): 2, ("siglip", "mean"): 1, ("siglip", "none"): 2,
    ("nt_xent", "mean"): 1, ("nt_xent", "none"): 2, ("supcon", "mean"): 1, ("supcon", "none"): 2,
}
"""Epilogue launches per chunk of rows meeting a block of columns, forward + backward: the fused kernels
alone (InfoNCE: both directions' states from one read, then both gradients in one write; 4 before, the
first target 12). Each launch
costs a GPU's host about as much as a small chunk's work: the per-chunk results (states, the bias's row
sums, the has-positive flags) are joined once, the row weights made contiguous once, and the columns'
positives shifted in the kernel (SigLIP's mean took 6 launches a chunk before, InfoNCE's 9)."""

ROWS, DIM, CHUNK = 4096, 192, 256
"""Counting sizes: samples, feature dimension, rows per chunk of the chunked call. ``D / N`` is small, as
in a GPU run (768 / 64k), so the per-call passes over the features weigh little per logit; ``D / chunk``
is not, so a per-chunk pass over an ``N × D`` temporary shows. ``D`` differs from every other size (rows,
chunks, their doubles): a product whose inner dimension is ``D`` is a logit block."""
LOSSES = ("info_nce", "siglip", "nt_xent", "supcon")
SYMMETRIC = ("nt_xent", "supcon")
"""Losses of ``2n`` rows against ``2n`` columns (two views per sample)."""
ID_LOSSES = ("info_nce", "siglip", "nt_xent")
"""Losses counted with ``ids=`` too (one sample in 50 shares its neighbour's id, as repeated captions do)."""
IDS_COST = 1.10
"""Epilogue bytes of a call with ``ids=`` at most this times the same call's without."""


def loss_call(loss: str, chunk: int | None, reduction: str = "mean", ids: bool = False) -> Callable[..., Tensor]:
    """The public function, called with ``chunk_size=chunk`` and otherwise its defaults.

    ``reduction="none"``: the per-row losses (their recomputed path), summed. ``ids``: the last input
    is the samples' ids (``ids=``).
    """
    function = getattr(contrastive_dist, loss)

    def call(*inputs: Tensor) -> Tensor:
        options: dict[str, object] = {"chunk_size": chunk, "reduction": reduction}
        if ids:
            *inputs, options["ids"] = inputs  # type: ignore[assignment]
        value = function(*inputs, **options)
        return value.sum() if reduction == "none" else value

    return call


def loss_inputs(
    loss: str, rows: int, dtype: torch.dtype, device: str = "cuda", ids: bool = False, dim: int = DIM
) -> Callable[[], list[Tensor]]:
    """A maker of the loss's inputs: features (two views), SigLIP's learnable scale and bias, SupCon's labels.

    ``ids``: the samples' ids last, one sample in 50 sharing its neighbour's; ``dim``: the features' dimension.
    """

    def features(*shape: int) -> Tensor:
        return torch.nn.functional.normalize(torch.randn(*shape, dtype=torch.float64), dim=-1).to(device, dtype)

    def make() -> list[Tensor]:
        if loss == "supcon":
            return [features(rows, 2, dim).requires_grad_(), torch.arange(rows, device=device) // 4]
        pair = [features(rows, dim).requires_grad_(), features(rows, dim).requires_grad_()]
        if loss == "siglip":
            pair += [torch.tensor(10.0, device=device, requires_grad=True),
                     torch.tensor(-10.0, device=device, requires_grad=True)]  # fmt: skip
        if ids:
            sample_ids = torch.arange(rows)
            sample_ids[1::50] = sample_ids[0::50][: len(sample_ids[1::50])]
            pair.append(sample_ids.to(device))
        return pair

    return make


def matrix_side(loss: str, rows: int) -> int:
    """Rows (= columns) of the loss's similarity matrix."""
    return 2 * rows if loss in SYMMETRIC else rows


def tally(
    loss: str, chunk: int | None, dtype: torch.dtype, rows: int = ROWS, reduction: str = "mean", ids: bool = False
) -> traffic.Tally:
    return traffic.count(loss_call(loss, chunk, reduction, ids), loss_inputs(loss, rows, dtype, ids=ids), dim=DIM)


def bytes_per_logit(
    loss: str, chunk: int | None, dtype: torch.dtype, reduction: str = "mean", ids: bool = False
) -> float:
    return tally(loss, chunk, dtype, reduction=reduction, ids=ids).epilogue_bytes / matrix_side(loss, ROWS) ** 2


def launches_per_chunk_visit(loss: str, dtype: torch.dtype, chunk: int = CHUNK, reduction: str = "mean") -> float:
    """Epilogue launches each chunk of rows adds: the difference between ``chunk`` and ``2 · chunk``.

    Fixed per-call launches (checks, allocations, the reduction) cancel out; what remains is the
    per-chunk cost of forward and backward, every direction and recomputation included.
    """
    side = matrix_side(loss, ROWS)
    extra_chunks = side // chunk - side // (2 * chunk)
    fine, coarse = (tally(loss, size, dtype, reduction=reduction).epilogue for size in (chunk, 2 * chunk))
    return (fine - coarse) / extra_chunks


# The counter itself, against sizes worked out by hand.


def _ops(function: Callable[..., object], *tensors: Tensor) -> list[traffic.Op]:
    with traffic.fake_cuda():
        fakes = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in tensors]
        with traffic.Traffic() as counter:
            function(*fakes)
    return counter.ops


def test_an_add_reads_both_operands_and_writes_its_result() -> None:
    a, b = torch.zeros(3, 5), torch.zeros(3, 5)
    assert [(op.name, op.bytes, op.inner, op.device) for op in _ops(torch.add, a, b)] == [
        ("aten.add.Tensor", 3 * 60, None, "cuda")
    ]


def test_in_place_and_write_only_operators() -> None:
    a, b = torch.zeros(3, 5), torch.zeros(3, 5)
    assert [op.bytes for op in _ops(lambda x, y: x.add_(y), a, b)] == [3 * 60]  # reads x, y; writes x
    assert [op.bytes for op in _ops(lambda x, y: x.copy_(y), a, b)] == [2 * 60]  # x is only written
    assert [op.bytes for op in _ops(lambda x: x.zero_(), a)] == [60]


def test_views_are_free_and_an_expanded_operand_reads_once() -> None:
    a, b = torch.zeros(1, 5), torch.zeros(4, 5)
    ops = _ops(lambda x, y: (x.T, x[0], x.view(5), x.expand(4, 5) + y), a, b)
    assert [(op.name, op.bytes) for op in ops] == [("aten.add.Tensor", 20 + 80 + 80)]


def test_products_stand_apart_with_their_inner_dimension() -> None:
    q, k = torch.zeros(6, 3, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16)
    ops = _ops(lambda x, y: torch.mm(x, y.T, out_dtype=torch.float32), q, k)
    assert [(op.name, op.bytes, op.inner) for op in ops] == [("aten.mm.dtype", 2 * 18 + 2 * 12 + 4 * 24, 3)]
    tally = traffic.Tally.of(ops, dim=3)
    assert (tally.products, tally.logit_blocks, tally.epilogue, tally.epilogue_bytes) == (1, 1, 0, 0)


def test_indexed_reads_and_writes_touch_only_their_elements() -> None:
    logits, index = torch.zeros(8, 100), torch.zeros(8, 1, dtype=torch.int64)
    picked = _ops(lambda x, i: x.gather(1, i), logits, index)
    assert [op.bytes for op in picked] == [8 * 8 + 2 * 8 * 4]  # the index, 8 floats read, 8 written
    written = _ops(lambda x, i: x.scatter_(1, i, torch.ones(8, 1, device="cuda")), logits, index)
    assert [op.bytes for op in written] == [4 * 8, 8 * 8 + 8 * 4 + 8 * 4]  # ones; then index, source, 8 writes


def test_a_value_read_back_is_a_host_read_not_a_launch() -> None:
    ops = _ops(lambda x: bool((x > 0).all()), torch.zeros(10))
    tally = traffic.Tally.of(ops, dim=1)
    assert (tally.epilogue, tally.host_reads) == (2, 1)


@torch.library.custom_op("traffic_test::scaled_add", mutates_args=())
def _scaled_add(x: Tensor, y: Tensor) -> Tensor:
    return 2 * x + y


@_scaled_add.register_fake
def _(x: Tensor, y: Tensor) -> Tensor:
    return torch.empty_like(x)


def test_a_custom_operator_is_one_launch() -> None:
    a, b = torch.zeros(3, 5), torch.zeros(3, 5)
    assert [(op.name, op.bytes) for op in _ops(_scaled_add, a, b)] == [("traffic_test.scaled_add.default", 180)]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("chunk", [None, 3])
def test_backward_walk_matches_the_autograd_engine(loss: str, chunk: int | None) -> None:
    inputs = loss_inputs(loss, 7, torch.float64, device="cpu")
    torch.manual_seed(0)
    engine = inputs()
    torch.manual_seed(0)
    walked = inputs()
    loss_call(loss, chunk)(*engine).backward()
    traffic.backward(loss_call(loss, chunk)(*walked))
    for expected, got in zip(engine, walked):
        if expected.requires_grad:
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-12, atol=1e-12)


# The losses' epilogues on the CUDA path (bf16 features, half products).


REDUCTIONS = ("mean", "none")
"""A loss (its gradient formed with the logits) and per-row losses (recomputed in backward, as in ring mode)."""


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("chunk", [None, CHUNK])
@pytest.mark.parametrize(
    ("loss", "target"), [("siglip", SIGLIP_BYTES_PER_LOGIT), ("info_nce", INFONCE_BYTES_PER_LOGIT)]
)
def test_epilogue_bytes_per_logit(loss: str, target: float, chunk: int | None, reduction: str) -> None:
    assert bytes_per_logit(loss, chunk, torch.bfloat16, reduction) <= target


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss", LOSSES)
def test_epilogue_launches_per_chunk_visit(loss: str, reduction: str) -> None:
    launches = launches_per_chunk_visit(loss, torch.bfloat16, reduction=reduction)
    assert launches <= LAUNCHES_PER_CHUNK_VISIT[loss, reduction]


def test_the_eager_chain_on_a_gpu_takes_softplus_in_one_pass() -> None:
    """float16 features keep the eager chain on a GPU: SigLIP's row sums there are ``F.softplus``, one pass.

    The CPU's route to them (:func:`~contrastive_dist.losses._sigmoid.softplus_sums`: ``exp``, the
    paired products, ``log``) takes a dozen passes, each of which would add to the bytes counted here.
    """
    assert bytes_per_logit("siglip", CHUNK, torch.float16) <= EAGER_SIGLIP_BYTES_PER_LOGIT


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss", ID_LOSSES)
def test_ids_cost_little_traffic(loss: str, reduction: str) -> None:
    """Ids are compared in the kernels: a few bytes per row and column, no mask over the block."""
    with_ids, without = (bytes_per_logit(loss, CHUNK, torch.bfloat16, reduction, ids=ids) for ids in (True, False))
    assert with_ids <= IDS_COST * without


def table(dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)) -> str:
    """The counts of every loss, call and dtype as a Markdown table."""
    lines = [
        f"n = {ROWS}, D = {DIM}, fake CUDA tensors, forward + backward, gather mode (no process group)\n",
        "| loss | call | dtype | products | logit blocks | epilogue launches | launches / chunk-visit "
        "| epilogue bytes / logit | host reads |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for loss, reduction, chunk, dtype in itertools.product(LOSSES, REDUCTIONS, (None, CHUNK), dtypes):
        counted = tally(loss, chunk, dtype, reduction=reduction)
        # The default call chooses its own chunks: no second size to difference against.
        per_visit = f"{launches_per_chunk_visit(loss, dtype, reduction=reduction):.1f}" if chunk else "—"
        call = ("default" if chunk is None else f"chunk{chunk}") + (", per row" if reduction == "none" else "")
        lines.append(
            f"| {loss} | {call} | {str(dtype).split('.')[1]} "
            f"| {counted.products} | {counted.logit_blocks} | {counted.epilogue} | {per_visit} "
            f"| {counted.epilogue_bytes / matrix_side(loss, ROWS) ** 2:.1f} | {counted.host_reads} |"
        )
    for loss, reduction in itertools.product(ID_LOSSES, REDUCTIONS):
        ratio = (bytes_per_logit(loss, CHUNK, torch.bfloat16, reduction, ids=ids) for ids in (True, False))
        lines.append(f"\n{loss}, chunk{CHUNK}, bfloat16, {reduction}: epilogue bytes with ids ÷ without "
                     f"{next(ratio) / next(ratio):.3f}")  # fmt: skip
    return "\n".join(lines)


PEAK_ROWS, PEAK_DIM = 65536, 768
"""The sizes of the peak's table: a GPU's default run (B = 65,536, D = 768)."""
INFONCE_PEAK_BYTES_PER_LOGIT = 7
"""Symmetric InfoNCE's default call at those sizes, bfloat16: at most this many bytes held above the inputs per
logit of its chunk (5.51 today: the float32 product 4, both features' float32 gradients 1.5)."""
STATE_BYTES_PER_ROW = 64
"""Besides the product and the gradients: the rows' and the columns' states and sums, per row (56 today)."""


def default_chunk_rows() -> int:
    """The rows of the default call's chunk on CUDA at :data:`PEAK_ROWS` (``_transports.chunks``)."""
    from contrastive_dist.losses._transports import chunks

    with traffic.fake_cuda():
        return chunks(PEAK_ROWS, None, PEAK_ROWS, torch.empty(1, device="cuda"))[0][1]


def test_infonce_peak_per_logit_of_its_chunk() -> None:
    """No bfloat16 gradient beside the product: both directions' ``G`` is written over the product's own bytes."""
    held = traffic.peak(loss_call("info_nce", None), loss_inputs("info_nce", PEAK_ROWS, torch.bfloat16, dim=PEAK_DIM))
    assert held / (default_chunk_rows() * PEAK_ROWS) <= INFONCE_PEAK_BYTES_PER_LOGIT


@pytest.mark.parametrize("loss", ["siglip", "info_nce"])
def test_a_chunked_peak_is_its_product_and_the_gradients_accumulators(loss: str) -> None:
    """With small chunks, nothing the size of the features in float32 beside the two gradients' accumulators.

    The allowance: one chunk's float32 product, the queries' and keys' float32 gradients, and
    :data:`STATE_BYTES_PER_ROW` (the rows' and columns' states and sums). The scale's gradient and the
    backward's cast once held two more float32 copies of the features (SigLIP 769 MiB here, 642 since).
    """
    rows, chunk = PEAK_ROWS, 1024
    held = traffic.peak(loss_call(loss, chunk), loss_inputs(loss, rows, torch.bfloat16, dim=PEAK_DIM))
    allowance = 4 * chunk * rows + 2 * 4 * rows * PEAK_DIM + STATE_BYTES_PER_ROW * rows
    assert held <= allowance, f"{held / 2**20:,.0f} MiB held, {allowance / 2**20:,.0f} allowed"


def peaks(losses: Sequence[str] = ("siglip", "info_nce"), chunk_sizes: Sequence[int | None] = (None, 1024)) -> str:
    """The most bytes each loss holds above its inputs, bfloat16 on fake CUDA tensors, as a Markdown table.

    Per logit of one chunk (the rows formed at once against every column): the default call's chunk on
    CUDA (:func:`default_chunk_rows`), or ``chunk_size``.
    """
    default = default_chunk_rows()
    lines = [f"B = {PEAK_ROWS}, D = {PEAK_DIM}, bfloat16, fake CUDA tensors, forward + backward\n",
             "| loss | call | chunk rows | peak above the inputs (MiB) | bytes per logit of a chunk |",
             "|---|---|---:|---:|---:|"]
    for loss, chunk in itertools.product(losses, chunk_sizes):
        held = traffic.peak(loss_call(loss, chunk), loss_inputs(loss, PEAK_ROWS, torch.bfloat16, dim=PEAK_DIM))
        rows = chunk or default
        call = "default" if chunk is None else f"chunk_size={chunk}"
        lines.append(f"| {loss} | {call} | {rows} | {held / 2**20:,.0f} | {held / (rows * PEAK_ROWS):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print()
    print(peaks())
