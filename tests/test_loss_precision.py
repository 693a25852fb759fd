"""Float32 precision of the loss kernel, the same in both communication modes.

No negative losses, exact zeros, symmetry, large features, and float32 within a few rounding
errors of float64 — for every loss, in gather mode and in ring mode alike.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_references import clip_rows, ntxent_rows, supcon_rows
from torch import Tensor

from contrastive_dist import info_nce, nt_xent, siglip, supcon

COMMUNICATIONS = ("gather", "ring")


def _unit(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1).to(dtype)


def _near_pairs(count: int, dim: int, seed: int) -> tuple[Tensor, Tensor]:
    """Near-perfect pairs: small losses, where two large rounded sums would lose float32's precision."""
    images = _unit(count, dim, seed=seed, dtype=torch.float64)
    return images, F.normalize(images + 0.05 * _unit(count, dim, seed=seed + 1000, dtype=torch.float64), dim=-1)


LOSSES: dict[str, Callable[[Tensor, Tensor, str], Tensor]] = {
    "info_nce": lambda a, b, mode: info_nce(a, b, temperature=0.1, communication=mode),  # type: ignore[arg-type]
    "nt_xent": lambda a, b, mode: nt_xent(a, b, temperature=0.1, communication=mode),  # type: ignore[arg-type]
    "supcon": lambda a, b, mode: supcon(
        torch.stack([a, b], 1), torch.arange(a.shape[0]) % 4, temperature=0.1, communication=mode  # type: ignore[arg-type]
    ),
    "siglip": lambda a, b, mode: siglip(a, b, 10.0, -10.0, communication=mode),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("communication", COMMUNICATIONS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_float32_is_as_precise_as_the_inputs_allow(loss: str, communication: str) -> None:
    # 16 × 32 near-perfect pairs, 100 seeds (loss) and 64 × 32, 50 seeds (gradient): float32 against
    # float64 of the same inputs. ``logsumexp − positive`` in float32 was 5.6e-5 (median) on the loss.
    errors = []
    for seed in range(100):
        images, texts = _near_pairs(16, 32, seed)
        exact = LOSSES[loss](images, texts, communication).item()
        errors.append(abs(LOSSES[loss](images.float(), texts.float(), communication).item() - exact) / exact)
    assert statistics.median(errors) <= 3e-7 and max(errors) <= 1.5e-6, (statistics.median(errors), max(errors))
    gradient_errors = []
    for seed in range(50):
        images, texts = _near_pairs(64, 32, seed)
        grads = []
        for dtype in (torch.float64, torch.float32):
            leaf = images.to(dtype).requires_grad_()
            grads.append(torch.autograd.grad(LOSSES[loss](leaf, texts.to(dtype), communication), leaf)[0].double())
        gradient_errors.append(((grads[1] - grads[0]).norm() / grads[0].norm()).item())
    assert statistics.median(gradient_errors) <= 2e-6, statistics.median(gradient_errors)


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_tiny_losses_and_one_sample_batches_are_exact(communication: str) -> None:
    mode = {"communication": communication}
    # Identical features at a low temperature: the loss is ~4e-15, kept to float32's relative precision.
    features = _unit(16, 32, seed=7)
    exact = info_nce(features.double(), features.double(), temperature=0.02, **mode).item()  # type: ignore[arg-type]
    assert abs(info_nce(features, features, temperature=0.02, **mode).item() - exact) <= 1e-15  # type: ignore[arg-type]
    # One sample: its positive is its only candidate, so the loss is exactly 0 (was 9.5e-7 in float32).
    for seed in range(20):
        image, text = _unit(1, 16, seed=seed), _unit(1, 16, seed=seed + 100)
        two_views = torch.stack([image, text], dim=1)
        for chunk_size in (None, 1):
            options = {"chunk_size": chunk_size, **mode}
            for loss in (
                info_nce(image, text, 1 / 0.07, **options),  # type: ignore[arg-type]
                info_nce(image, text, 1 / 0.07, symmetric=False, **options),  # type: ignore[arg-type]
                info_nce(image, text, reduction="none", **options),  # type: ignore[arg-type]
                nt_xent(image * 3, text, temperature=0.05, **options),  # type: ignore[arg-type]
                nt_xent(image, text, reduction="none", **options),  # type: ignore[arg-type]
                supcon(two_views, torch.tensor([4]), temperature=0.05, **options),  # type: ignore[arg-type]
                supcon(two_views, torch.tensor([4]), reduction="none", **options),  # type: ignore[arg-type]
            ):
                assert torch.equal(loss, torch.zeros_like(loss)), (seed, chunk_size, loss)
    # SigLIP has no such zero: a single pair still pays softplus(−logit); it is finite and positive.
    assert siglip(image, text, 10.0, -10.0, **mode).item() > 0  # type: ignore[arg-type]
    # lightly's case: 2 × 16 at temperature 0.05 was −1.9e-6 in float32 (float64: +1.3e-10).
    images = _unit(2, 16, seed=2)
    texts = F.normalize(images.double() + 1e-3 * _unit(2, 16, seed=3, dtype=torch.float64), dim=-1)
    for symmetric in (True, False):
        expected = clip_rows(images.double(), texts, torch.tensor(20.0).double(), None, symmetric).mean().item()
        actual = info_nce(images, texts.float(), temperature=0.05, symmetric=symmetric, **mode).item()  # type: ignore[arg-type]
        assert 0 <= actual and abs(actual - expected) <= 1e-6 * expected + 1e-12, (actual, expected)


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 6),
    dim=st.integers(2, 8),
    temperature=st.floats(0.01, 2.0),
    seed=st.integers(0, 2**16),
    spread=st.floats(1e-4, 1.0),
)
def test_losses_are_never_negative_in_float32(
    count: int, dim: int, temperature: float, seed: int, spread: float
) -> None:
    # Texts close to their images make small losses, where two rounded sums used to cross zero.
    images = _unit(count, dim, seed=seed)
    texts = F.normalize(images + spread * _unit(count, dim, seed=seed + 1), dim=-1)
    labels = torch.randint(0, 2, (count,), generator=torch.Generator().manual_seed(seed))
    for communication in COMMUNICATIONS:
        for chunk_size in (None, 2):
            options = {"temperature": temperature, "chunk_size": chunk_size, "communication": communication}
            values = [
                info_nce(images, texts, **options),  # type: ignore[arg-type]
                info_nce(images, texts, symmetric=False, **options),  # type: ignore[arg-type]
                info_nce(images, texts, reduction="none", **options),  # type: ignore[arg-type]
                nt_xent(images, texts, **options),  # type: ignore[arg-type]
                nt_xent(images, texts, reduction="none", **options),  # type: ignore[arg-type]
                supcon(torch.stack([images, texts], 1), labels, **options),  # type: ignore[arg-type]
                supcon(images, labels, reduction="none", **options),  # type: ignore[arg-type]
            ]
            for value in values:
                assert bool((value >= 0).all()), (communication, chunk_size, value)


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_symmetric_losses_do_not_depend_on_argument_order(communication: str) -> None:
    for seed in range(5):
        a, b = _unit(7, 12, seed=seed), _unit(7, 12, seed=seed + 50)
        for chunk_size in (None, 3):
            options = {"chunk_size": chunk_size, "communication": communication}
            # CLIP's two directions swap; NT-Xent visits the same logits in another order.
            for loss in (info_nce, nt_xent):
                torch.testing.assert_close(loss(a, b, **options), loss(b, a, **options), rtol=1e-6, atol=0)  # type: ignore[operator]
            a64, b64 = a.double(), b.double()
            torch.testing.assert_close(nt_xent(a64, b64, **options), nt_xent(b64, a64, **options), rtol=1e-14, atol=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_large_features_match_float64(communication: str) -> None:
    # A row of norm 1e8 among unit rows: SupCon's class sum minus itself lost its positives entirely.
    generator = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2, 1])
    for norm in (1e4, 1e8):
        for views in (1, 2):
            features = F.normalize(torch.randn(8, *([2] * (views - 1)), 6, generator=generator).double(), dim=-1)
            features[0] *= norm
            features32 = features.float()
            rows, counted = supcon_rows(features32.double(), labels, 1 / 0.5)
            expected = (rows * counted).sum() / counted.sum()
            for chunk_size in (None, 3):
                actual = supcon(features32, labels, temperature=0.5, chunk_size=chunk_size, communication=communication)  # type: ignore[arg-type]
                assert abs(actual.item() - expected.item()) <= 1e-4 * expected.item(), (norm, views, chunk_size)
    a = (torch.randn(6, 5, generator=generator, dtype=torch.float64) * 1e4).float()
    b = (torch.randn(6, 5, generator=generator, dtype=torch.float64) * 1e4).float()
    expected = clip_rows(a.double(), b.double(), torch.tensor(1e-6).double(), None, True).mean()
    torch.testing.assert_close(info_nce(a, b, 1e-6, communication=communication).double(), expected, rtol=1e-5, atol=0)  # type: ignore[arg-type]
    expected = ntxent_rows(a.double(), b.double(), 2.0).mean()
    actual = nt_xent(a, b, temperature=0.5, communication=communication)  # type: ignore[arg-type]
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_losses_without_gradients_equal_the_losses_with_them(communication: str) -> None:
    # Under no_grad the kernel skips the gradient products; the values must not change.
    images, texts = _unit(9, 6, seed=7).requires_grad_(), _unit(9, 6, seed=8)
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 0, 1, 3])
    for chunk_size in (None, 4):
        options = {"chunk_size": chunk_size, "communication": communication}
        calls = (
            functools.partial(info_nce, images, texts, **options),
            functools.partial(info_nce, images, texts, reduction="none", **options),
            functools.partial(nt_xent, images, texts, **options),
            functools.partial(supcon, images, labels, **options),
            functools.partial(siglip, images, texts, 3.0, -1.0, **options),
        )
        for call in calls:
            with_grad = call()
            with torch.no_grad():
                assert torch.equal(call(), with_grad.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softplus_sums_are_within_two_ulps_of_log1p(dtype: torch.dtype) -> None:
    """SigLIP's row sums, from ``log`` corrected for the rounding of ``1 + e``, against ``log1p`` in float64.

    Margins from ``−87`` to ``87`` (where float32's ``exp(−|m|)`` is still normal) and tiny ones near 0;
    infinities and NaN as ``F.softplus`` gives them.
    """
    from contrastive_dist.losses._sigmoid import softplus_sums

    tiny = torch.logspace(-30, 1.9, 20_001, dtype=torch.float64)
    margins = torch.cat([torch.linspace(-87, 87, 100_001, dtype=torch.float64), tiny, -tiny]).to(dtype)
    exact = margins.double().clamp(min=0) + torch.log1p(torch.exp(-margins.double().abs()))
    ours = softplus_sums(margins[:, None])[:, 0].double()
    relative = ((ours - exact).abs() / exact).max().item()
    # Two ulps: measured 1.4 in float32 (F.softplus: 1.0), and in float64 the reference rounds too.
    assert relative <= 2 * torch.finfo(dtype).eps, relative
    special = torch.tensor([[math.inf], [-math.inf], [math.nan], [0.0]], dtype=dtype)
    torch.testing.assert_close(softplus_sums(special)[:, 0], F.softplus(special)[:, 0], equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [4096, 4095, 96, 2])
def test_softplus_sums_of_wide_rows_against_float64(dtype: torch.dtype, width: int) -> None:
    """Rows whose factors ``1 + e`` are paired before their one ``log``: every spread of margins, odd widths.

    Margins around −8 (SigLIP's negatives: tiny ``e``), around 0 (``e`` near 1, the largest products),
    wide ones, and rows with excluded pairs (``-inf``), an infinite and a NaN margin.
    """
    from contrastive_dist.losses._sigmoid import softplus_sums

    generator = torch.Generator().manual_seed(width)
    spreads = [(3.0, -8.0), (1.0, 0.0), (0.01, 0.0), (30.0, -5.0)]
    margins = torch.cat(
        [torch.randn(8, width, generator=generator, dtype=torch.float64) * scale + shift for scale, shift in spreads]
    )
    margins[0, ::3] = -math.inf
    margins = margins.to(dtype)
    exact = (margins.double().clamp(min=0) + torch.log1p(torch.exp(-margins.double().abs()))).sum(dim=1)
    relative = ((softplus_sums(margins)[:, 0].double() - exact).abs() / exact).max().item()
    # Measured: at most 1.0 eps in float32 and 1.7 in float64 (one log per logit, before: 1.0 and 1.1).
    assert relative <= 8 * torch.finfo(dtype).eps, relative
    special = torch.zeros(3, width, dtype=dtype)
    special[0, -1], special[1, 0], special[2, width // 2] = math.inf, math.nan, -math.inf
    sums = softplus_sums(special)[:, 0]
    assert sums[0] == math.inf and sums[1].isnan(), sums
    torch.testing.assert_close(sums[2], torch.tensor((width - 1) * math.log(2.0), dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_softplus_sums_pair_no_product_past_the_dtypes_range(dtype: torch.dtype) -> None:
    """Margins of 0 make every factor 2, the largest: the paired products stay finite in every dtype."""
    from contrastive_dist.losses._sigmoid import softplus_sums

    sums = softplus_sums(torch.zeros(2, 4096, dtype=dtype))[:, 0]
    torch.testing.assert_close(sums.double(), torch.full((2,), 4096 * math.log(2.0), dtype=torch.float64),
                               rtol=4 * torch.finfo(dtype).eps, atol=0)  # fmt: skip
