"""Float32 precision of the softmax kernel: no negative losses, exact zeros, symmetry, large features."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_losses_reference import clip_reference, ntxent_reference, supcon_reference

from contrastive_dist import info_nce, nt_xent, siglip, supcon


def _unit(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1).to(dtype)


def test_one_sample_batch_is_exactly_zero_for_every_softmax_loss() -> None:
    # One sample: its positive is its only candidate, so the loss is exactly 0 (was 9.5e-7 in float32).
    for seed in range(20):
        image, text = _unit(1, 16, seed=seed), _unit(1, 16, seed=seed + 100)
        two_views = torch.stack([image, text], dim=1)
        for chunk_size in (None, 1):
            for loss in (
                info_nce(image, text, 1 / 0.07, chunk_size=chunk_size),
                info_nce(image, text, 1 / 0.07, symmetric=False, chunk_size=chunk_size),
                info_nce(image, text, reduction="none", chunk_size=chunk_size),
                nt_xent(image * 3, text, temperature=0.05, chunk_size=chunk_size),
                nt_xent(image, text, reduction="none", chunk_size=chunk_size),
                supcon(two_views, torch.tensor([4]), temperature=0.05, chunk_size=chunk_size),
                supcon(two_views, torch.tensor([4]), reduction="none", chunk_size=chunk_size),
            ):
                assert torch.equal(loss, torch.zeros_like(loss)), (seed, chunk_size, loss)
    # SigLIP has no such zero: a single pair still pays softplus(−logit); it is finite and positive.
    assert siglip(image, text, 10.0, -10.0).item() > 0


def test_small_clip_loss_keeps_float32_precision() -> None:
    # The case from lightly's tests: 2 × 16 at temperature 0.05 was −1.9e-6 in float32 (float64: +1.3e-10).
    images = _unit(2, 16, seed=2)
    images64 = images.double()
    texts = F.normalize(images64 + 1e-3 * _unit(2, 16, seed=3, dtype=torch.float64), dim=-1)
    for symmetric in (True, False):
        expected = clip_reference(images64, texts, torch.tensor(20.0, dtype=torch.float64), symmetric=symmetric)
        actual = info_nce(images, texts.float(), temperature=0.05, symmetric=symmetric)
        assert actual.item() >= 0
        # Relative precision of the float32 inputs' own rounding (the logits move by ~1e-7 · 20).
        assert abs(actual.item() - expected.item()) <= 1e-6 * max(expected.item(), 1e-30) + 1e-12


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
    for chunk_size in (None, 2):
        values = [
            info_nce(images, texts, temperature=temperature, chunk_size=chunk_size),
            info_nce(images, texts, temperature=temperature, symmetric=False, chunk_size=chunk_size),
            info_nce(images, texts, temperature=temperature, chunk_size=chunk_size, reduction="none"),
            nt_xent(images, texts, temperature=temperature, chunk_size=chunk_size),
            nt_xent(images, texts, temperature=temperature, chunk_size=chunk_size, reduction="none"),
            supcon(torch.stack([images, texts], 1), labels, temperature=temperature, chunk_size=chunk_size),
            supcon(images, labels, temperature=temperature, chunk_size=chunk_size, reduction="none"),
        ]
        for value in values:
            assert bool((value >= 0).all()), (chunk_size, value)


def test_symmetric_losses_do_not_depend_on_argument_order() -> None:
    for seed in range(5):
        a, b = _unit(7, 12, seed=seed), _unit(7, 12, seed=seed + 50)
        for chunk_size in (None, 3):
            # CLIP's two directions are the same computations swapped: bitwise equal.
            assert torch.equal(info_nce(a, b, chunk_size=chunk_size), info_nce(b, a, chunk_size=chunk_size))
            # NT-Xent visits the same logits in another column order: equal to float32 rounding.
            torch.testing.assert_close(
                nt_xent(a, b, chunk_size=chunk_size), nt_xent(b, a, chunk_size=chunk_size), rtol=1e-6, atol=0
            )
            a64, b64 = a.double(), b.double()
            torch.testing.assert_close(nt_xent(a64, b64), nt_xent(b64, a64), rtol=1e-14, atol=0)


def test_supcon_on_large_unnormalised_features_matches_float64() -> None:
    # A row of norm 1e8 among unit rows: its class sum minus itself lost its positives entirely.
    generator = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2, 1])
    for norm in (1e4, 1e8):
        for views in (1, 2):
            shape = (8, 6) if views == 1 else (8, 2, 6)
            features = F.normalize(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1)
            features[0] *= norm
            features32 = features.float()
            expected = supcon_reference(features32.double(), labels, 1 / 0.5)
            for chunk_size in (None, 3):
                actual = supcon(features32, labels, temperature=0.5, chunk_size=chunk_size)
                relative = abs(actual.item() - expected.item()) / expected.item()
                assert relative <= 1e-4, (norm, views, chunk_size, relative)


def test_every_softmax_loss_matches_float64_on_large_features() -> None:
    generator = torch.Generator().manual_seed(1)
    a = (torch.randn(6, 5, generator=generator, dtype=torch.float64) * 1e4).float()
    b = (torch.randn(6, 5, generator=generator, dtype=torch.float64) * 1e4).float()
    expected = clip_reference(a.double(), b.double(), torch.tensor(1e-6, dtype=torch.float64))
    torch.testing.assert_close(info_nce(a, b, 1e-6).double(), expected, rtol=1e-5, atol=0)
    expected = ntxent_reference(a.double(), b.double(), 2.0)
    torch.testing.assert_close(nt_xent(a, b, temperature=0.5).double(), expected, rtol=1e-5, atol=0)


def test_losses_without_gradients_equal_the_losses_with_them() -> None:
    # Under no_grad the kernel skips the gradient products; the values must not change.
    images, texts = _unit(9, 6, seed=7).requires_grad_(), _unit(9, 6, seed=8)
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 0, 1, 3])
    for chunk_size in (None, 4):
        calls = (
            functools.partial(info_nce, images, texts, chunk_size=chunk_size),
            functools.partial(info_nce, images, texts, chunk_size=chunk_size, reduction="none"),
            functools.partial(nt_xent, images, texts, chunk_size=chunk_size),
            functools.partial(supcon, images, labels, chunk_size=chunk_size),
        )
        for call in calls:
            with_grad = call()
            with torch.no_grad():
                assert torch.equal(call(), with_grad.detach())
