"""Several texts per image (``image_ids=``, ``text_ids=``): InfoNCE and SigLIP+ against float64 loops.

The references are written from the definitions (the issue's InfoNCE with positives from global ids;
siglip-kernel 0.1.2's SigLIP+, ``fused_siglip_plus.py``: ``(1/(N·M)) Σ v·(softplus(s) − s·y)`` with
``v = α/k_i + β/k'_j`` on positives and 1 elsewhere, or soft labels ``y = P·(α/k_i + β/k'_j)``), on the
global batch, with loops where that is plainer; SigLIP+'s weights and per-row losses by its two
directions (each anchor's ``1/k`` over its positives, every negative 1), whose sum over ``N`` is the
matrix's. One process and 3 gloo ranks whose image and text counts differ from each other and between
ranks (one rank has no images, another no texts), in both modes, chunked and whole, with weights and
``reduction="none"``: values and gradients within 1e-10.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist import DistributedInfoNCE, SigLIPLoss, info_nce, siglip
from contrastive_dist.compat.siglip_kernel import DistributedSigLIPLoss, DistributedSigLIPPlusLoss, SigLIPPlusLoss

TOLERANCE = 1e-10
IMAGES, TEXTS = (4, 0, 3), (5, 6, 0)  # per rank: images and texts, every count different


def make_batch(seed: int, images: int, texts: int, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """A global batch: ids with several texts per image, images without a text, texts without an image."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": F.normalize(torch.randn(images, 6, generator=generator, dtype=torch.float64), dim=-1).to(dtype),
        "y": F.normalize(torch.randn(texts, 6, generator=generator, dtype=torch.float64), dim=-1).to(dtype),
        "image_ids": torch.randint(0, 5, (images,), generator=generator),
        "text_ids": torch.randint(0, 6, (texts,), generator=generator),
        "image_weight": torch.rand(images, generator=generator, dtype=torch.float64) + 0.5,
        "text_weight": torch.rand(texts, generator=generator, dtype=torch.float64) + 0.5,
    }


def reference_info_nce(x: Tensor, y: Tensor, scale: Tensor, batch: dict[str, Tensor], *, symmetric: bool = True,
                       weighted: bool = False, per_row: bool = False) -> Tensor:  # fmt: skip
    """``½ (mean_i ℓ_i + mean_t ℓ_t)`` over the images and texts with a positive, a loop over anchors."""
    logits = scale * x @ y.T
    same = batch["image_ids"][:, None] == batch["text_ids"][None, :]
    directions = [(logits, same, batch["image_weight"]), (logits.T, same.T, batch["text_weight"])][: 1 + symmetric]
    rows, means = [], []
    for matrix, positives, weights in directions:
        losses, used = [], []
        for anchor in range(matrix.shape[0]):
            chosen = positives[anchor].nonzero().flatten()
            log_softmax = torch.log_softmax(matrix[anchor], dim=0)
            losses.append(-log_softmax[chosen].mean() if len(chosen) else matrix.new_zeros(()))
            used.append(float(len(chosen) > 0) * (float(weights[anchor]) if weighted else 1.0))
        rows.append(torch.stack(losses) if losses else matrix.new_zeros(0))
        used_t = torch.tensor(used, dtype=matrix.dtype)
        means.append((rows[-1] * used_t).sum() / used_t.sum())
    if per_row:
        return torch.cat(rows)
    return means[0] if len(means) == 1 else 0.5 * (means[0] + means[1])


def reference_siglip_plus(x: Tensor, y: Tensor, scale: Tensor, bias: Tensor, batch: dict[str, Tensor], *,
                          symmetric: bool = True, soft_label: bool = False, weighted: bool | str = False,
                          per_row: bool = False, per_pair: bool = False) -> Tensor:  # fmt: skip
    """SigLIP+'s matrix of terms summed, over ``N`` images (``per_pair``: over ``N·M``); weighted or per
    row: by its directions (:func:`reference_siglip_plus_directions`)."""
    logits = scale * x @ y.T + bias
    positive = (batch["image_ids"][:, None] == batch["text_ids"][None, :]).to(logits.dtype)
    if weighted or per_row:
        return reference_siglip_plus_directions(logits, positive, batch, weighted=weighted, per_row=per_row)
    alpha, beta = (0.5, 0.5) if symmetric else (1.0, 0.0)
    mix = alpha / positive.sum(1).clamp_min(1)[:, None] + beta / positive.sum(0).clamp_min(1)[None, :]
    target = positive * mix if soft_label else positive
    term_weight = torch.ones_like(positive) if soft_label else torch.where(positive > 0, mix, 1.0)
    mean = (term_weight * (F.softplus(logits) - logits * target)).sum() / x.shape[0]
    return mean / y.shape[0] if per_pair else mean


def reference_siglip_plus_directions(logits: Tensor, positive: Tensor, batch: dict[str, Tensor], *,
                                     weighted: bool | str, per_row: bool) -> Tensor:  # fmt: skip
    """Image ``i``'s ``ℓ_i = Σ_t [P_it/k_i softplus(−s_it) + (1 − P_it) softplus(s_it)]``, text ``t``'s the same
    over the images with ``1/k'_t``; per row both, else ``½ (Σ w ℓ_i / Σ w + (M/N) Σ u ℓ_t / Σ u)``
    (``weighted="images"``: the texts' weights 1). A loop over anchors."""
    directions = []
    for matrix, positives in ((logits, positive), (logits.T, positive.T)):
        rows = []
        for anchor in range(matrix.shape[0]):
            k = positives[anchor].sum().clamp_min(1)
            pairs = torch.where(positives[anchor] > 0, F.softplus(-matrix[anchor]) / k, F.softplus(matrix[anchor]))
            rows.append(pairs.sum())
        directions.append(torch.stack(rows) if rows else matrix.new_zeros(0))
    if per_row:
        return torch.cat(directions)
    images, texts = logits.shape
    image_weight = batch["image_weight"] if weighted else torch.ones(images, dtype=logits.dtype)
    text_weight = batch["text_weight"] if weighted is True else torch.ones(texts, dtype=logits.dtype)
    image_mean = (directions[0] * image_weight).sum() / image_weight.sum()
    text_mean = (directions[1] * text_weight).sum() / text_weight.sum()
    return 0.5 * (image_mean + text_mean * texts / images)


def package_value(kind: str, x: Tensor, y: Tensor, scale: Tensor, bias: Tensor, batch: dict[str, Tensor],
                  options: dict) -> Tensor:  # fmt: skip
    """The package's call of ``kind`` on these rows (``batch``: this rank's ids and weights).

    ``options["compiled"]``: the call compiled whole (``fullgraph``), with every rank's counts given
    (``options["counts"]``: images and texts per rank, default :data:`IMAGES`, :data:`TEXTS`).
    """
    images, texts = options.pop("counts", (IMAGES, TEXTS))
    if options.pop("compiled", False):
        import torch._dynamo

        options |= {"sizes": images, "text_sizes": texts}
        torch._dynamo.reset()  # a fresh compilation, not a graph cached by the previous case
        call = functools.partial(package_value, kind, batch=batch, options=options)
        return torch.compile(call, fullgraph=True, backend="aot_eager")(x, y, scale, bias)
    ids = {"image_ids": batch["image_ids"], "text_ids": batch["text_ids"]}
    weighted = options.pop("weighted", False)  # True: images and texts; "images": the images only
    weights = {"weight": batch["image_weight"]} if weighted else {}
    weights |= {"text_weight": batch["text_weight"]} if weighted is True else {}
    if kind == "info_nce":
        return info_nce(x, y, scale, **ids, **weights, **options)
    if kind == "siglip":
        return siglip(x, y, scale, bias, **ids, **weights, **options)
    plus = SigLIPPlusLoss(chunk_size=options.get("chunk_size") or 0, soft_label=options.get("soft_label", False))
    criterion = plus if kind == "plus" else DistributedSigLIPPlusLoss(
        soft_label=options.get("soft_label", False), strategy=options.get("communication", "ring"))
    del criterion.logit_scale, criterion.logit_bias  # the learnt ones replaced by the leaves, for their gradients
    criterion.logit_scale, criterion.logit_bias = scale.log(), bias
    return criterion((x, y), batch["image_ids"], batch["text_ids"])["total_loss"]


def reference_value(kind: str, x: Tensor, y: Tensor, scale: Tensor, bias: Tensor, batch: dict[str, Tensor],
                    options: dict) -> Tensor:  # fmt: skip
    per_row, weighted = options.get("reduction") == "none", options.get("weighted", False)
    if kind == "info_nce":
        return reference_info_nce(x, y, scale, batch, symmetric=options.get("symmetric", True), weighted=weighted,
                                  per_row=per_row)  # fmt: skip
    if kind == "siglip":
        return reference_siglip_plus(x, y, scale, bias, batch, weighted=weighted, per_row=per_row)
    unit = F.normalize(x, dim=-1), F.normalize(y, dim=-1)  # the drop-ins normalise, as siglip-kernel's do
    return reference_siglip_plus(*unit, scale, bias, batch, soft_label=options.get("soft_label", False),
                                 per_pair=True)  # fmt: skip


CASES = [
    *[("info_nce", {"communication": mode, "chunk_size": chunk, **extra}) for mode, chunk, extra in itertools.product(
        ("gather", "ring"), (None, 2), ({}, {"weighted": True}, {"reduction": "none"}, {"symmetric": False}))],
    *[("siglip", {"communication": mode, "chunk_size": chunk, **extra}) for mode, chunk, extra in itertools.product(
        ("gather", "ring"), (None, 2), ({}, {"weighted": True}, {"weighted": "images"}, {"reduction": "none"}))],
    *[("plus", {"soft_label": soft}) for soft in (False, True)],
    *[("distributed plus", {"communication": mode, "soft_label": soft})
      for mode, soft in itertools.product(("gather", "ring"), (False, True))],
]


def _leaves(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    x, y = (batch[name].clone().requires_grad_() for name in ("x", "y"))
    scale, bias = torch.tensor(4.0, dtype=x.dtype, requires_grad=True), torch.tensor(-1.5, dtype=x.dtype,
                                                                                      requires_grad=True)
    return x, y, scale, bias


def _grads(value: Tensor, leaves: tuple[Tensor, ...], upstream: Tensor | None) -> list[Tensor]:
    """The gradients of ``value`` (per-row values: of ``Σ upstream · value``) with respect to ``leaves``."""
    grads = torch.autograd.grad(value.sum() if upstream is None else value @ upstream, leaves, allow_unused=True)
    return [torch.zeros_like(leaf) if grad is None else grad for grad, leaf in zip(grads, leaves, strict=True)]


def _slices(rank: int, counts: tuple = (IMAGES, TEXTS)) -> tuple[slice, slice]:
    """This rank's images and texts among the global batch's (``counts``: each rank's images, texts)."""
    images, texts = counts
    return (slice(sum(images[:rank]), sum(images[: rank + 1])), slice(sum(texts[:rank]), sum(texts[: rank + 1])))


def _local(batch: dict[str, Tensor], rank: int, counts: tuple = (IMAGES, TEXTS)) -> dict[str, Tensor]:
    images, texts = _slices(rank, counts)
    return {name: tensor[images if name in ("x", "image_ids", "image_weight") else texts]
            for name, tensor in batch.items()}  # fmt: skip


def _local_rows(rows: Tensor, kind: str, options: dict, rank: int, counts: tuple = (IMAGES, TEXTS)) -> Tensor:
    """This rank's per-row values among the global ones: its images' (InfoNCE: then its texts')."""
    images, texts = _slices(rank, counts)
    if kind in ("info_nce", "siglip") and options.get("symmetric", True):
        return torch.cat((rows[: sum(counts[0])][images], rows[sum(counts[0]) :][texts]))
    return rows[images]


def errors_per_rank(rank: int, world_size: int, cases: list) -> list[tuple[str, float]]:
    """Each case on this rank against the global float64 reference: the value; this rank's rows' gradients
    against the reference's (times W for a mean: DDP averages them); the scale's and bias's summed over ranks."""
    import torch.distributed as dist

    results = []
    for index, (kind, options) in enumerate(cases):
        counts = options.get("counts", (IMAGES, TEXTS))
        batch, per_row = make_batch(index, sum(counts[0]), sum(counts[1])), options.get("reduction") == "none"
        leaves = _leaves(batch)
        expected = reference_value(kind, *leaves, batch, options)
        upstream = torch.linspace(0.5, 1.5, expected.numel(), dtype=expected.dtype) if per_row else None
        expected_grads = _grads(expected, leaves, upstream)
        mine = _local(batch, rank, counts)
        local = _leaves(mine)
        value = package_value(kind, *local, mine, dict(options))
        grads = _grads(value, local, None if upstream is None else _local_rows(upstream, kind, options, rank, counts))
        factor = 1 if per_row else world_size
        scalars = torch.stack(grads[2:])
        dist.all_reduce(scalars)
        own = _local({"x": expected_grads[0], "y": expected_grads[1]}, rank, counts)
        wanted = _local_rows(expected, kind, options, rank, counts) if per_row else expected
        errors = [(value.detach() - wanted).abs(),
                  (grads[0] - factor * own["x"]).abs(), (grads[1] - factor * own["y"]).abs(),
                  (scalars / factor - torch.stack(expected_grads[2:])).abs()]
        results.append((f"{kind} {options}", max(float(error.max()) if error.numel() else 0.0 for error in errors)))
    return results


@pytest.mark.parametrize(("kind", "options"), CASES, ids=[f"{kind} {options}" for kind, options in CASES])
def test_one_process_equals_the_loop_reference(kind: str, options: dict) -> None:
    batch = make_batch(1, 7, 11)
    leaves = _leaves(batch)
    expected = reference_value(kind, *leaves, batch, options)
    upstream = torch.linspace(0.5, 1.5, expected.numel(), dtype=expected.dtype) if expected.ndim else None
    expected_grads = _grads(expected, leaves, upstream)
    leaves = _leaves(batch)
    value = package_value(kind, *leaves, batch, dict(options))
    grads = _grads(value, leaves, upstream)
    assert torch.allclose(value.detach(), expected.detach(), rtol=0, atol=TOLERANCE), (value, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert torch.allclose(grad, expected_grad, rtol=0, atol=TOLERANCE)


def test_three_ranks_with_uneven_and_empty_counts_equal_one_process(pool) -> None:
    for per_rank in zip(*pool(3).run(errors_per_rank, CASES, timeout=240), strict=True):
        name = per_rank[0][0]
        worst = max(error for _, error in per_rank)
        assert worst <= TOLERANCE, f"{name}: {worst:.1e}"


@pytest.mark.parametrize("kind", ["info_nce", "siglip"])
def test_one_text_per_image_is_the_square_loss(kind: str) -> None:
    batch = make_batch(2, 6, 6)
    unique = torch.arange(6)
    x, y, scale, bias = _leaves(batch)
    if kind == "info_nce":
        rectangular, square = info_nce(x, y, scale, image_ids=unique, text_ids=unique), info_nce(x, y, scale)
    else:
        rectangular = siglip(x, y, scale, bias, image_ids=unique, text_ids=unique)
        square = siglip(x, y, scale, bias)
    assert torch.allclose(rectangular, square, rtol=0, atol=1e-13)


def test_siglip_plus_by_its_directions_is_its_matrix_of_terms() -> None:
    """The two references are one loss: the directions' rows over 2N are the matrix's; equal weights change nothing."""
    batch = make_batch(5, 7, 11)
    x, y, scale, bias = _leaves(batch)
    matrix = reference_siglip_plus(x, y, scale, bias, batch)
    rows = reference_siglip_plus(x, y, scale, bias, batch, per_row=True)
    assert rows.shape == (7 + 11,)
    assert torch.allclose(rows.sum() / (2 * 7), matrix, rtol=0, atol=1e-13)
    unit = batch | {"image_weight": torch.full((7,), 3.0, dtype=x.dtype), "text_weight": torch.full((11,), 0.5)}
    assert torch.allclose(reference_siglip_plus(x, y, scale, bias, unit, weighted=True), matrix, rtol=0, atol=1e-13)


def test_the_modules_take_the_text_options_as_the_functions_do() -> None:
    batch = make_batch(6, 5, 9)
    x, y, scale, bias = _leaves(batch)
    options = {"image_ids": batch["image_ids"], "text_ids": batch["text_ids"], "weight": batch["image_weight"],
               "text_weight": batch["text_weight"], "text_sizes": (9,)}  # fmt: skip
    assert torch.equal(SigLIPLoss(communication="ring")(x, y, scale, bias, **options),
                       siglip(x, y, scale, bias, communication="ring", **options))  # fmt: skip
    assert torch.equal(DistributedInfoNCE(chunk_size=2)(x, y, scale, **options),
                       info_nce(x, y, scale, chunk_size=2, **options))  # fmt: skip


def test_float32_is_within_float32_bounds_of_float64() -> None:
    batch64 = make_batch(3, 9, 20)
    batch32 = {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in batch64.items()}
    for kind, mode, extra in itertools.product(("info_nce", "siglip"), ("gather", "ring"),
                                               ({}, {"weighted": True}, {"reduction": "none"})):  # fmt: skip
        options = {"communication": mode, "chunk_size": 4, **extra}
        values = [package_value(kind, *_leaves(batch), batch, dict(options)).detach().double()
                  for batch in (batch64, batch32)]  # fmt: skip
        worst = float((values[0] - values[1]).abs().max())
        assert worst <= 1e-5 * float(values[0].abs().max()), (kind, options, worst)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"image_ids": torch.arange(3)}, "go together"),
        ({"image_ids": torch.arange(3), "text_ids": torch.arange(4), "ids": torch.arange(3)}, "ids= does not go"),
        ({"image_ids": torch.arange(3), "text_ids": torch.arange(5)}, "text_ids must have one id per row"),
        ({"image_ids": torch.arange(3).float(), "text_ids": torch.arange(4)}, "int64"),
    ],
)
def test_a_wrong_call_says_what_was_expected(arguments: dict, message: str) -> None:
    x, y = torch.randn(3, 4), torch.randn(4, 4)
    with pytest.raises((ValueError, TypeError), match=message):
        info_nce(x, y, **arguments)
    with pytest.raises((ValueError, TypeError), match=message):
        siglip(x, y, 10.0, -10.0, **arguments)


def test_the_drop_in_for_siglip_kernels_plain_loss_is_the_square_loss_times_its_normalisation() -> None:
    batch = make_batch(4, 5, 5)
    x, y, scale, bias = _leaves(batch)
    value = DistributedSigLIPLoss(strategy="gather")(x, y, scale, bias)
    assert torch.allclose(value, siglip(x, y, scale, bias), rtol=0, atol=1e-13)


def text_sizes_outcomes(rank: int, world_size: int) -> list[str]:
    """This rank's outcome of calls with right and wrong ``text_sizes=`` (and text options without ids)."""
    batch = _local(make_batch(3, sum(IMAGES), sum(TEXTS)), rank)
    x, y, scale, bias = _leaves(batch)
    ids = {"image_ids": batch["image_ids"], "text_ids": batch["text_ids"]}
    calls = {
        "right": lambda: info_nce(x, y, scale, **ids, sizes=IMAGES, text_sizes=TEXTS),
        "wrong": lambda: siglip(x, y, scale, bias, **ids, text_sizes=(5, 5, 1)),
        "without ids": lambda: info_nce(x, x, scale, text_sizes=IMAGES),
        "text_weight without ids": lambda: info_nce(x, x, scale, text_weight=torch.ones(x.shape[0])),
    }
    outcomes = []
    for name, call in calls.items():
        try:
            call()
            outcomes.append(f"{name}: ok")
        except ValueError as error:
            outcomes.append(f"{name}: {error}")
    return outcomes


def test_text_sizes_are_checked_on_every_rank_and_text_options_need_ids(pool) -> None:
    outcomes = pool(3).run(text_sizes_outcomes, timeout=120)
    assert outcomes[0] == outcomes[1] == outcomes[2]  # the same error on every rank
    right, wrong, without_ids, weight_without_ids = outcomes[0]
    assert right == "right: ok"
    assert "text_sizes=(5, 5, 1) was given, but the ranks hold (5, 6, 0) rows" in wrong, wrong
    assert "text_sizes= goes with image_ids= and text_ids=" in without_ids, without_ids
    assert "text_weight= goes with image_ids= and text_ids=" in weight_without_ids, weight_without_ids
