"""Single-process checks of the losses: float64 loop references, analytic values, chunking, validation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from loss_references import (
    GRAM_KINDS,
    ID_KINDS,
    KINDS,
    REGISTRY,
    assert_close,
    clip_rows,
    encode,
    make_problem,
    ntxent_rows,
    objective,
    package_value,
    reference_value,
    siglip_rows,
    supcon_rows,
    value_and_grads,
)
from torch import Tensor

from contrastive_dist import (
    DistributedInfoNCE,
    NTXentLoss,
    SharedNegatives,
    SigLIPLoss,
    SupConLoss,
    info_nce,
    nt_xent,
    retrieval_accuracy,
    siglip,
    supcon,
)
from contrastive_dist.losses import _epilogue, _same_key, _tiles, _visit
from contrastive_dist.losses._options import PRODUCTS_VARIABLE, half_products
from contrastive_dist.losses._unit import unit_rows

COMMUNICATIONS = ("gather", "ring")


@pytest.mark.parametrize("communication", COMMUNICATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("total", [1, 2, 7])
def test_matches_loop_reference(total: int, dtype: torch.dtype, communication: str) -> None:
    for kind in KINDS:
        params, data = make_problem(seed=total, total=total, dtype=dtype)
        params64 = {name: p.detach().double().requires_grad_() for name, p in params.items()}
        data64 = {name: t.double() if t.is_floating_point() else t for name, t in data.items()}
        expected, expected_grads = value_and_grads(reference_value(kind, "mean", params64, data64), params64)
        for chunk_size in (None, 1, 3, 100):
            loss = package_value(kind, "mean", params, data, chunk_size=chunk_size, communication=communication)
            loss, grads = value_and_grads(loss, params)
            what = f"{kind} total={total} chunk={chunk_size}"
            assert_close(loss.double(), expected, dtype, what)
            for name in grads:
                assert_close(grads[name].double(), expected_grads[name], dtype, f"{what} d/d{name}")


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_float32_features_under_a_float64_default_dtype(communication: str) -> None:
    # Lightning's "64-true" sets the default dtype to float64; features that arrive in float32 keep their dtype
    params, data = make_problem(seed=3, total=7, dtype=torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for kind in KINDS:
            for reduction in ("mean", "none"):
                loss = package_value(kind, reduction, params, data, communication=communication)
                loss, grads = value_and_grads(loss.sum(), params)
                assert loss.dtype == torch.float32, (kind, reduction, loss.dtype)
                assert all(grad.dtype == torch.float32 for grad in grads.values()), (kind, reduction)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_chunked_equals_unchunked_float32(communication: str) -> None:
    generator = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(37, 16, generator=generator), dim=-1).requires_grad_()
    texts = F.normalize(torch.randn(37, 16, generator=generator), dim=-1).requires_grad_()
    labels = torch.randint(0, 5, (37,), generator=generator)
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    bias = torch.tensor(-3.0, requires_grad=True)
    mode = {"communication": communication}
    losses = {
        "clip": lambda chunk: info_nce(images, texts, scale, chunk_size=chunk, **mode),
        "ntxent": lambda chunk: nt_xent(images, texts, chunk_size=chunk, **mode),
        "siglip": lambda chunk: siglip(images, texts, scale, bias, chunk_size=chunk, **mode),
        "supcon": lambda chunk: supcon(torch.stack([images, texts], 1), labels, chunk_size=chunk, **mode),
    }
    leaves = [images, texts, scale, bias]
    for kind, loss_fn in losses.items():
        expected = loss_fn(None)
        expected_grads = torch.autograd.grad(expected, leaves, allow_unused=True)
        for chunk in (1, 5, 16, 37, 64):
            loss = loss_fn(chunk)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0, msg=f"{kind} chunk={chunk}")
            for grad, expected_grad in zip(grads, expected_grads, strict=True):
                if expected_grad is not None:
                    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6, msg=f"{kind} chunk={chunk}")


def test_analytic_minimum_for_aligned_features() -> None:
    count, scale, bias = 5, 4.0, -2.0
    basis = torch.eye(count, dtype=torch.float64)
    # Orthonormal, perfectly paired: matching logit = scale, every other logit = 0.
    clip_expected = math.log(1 + (count - 1) * math.exp(-scale))
    assert info_nce(basis, basis, scale).item() == pytest.approx(clip_expected, rel=1e-12)
    assert info_nce(basis, basis, scale, chunk_size=2).item() == pytest.approx(clip_expected, rel=1e-12)
    assert info_nce(basis, basis, 100.0).item() < 1e-40
    siglip_expected = math.log1p(math.exp(-(scale + bias))) + (count - 1) * math.log1p(math.exp(bias))
    assert siglip(basis, basis, scale, bias).item() == pytest.approx(siglip_expected, rel=1e-12)
    assert siglip(basis, basis, scale, bias, chunk_size=3).item() == pytest.approx(siglip_expected, rel=1e-12)
    temperature = 0.5
    # NT-Xent: the positive has similarity 1, the other 2N − 2 candidates 0.
    ntxent_expected = math.log(math.exp(1 / temperature) + 2 * count - 2) - 1 / temperature
    assert nt_xent(basis, basis, temperature=temperature).item() == pytest.approx(ntxent_expected, rel=1e-12)
    # SupCon, two classes of aligned pairs: same-class similarity 1 (the positive), others 0.
    features = torch.eye(2, dtype=torch.float64).repeat_interleave(2, 0)
    supcon_expected = math.log(math.exp(1 / temperature) + 2) - 1 / temperature
    assert supcon(features, torch.tensor([0, 0, 1, 1]), temperature=temperature).item() == pytest.approx(
        supcon_expected, rel=1e-12
    )


def test_supcon_without_positives_is_zero_not_nan() -> None:
    features = F.normalize(torch.randn(4, 8, dtype=torch.float64), dim=-1).requires_grad_()
    for chunk_size in (None, 3):
        loss = supcon(features, torch.arange(4), chunk_size=chunk_size)
        (grad,) = torch.autograd.grad(loss, features)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_empty_batch_gives_connected_zero() -> None:
    empty = torch.zeros(0, 8, requires_grad=True)
    for loss in (
        info_nce(empty, empty),
        info_nce(empty, empty, chunk_size=4),
        nt_xent(empty, empty, chunk_size=4),
        siglip(empty, empty, 10.0, -10.0, chunk_size=4),
        supcon(empty, torch.zeros(0, dtype=torch.long)),
    ):
        (grad,) = torch.autograd.grad(loss, empty)
        assert loss.item() == 0.0 and grad.shape == (0, 8)


def test_modules_match_functional_forms() -> None:
    generator = torch.Generator().manual_seed(3)
    images, texts = torch.randn(6, 4, generator=generator), torch.randn(6, 4, generator=generator)
    labels = torch.tensor([0, 1, 0, 1, 2, 2])
    assert torch.equal(DistributedInfoNCE(temperature=0.1)(images, texts), info_nce(images, texts, temperature=0.1))
    one_way = DistributedInfoNCE(symmetric=False, chunk_size=4)(images, texts, 3.0)
    assert torch.allclose(one_way, info_nce(images, texts, 3.0, symmetric=False))
    assert torch.equal(NTXentLoss(temperature=0.2)(images, texts), nt_xent(images, texts, temperature=0.2))
    assert torch.equal(SigLIPLoss()(images, texts, 2.0, -1.0), siglip(images, texts, 2.0, -1.0))
    assert torch.equal(SupConLoss(temperature=0.2)(images, labels), supcon(images, labels, temperature=0.2))
    assert torch.equal(info_nce(images, texts, sizes=(6,)), info_nce(images, texts))
    assert "chunk_size=4" in repr(DistributedInfoNCE(chunk_size=4))


def test_retrieval_accuracy_matches_topk() -> None:
    generator = torch.Generator().manual_seed(1)
    images, texts = torch.randn(30, 8, generator=generator), torch.randn(30, 8, generator=generator)
    texts[:10] = images[:10]  # some pairs retrievable
    accuracy = retrieval_accuracy(images, texts, top_k=(1, 5))
    scores = images @ texts.T
    for k in (1, 5):
        image_hits = (scores.topk(k, dim=1).indices == torch.arange(30)[:, None]).any(1).double().mean()
        text_hits = (scores.T.topk(k, dim=1).indices == torch.arange(30)[:, None]).any(1).double().mean()
        assert accuracy[f"image_to_text_r{k}"].item() == pytest.approx(image_hits.item())
        assert accuracy[f"text_to_image_r{k}"].item() == pytest.approx(text_hits.item())
    assert set(accuracy) == {"image_to_text_r1", "image_to_text_r5", "text_to_image_r1", "text_to_image_r5"}


def test_invalid_arguments_raise_clear_errors() -> None:
    good = torch.randn(4, 8)
    cases = [
        (ValueError, "temperature must be > 0", lambda: DistributedInfoNCE(temperature=0.0)),
        (ValueError, "temperature must be > 0", lambda: NTXentLoss(temperature=-1)),
        (ValueError, "temperature must be > 0", lambda: info_nce(good, good, temperature=-0.5)),
        (TypeError, "temperature must be a real number", lambda: SupConLoss(temperature="0.1")),  # type: ignore[arg-type]
        (ValueError, "chunk_size must be None or a positive int, got 0", lambda: SigLIPLoss(chunk_size=0)),
        (ValueError, r"same shape \(batch, dim\), got \(4, 8\) and \(3, 8\)", lambda: info_nce(good, good[:3])),
        (ValueError, r"same shape \(batch, dim\), got \(4, 8\) and \(4, 5\)", lambda: nt_xent(good, good[:, :5])),
        (ValueError, r"must be 2-d \(batch first\), got shape \(8,\)", lambda: siglip(good[0], good[0], 1.0, 0.0)),
        (ValueError, r"must be 2-d or 3-d \(batch first\), got shape \(8,\)", lambda: supcon(good[0], good[0])),
        (ValueError, r"labels must have shape \(4,\)", lambda: supcon(good, torch.zeros(3, dtype=torch.long))),
        (TypeError, "labels must be an integer tensor", lambda: supcon(good, torch.zeros(4))),
        (ValueError, "logit_scale must be a scalar", lambda: info_nce(good, good, torch.ones(2))),
        (ValueError, "logit_scale must be > 0", lambda: info_nce(good, good, -1.0)),
        (ValueError, "logit_scale must be > 0", lambda: siglip(good, good, 0.0, 1.0)),
        (ValueError, "logit_scale must be > 0", lambda: nt_xent(good, good, -2.0)),
        (ValueError, "logit_scale must be a scalar", lambda: supcon(good, torch.zeros(4).long(), torch.ones(3))),
        (TypeError, "logit_bias must be a floating-point tensor", lambda: siglip(good, good, 1.0, torch.tensor(1))),
        (TypeError, "must share a dtype", lambda: info_nce(good, good.double())),
        (TypeError, "symmetric must be a bool", lambda: DistributedInfoNCE(symmetric="yes")),  # type: ignore[arg-type]
        (ValueError, "top_k must hold positive ints", lambda: retrieval_accuracy(good, good, top_k=(0,))),
        (ValueError, r"sizes=\(3,\)", lambda: info_nce(good, good, sizes=(3,))),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


FEATURE_KINDS = ("clip", "clip_one_way", "ntxent", "siglip", "supcon")
Inputs = list[Tensor]


def _loss_on_features(
    kind: str, leaves: Inputs, labels: Tensor, chunk_size: int | None, reference: bool, communication: str = "gather"
) -> Tensor:
    """A loss of leaf ``(images, texts, scale, bias)``: the package's, or the float64 loop reference."""
    images, texts, scale, bias = leaves
    views = torch.stack([images, texts], dim=1)
    if reference:
        rows, counted = supcon_rows(views, labels, scale)
        references: dict[str, Callable[[], Tensor]] = {
            "clip": lambda: clip_rows(images, texts, scale, None, True).mean(),
            "clip_one_way": lambda: clip_rows(images, texts, scale, None, False).mean(),
            "ntxent": lambda: ntxent_rows(images, texts, scale).mean(),
            "siglip": lambda: siglip_rows(images, texts, scale, bias).mean(),
            "supcon": lambda: (rows * counted).sum() / counted.sum(),
        }
        return references[kind]()
    options = {"chunk_size": chunk_size, "communication": communication}
    losses: dict[str, Callable[[], Tensor]] = {
        "clip": lambda: info_nce(images, texts, scale, **options),
        "clip_one_way": lambda: info_nce(images, texts, scale, symmetric=False, **options),
        "ntxent": lambda: nt_xent(images, texts, scale, **options),
        "siglip": lambda: siglip(images, texts, scale, bias, **options),
        "supcon": lambda: supcon(views, labels, scale, **options),
    }
    return losses[kind]()


@pytest.mark.parametrize("products", ["auto", "half"])
@pytest.mark.parametrize("communication", COMMUNICATIONS)
@pytest.mark.parametrize("precision", ["bfloat16", "float16", "float32_autocast_bf16"])
def test_half_precision_and_autocast_match_float64_reference(
    precision: str, communication: str, products: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # products="half": the route of bf16/fp16 features on CUDA (half operands, float32 results, the
    # logit gradient rounded to the features' dtype), taken on CPU by the documented switch.
    monkeypatch.setenv(PRODUCTS_VARIABLE, products)
    # The core runs in float32 with autocast off: the loss is as exact as in float32, and only
    # the gradients handed back to half-precision inputs are rounded to their dtype.
    dtype = getattr(torch, precision.split("_")[0])
    autocast = precision.endswith("autocast_bf16")
    grad_rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-9, torch.float32: 1e-5}[dtype]
    generator = torch.Generator().manual_seed(7)

    def draw(*shape: int) -> Tensor:  # values exactly representable in ``dtype``
        return F.normalize(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1).to(dtype).double()

    inputs = [
        draw(24, 16),
        draw(24, 16),
        torch.tensor(5.0, dtype=torch.float64),
        torch.tensor(-1.5, dtype=torch.float64),
    ]
    labels = torch.randint(0, 4, (24,), generator=generator)
    for kind in FEATURE_KINDS:
        leaves64 = [tensor.clone().requires_grad_() for tensor in inputs]
        expected = _loss_on_features(kind, leaves64, labels, None, reference=True)
        expected_grads = torch.autograd.grad(expected, leaves64, allow_unused=True)
        for chunk_size in (None, 5):
            leaves = [tensor.to(dtype).requires_grad_() for tensor in inputs]
            context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with context:
                loss = _loss_on_features(kind, leaves, labels, chunk_size, reference=False, communication=communication)
                # A backward run inside autocast too (as some training loops do) recomputes in float32.
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            what = f"{kind} {precision} chunk={chunk_size}"
            assert loss.dtype == torch.float32, what
            # NT-Xent normalises its features: on the half route its unit vectors enter the products
            # rounded to the features' dtype: its loss is exact to that rounding (bf16: 7e-5 measured here).
            rounded = kind == "ntxent" and half_products(dtype, leaves[0].device)
            rtol = torch.finfo(dtype).eps / 8 if rounded else 1e-5
            torch.testing.assert_close(loss.double(), expected, rtol=rtol, atol=1e-6, msg=what)
            for name, grad, expected_grad in zip("images texts scale bias".split(), grads, expected_grads, strict=True):
                if expected_grad is None:
                    assert grad is None or not grad.any(), f"{what} d/d{name}"
                    continue
                assert grad is not None and grad.dtype == dtype, f"{what} d/d{name}"
                atol = grad_rtol * expected_grad.abs().max().item()
                torch.testing.assert_close(
                    grad.double(), expected_grad, rtol=grad_rtol, atol=atol, msg=f"{what} d/d{name}"
                )


@pytest.mark.parametrize(("products", "expected"), [("auto", torch.float32), ("half", torch.bfloat16)])
def test_ntxent_unit_vectors_enter_the_products_in_the_features_dtype_on_the_half_route(
    products: str, expected: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Normalised in float32, then (half route: CUDA's, forced here) rounded back to bf16 for the tensor cores."""
    from contrastive_dist.losses import _frame

    monkeypatch.setenv(PRODUCTS_VARIABLE, products)
    weighted_sum, seen = _frame.Call.weighted_sum, []

    def recording(self, family, queries, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(queries)
        return weighted_sum(self, family, queries, *args, **kwargs)

    monkeypatch.setattr(_frame.Call, "weighted_sum", recording)
    first, second = (torch.randn(6, 8, dtype=torch.bfloat16) for _ in range(2))
    nt_xent(first, second)
    unit = F.normalize(torch.stack((first, second), 1).float(), dim=-1).flatten(0, 1)
    assert len(seen) == 1 and seen[0].dtype == expected
    torch.testing.assert_close(seen[0], unit.to(expected), rtol=0, atol=0)


def test_half_precision_large_batches_stay_finite_and_exact() -> None:
    generator = torch.Generator().manual_seed(2)
    images = F.normalize(torch.randn(4096, 8, generator=generator), dim=-1).half().requires_grad_()
    texts = F.normalize(torch.randn(4096, 8, generator=generator), dim=-1).half()
    # Float64 of the same (half-rounded) values; its sum of 4096 row terms × 50 would overflow fp16.
    expected = info_nce(images.double(), texts.double(), 50.0, symmetric=False, chunk_size=1024)
    for chunk_size in (None, 512):
        loss = info_nce(images, texts, 50.0, symmetric=False, chunk_size=chunk_size)
        (grad,) = torch.autograd.grad(loss, images)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    # SupCon's 1/A with A = 301 anchors: 301 is not a bfloat16 number (it rounds to 300).
    features = F.normalize(torch.randn(301, 8, generator=generator), dim=-1).bfloat16()
    labels = torch.arange(301) % 3
    expected = supcon(features.double(), labels, chunk_size=64)
    for chunk_size in (None, 64):
        torch.testing.assert_close(
            supcon(features, labels, chunk_size=chunk_size).double(), expected, rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_float16_gradients_do_not_underflow_when_weights_are_folded_in(
    monkeypatch: pytest.MonkeyPatch, communication: str
) -> None:
    # The half route (CUDA's rounding on CPU), per-row upstream gradients ≈ 1/2N folded into the logit
    # gradient of the recomputed path: unscaled, its entries (≈ 1/(2N·N)) fall below float16's range.
    monkeypatch.setenv(PRODUCTS_VARIABLE, "half")
    generator = torch.Generator().manual_seed(5)
    images, texts = (F.normalize(torch.randn(4096, 8, generator=generator), dim=-1).half() for _ in range(2))

    def gradients(dtype: torch.dtype) -> list[Tensor]:
        inputs = [images.to(dtype).clone().requires_grad_(), texts.to(dtype).clone().requires_grad_()]
        losses = info_nce(*inputs, chunk_size=256, communication=communication, reduction="none")
        return [grad.double() for grad in torch.autograd.grad(losses.mean(), inputs)]

    for grad, expected in zip(gradients(torch.float16), gradients(torch.float64), strict=True):
        # float16's own rounding of the logit gradient (2⁻¹¹ relative), summed over 4096 columns.
        assert float((grad - expected).abs().max() / expected.abs().max()) < 2e-3


def test_double_backward_raises_instead_of_being_wrong() -> None:
    images = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    texts = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    losses = {
        "info_nce": lambda: info_nce(images, texts),
        "info_nce chunked": lambda: info_nce(images, texts, chunk_size=2),
        "nt_xent": lambda: nt_xent(images, texts, chunk_size=2),
        "supcon": lambda: supcon(images, torch.tensor([0, 0, 1, 1, 1]), chunk_size=2),
        "siglip": lambda: siglip(images, texts, 2.0, -1.0),
        "siglip ring": lambda: siglip(images, texts, 2.0, -1.0, communication="ring"),
    }
    for name, loss_fn in losses.items():
        # The kernels form their gradients block by block: a second derivative through them
        # would silently miss terms, so asking for one must fail loudly.
        with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\)"):
            torch.autograd.grad(loss_fn(), images, create_graph=True)
        (grad,) = torch.autograd.grad(loss_fn(), images)  # first order still works
        assert grad.shape == images.shape, name


def test_gradients_when_only_some_inputs_require_them() -> None:
    generator = torch.Generator().manual_seed(4)
    inputs = [torch.randn(7, 5, generator=generator, dtype=torch.float64) for _ in range(2)]
    inputs += [torch.tensor(3.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)]
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 0])
    for kind in FEATURE_KINDS:
        for chunk_size in (None, 3):
            full = [tensor.clone().requires_grad_() for tensor in inputs]
            expected = _loss_on_features(kind, full, labels, chunk_size, reference=False)
            expected_grads = torch.autograd.grad(expected, full, allow_unused=True)
            for wanted in ((0,), (1,), (2,), (3,), (0, 2), (1, 3)):
                leaves = [tensor.clone().requires_grad_(index in wanted) for index, tensor in enumerate(inputs)]
                loss = _loss_on_features(kind, leaves, labels, chunk_size, reference=False)
                assert torch.equal(loss.detach(), expected.detach())
                tracked = [leaves[index] for index in wanted]
                if not loss.requires_grad:  # e.g. the bias of a loss without one
                    continue
                grads = torch.autograd.grad(loss, tracked, allow_unused=True)
                for index, grad in zip(wanted, grads, strict=True):
                    expected_grad = expected_grads[index]
                    if expected_grad is None:
                        assert grad is None
                    else:
                        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_weights_are_scale_free_and_all_ones_give_the_unweighted_loss(communication: str) -> None:
    params, data = make_problem(0, 6, torch.float64)
    images, texts = encode(params, data)
    ones, mode = torch.ones(6, dtype=torch.float64), {"communication": communication}
    pairs = [
        (info_nce(images, texts, **mode), info_nce(images, texts, weight=ones, **mode)),
        (nt_xent(images, texts, **mode), nt_xent(images, texts, weight=ones, **mode)),
        (siglip(images, texts, 3.0, -1.0, **mode), siglip(images, texts, 3.0, -1.0, weight=ones, chunk_size=4, **mode)),
        (supcon(images, data["labels"], **mode), supcon(images, data["labels"], weight=ones, **mode)),
    ]
    for plain, weighted in pairs:
        assert_close(weighted, plain, torch.float64, "weight=1")
    leaf = images.detach().requires_grad_()
    five_times = info_nce(leaf, texts, weight=5 * data["weight"], **mode)
    assert_close(five_times, info_nce(leaf, texts, weight=data["weight"], **mode), torch.float64, "5w")
    zero = info_nce(leaf, texts, weight=torch.zeros(6, dtype=torch.float64), **mode)
    (grad,) = torch.autograd.grad(zero, leaf)
    assert zero.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_half_precision_features_with_float32_queue_or_own_negatives(communication: str) -> None:
    # bf16 features with a float32/float64 queue or bf16 own negatives: the columns meet in float32.
    generator = torch.Generator().manual_seed(5)
    images, texts, own = (F.normalize(torch.randn(n, 8, generator=generator), dim=-1).bfloat16() for n in (6, 6, 4))
    scale = torch.tensor(5.0, dtype=torch.float64)
    for queue_dtype in (torch.float32, torch.float64):
        queue = F.normalize(torch.randn(5, 8, generator=generator), dim=-1).to(queue_dtype)
        for negatives, columns in ((SharedNegatives(queue), queue), (own.requires_grad_(), own)):
            expected = clip_rows(images.double(), texts.double(), scale, columns.detach().double(), True).mean()
            for chunk_size in (None, 4):
                options = {"chunk_size": chunk_size, "communication": communication}
                loss = info_nce(images, texts, 5.0, negatives=negatives, **options)  # type: ignore[arg-type]
                assert loss.dtype == torch.float32
                torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_modules_hold_the_communication_mode_and_reject_unknown_ones() -> None:
    generator = torch.Generator().manual_seed(0)
    images, texts = torch.randn(5, 8, generator=generator), torch.randn(5, 8, generator=generator)
    labels, scale, bias = torch.tensor([0, 1, 0, 1, 2]), torch.tensor(5.0), torch.tensor(-2.0)
    pairs = [
        (DistributedInfoNCE(communication="ring", chunk_size=2)(images, texts, scale), info_nce(images, texts, scale)),
        (NTXentLoss(communication="ring")(images, texts), nt_xent(images, texts)),
        (SigLIPLoss(communication="ring")(images, texts, scale, bias), siglip(images, texts, scale, bias)),
        (SupConLoss(communication="ring")(images, labels), supcon(images, labels)),
    ]
    for ring_value, gather_value in pairs:
        torch.testing.assert_close(ring_value, gather_value)
    assert "communication='ring'" in repr(SigLIPLoss(communication="ring"))
    for module in (DistributedInfoNCE, NTXentLoss, SigLIPLoss, SupConLoss):
        with pytest.raises(ValueError, match=r"communication must be one of \('gather', 'ring'\), got 'all'"):
            module(communication="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="communication must be one of"):
        siglip(images, texts, scale, bias, communication="Ring")  # type: ignore[arg-type]


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_distinct_ids_give_the_loss_without_ids(communication: str) -> None:
    # No two rows share an id: masking removes nothing (bitwise the same loss), and every row's only
    # positive is its own pair (the same loss to rounding: another arrangement of the same sums).
    params, data = make_problem(2, 7, torch.float64)
    data["ids"] = torch.randperm(7, generator=torch.Generator().manual_seed(0)) * 1000
    for kind in ID_KINDS:
        for mode in ("weighted", "none"):
            options = {"chunk_size": 3, "communication": communication}
            plain = package_value(kind, mode, params, data, **options)  # type: ignore[arg-type]
            masked = package_value(kind, mode, params, data, same_id="mask", **options)  # type: ignore[arg-type]
            positive = package_value(kind, mode, params, data, same_id="positive", **options)  # type: ignore[arg-type]
            assert torch.equal(masked, plain), (kind, mode)
            assert_close(positive, plain, torch.float64, f"{kind} {mode} positive")
    assert "same_id='positive'" in repr(SigLIPLoss(same_id="positive"))
    with pytest.raises(ValueError, match=r"same_id must be one of \('mask', 'positive'\), got 'pull'"):
        DistributedInfoNCE(same_id="pull")  # type: ignore[arg-type]


@pytest.mark.parametrize("communication", COMMUNICATIONS)
@pytest.mark.parametrize("form", ["sparse", "dense"])
def test_keys_as_pairs_or_as_a_mask_match_the_loop_reference(
    form: str, communication: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pairs that share a key (labels, ids) are kept as indices on the CPU when few, as a mask when many:
    # each form alone, for every loss with keys, against the float64 loops.
    monkeypatch.setattr(_same_key, "SPARSE_AT_MOST", 1.0 if form == "sparse" else -1.0)
    cases = [(kind, rule) for kind in ID_KINDS for rule in ("mask", "positive")]
    cases += [(kind, "") for kind in GRAM_KINDS if not REGISTRY[kind].same_id]  # their keys: labels, sample indices
    for kind, same_id in cases:
        params, data = make_problem(seed=5, total=11, dtype=torch.float64)
        for mode in ("weighted", "none"):
            upstream = data["upstream"]
            expected, expected_grads = value_and_grads(
                objective(reference_value(kind, mode, params, data, same_id=same_id), mode, upstream), params
            )
            for chunk_size in (None, 4):
                loss = package_value(kind, mode, params, data, chunk_size=chunk_size, communication=communication,
                                     same_id=same_id)  # fmt: skip
                loss, grads = value_and_grads(objective(loss, mode, upstream), params)
                what = f"{kind} {same_id} {mode} chunk={chunk_size}"
                assert_close(loss, expected, torch.float64, what)
                for name in grads:
                    assert_close(grads[name], expected_grads[name], torch.float64, f"{what} d/d{name}")


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_gram_losses_take_their_tiles_and_equal_the_rows_against_columns_kernel(
    chunk_size: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NT-Xent, SupCon and DCL form each pair of tiles of their symmetric matrix once (losses/_tiles.py):
    # the same value and gradients as rows against columns, which they are tested against here.
    monkeypatch.setattr(_tiles, "MIN_DIM", 0)  # the tiles whatever the width (by default from D = 512)
    calls: list[int] = []
    tiled, taken = _tiles.states, _tiles.taken
    monkeypatch.setattr(_tiles, "states", lambda *args: (calls.append(1), tiled(*args))[1])
    cases = [(kind, "") for kind in GRAM_KINDS]
    cases += [("ntxent", "mask"), ("ntxent", "positive")]
    for kind, same_id in cases:
        params, data = make_problem(seed=6, total=9, dtype=torch.float64)
        results = []
        for gram in (True, False):
            monkeypatch.setattr(_tiles, "taken", taken if gram else lambda problem, *_: problem._replace(tiles=None))
            before = len(calls)
            loss = package_value(kind, "weighted", params, data, chunk_size=chunk_size, same_id=same_id)
            results.append(value_and_grads(loss, params))
            assert (len(calls) > before) == gram, kind
        (value, grads), (expected, expected_grads) = results
        assert_close(value, expected, torch.float64, kind)
        for name in grads:
            assert_close(grads[name], expected_grads[name], torch.float64, f"{kind} {same_id} d/d{name}")


def test_unit_rows_equal_f_normalize_in_value_and_gradient_zero_rows_included() -> None:
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(6, 2, 5, generator=generator, dtype=torch.float64)
    rows[1, 0] = 0.0  # clamped: the gradient is the upstream over eps
    rows[2, 1] *= 1e-13
    upstream = torch.randn(rows.shape, generator=generator, dtype=torch.float64)
    values, grads = [], []
    for normalize in (unit_rows, lambda x: F.normalize(x, dim=-1)):
        leaf = rows.clone().requires_grad_()
        value = normalize(leaf)
        (value * upstream).sum().backward()
        values.append(value)
        grads.append(leaf.grad)
    assert torch.equal(values[0], values[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=0)


def test_the_products_policy_keeps_half_features_on_cuda_and_upcasts_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # (bf16 on CPU, fp16 on CUDA, fp32 on CUDA): half operands or not, per choice.
    expected = {"auto": (False, True, False), "half": (True, True, False), "full": (False, False, False)}
    for choice, decisions in expected.items():
        monkeypatch.setenv(PRODUCTS_VARIABLE, choice)
        cases = ((torch.bfloat16, cpu), (torch.float16, cuda), (torch.float32, cuda))
        assert tuple(half_products(dtype, device) for dtype, device in cases) == decisions, choice
    monkeypatch.setenv(PRODUCTS_VARIABLE, "tf32")
    with pytest.raises(ValueError, match=r"CONTRASTIVE_DIST_PRODUCTS must be one of \('auto', 'full', 'half'\)"):
        half_products(torch.bfloat16, cpu)
    # Which operands the kernel's products get: half features stay half on the half route only.
    seen: list[torch.dtype] = []
    real_product = _visit.product

    def spy(first: Tensor, second: Tensor) -> Tensor:
        seen.append(first.dtype)
        return real_product(first, second)

    monkeypatch.setattr(_visit, "product", spy)
    monkeypatch.setattr(_epilogue, "product", spy)  # (the eager epilogue's own name for it)
    images = F.normalize(torch.randn(6, 8), dim=-1).bfloat16().requires_grad_()
    for choice in ("auto", "half"):
        monkeypatch.setenv(PRODUCTS_VARIABLE, choice)
        seen.clear()
        for communication in COMMUNICATIONS:
            info_nce(images, images.detach(), chunk_size=4, communication=communication).backward()  # type: ignore[arg-type]
        assert set(seen) == ({torch.bfloat16} if choice == "half" else set()), (choice, seen)
