"""Extra negatives, per-sample weights and ``reduction="none"`` on real gloo ranks, against float64 loops.

Every case compares with a plain loop reference over the global batch: weighted means
``Σ w_i ℓ_i / Σ w_i`` (values and gradients), per-row losses (values, and the gradient of an
arbitrary upstream ``Σ u_i ℓ_i``), and InfoNCE with extra negative columns, own or shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from outcomes import error_outcomes
from test_losses_reference import encode, make_problem, value_and_grads
from torch import Tensor

from contrastive_dist import SharedNegatives, info_nce, nt_xent, siglip, supcon
from contrastive_dist.testing import WorkerPool

KINDS = ("clip", "clip_one_way", "ntxent", "siglip", "supcon", "supcon_views")
SHARDS: dict[int, list[tuple[int, ...]]] = {1: [(5,)], 2: [(1, 4), (0, 3)], 3: [(3, 0, 2)]}
NEGATIVE_SHARDS = {1: (3,), 2: (2, 0), 3: (0, 3, 1)}
TEMPERATURE = 0.4
Case = tuple[str, str, tuple[int, ...], str, int | None]
"""(kind, mode, shards, negatives, chunk_size); mode: "weighted" or "none"; negatives: "", "own", "shared"."""


# ---------------------------------------------------------------- plain float64 references


def clip_rows(images: Tensor, texts: Tensor, scale: Tensor, negatives: Tensor | None, symmetric: bool) -> Tensor:
    columns = texts if negatives is None else torch.cat([texts, negatives])
    rows = []
    for i in range(images.shape[0]):
        image_to_text = torch.logsumexp(torch.stack([scale * images[i] @ c for c in columns]), 0)
        image_to_text = image_to_text - scale * images[i] @ texts[i]
        if symmetric:
            text_to_image = torch.logsumexp(torch.stack([scale * texts[i] @ m for m in images]), 0)
            text_to_image = text_to_image - scale * texts[i] @ images[i]
            rows.append((image_to_text + text_to_image) / 2)
        else:
            rows.append(image_to_text)
    return torch.stack(rows) if rows else images.sum(1) * 0


def ntxent_rows(z1: Tensor, z2: Tensor, scale: float) -> Tensor:
    z = torch.cat([F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)])
    count = z1.shape[0]
    anchors = []
    for a in range(2 * count):
        positive = (a + count) % (2 * count)
        logits = torch.stack([scale * z[a] @ z[j] for j in range(2 * count) if j != a])
        anchors.append(torch.logsumexp(logits, 0) - scale * z[a] @ z[positive])
    return torch.stack([(anchors[i] + anchors[i + count]) / 2 for i in range(count)]) if count else z1.sum(1) * 0


def siglip_rows(images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    rows = []
    for i in range(images.shape[0]):
        signs = [1 if i == j else -1 for j in range(len(texts))]
        terms = [-F.logsigmoid(sign * (scale * images[i] @ text + bias)) for sign, text in zip(signs, texts)]
        rows.append(torch.stack(terms).sum())
    return torch.stack(rows) if rows else images.sum(1) * 0


def supcon_rows(features: Tensor, labels: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Per-anchor losses shaped like ``features[..., 0]`` (0 without positives) and the has-positives mask."""
    flat = features.reshape(-1, features.shape[-1])
    views = flat.shape[0] // max(labels.shape[0], 1)
    flat_labels = [int(label) for label in labels for _ in range(views)]
    rows, mask = [], []
    for a in range(flat.shape[0]):
        positives = [p for p in range(flat.shape[0]) if p != a and flat_labels[p] == flat_labels[a]]
        mask.append(bool(positives))
        if not positives:
            rows.append(flat[a].sum() * 0)
            continue
        lse = torch.logsumexp(torch.stack([scale * flat[a] @ flat[j] for j in range(flat.shape[0]) if j != a]), 0)
        rows.append(sum(lse - scale * flat[a] @ flat[p] for p in positives) / len(positives))
    shape = features.shape[:-1]
    if not rows:
        return features.sum(-1) * 0, torch.zeros(shape, dtype=torch.bool)
    return torch.stack(rows).reshape(shape), torch.tensor(mask).reshape(shape)


def reference_rows(kind: str, params: dict[str, Tensor], data: dict[str, Tensor], negatives: Tensor | None) -> Tensor:
    """Per-row losses of the whole global batch, and (SupCon) which rows count in the mean."""
    images, texts = encode(params, data)
    scale = params["log_scale"].exp()
    if kind.startswith("clip"):
        return clip_rows(images, texts, scale, negatives, symmetric=kind == "clip")
    if kind == "ntxent":
        return ntxent_rows(data["x_image"] @ params["w_image"], data["x_text"] @ params["w_text"], 1 / TEMPERATURE)
    if kind == "siglip":
        return siglip_rows(images, texts, scale, params["bias"])
    features = images if kind == "supcon" else torch.stack([images, texts], dim=1)
    return supcon_rows(features, data["labels"], 1 / TEMPERATURE)[0]


def reference_weighted_mean(
    kind: str, params: dict[str, Tensor], data: dict[str, Tensor], negatives: Tensor | None
) -> Tensor:
    rows = reference_rows(kind, params, data, negatives)
    weights = data["weight"]
    if kind.startswith("supcon"):
        # One weight per sample, shared by its views; anchors without positives do not count.
        weights = (weights[:, None].expand_as(rows) if rows.ndim == 2 else weights) * _has_positives(
            data["labels"], rows
        )
    total = weights.sum()
    return (rows * weights).sum() / total if total > 0 else rows.sum() * 0


def _has_positives(labels: Tensor, rows: Tensor) -> Tensor:
    views = 1 if rows.ndim == 1 else rows.shape[1]
    count = [int((labels == label).sum()) * views - 1 for label in labels]
    return torch.tensor(count).reshape(-1, *([1] * (rows.ndim - 1))).expand_as(rows) > 0


# ---------------------------------------------------------------- the package, one rank's share


def make_data(seed: int, total: int, negatives_total: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    params, data = make_problem(seed=seed, total=total, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed + 1000)
    weight = torch.rand(total, generator=generator, dtype=torch.float64) * 2
    weight[::3] = 0.0  # zero weights are allowed
    data["weight"] = weight
    data["upstream"] = torch.randn(total, 2, generator=generator, dtype=torch.float64)
    data["x_negative"] = torch.randn(negatives_total, 4, generator=generator, dtype=torch.float64)
    data["shared"] = F.normalize(torch.randn(4, 5, generator=generator, dtype=torch.float64), dim=-1)
    return params, data


def negatives_for(params: dict[str, Tensor], x_negative: Tensor) -> Tensor:
    return F.normalize(x_negative @ params["w_text"], dim=-1)


def package_value(kind: str, mode: str, params: dict[str, Tensor], data: dict[str, Tensor], negatives: Any,
                  chunk_size: int | None, sizes: tuple[int, ...] | None = None,
                  communication: str = "gather") -> Tensor:
    images, texts = encode(params, data)
    scale = params["log_scale"].exp()
    reduction = "none" if mode == "none" else "mean"
    options: dict[str, Any] = {
        "chunk_size": chunk_size, "reduction": reduction, "sizes": sizes, "communication": communication
    }
    if mode == "weighted":
        options["weight"] = data["weight"]
    if kind.startswith("clip"):
        return info_nce(images, texts, scale, symmetric=kind == "clip", negatives=negatives, **options)
    if kind == "ntxent":
        raw_1, raw_2 = data["x_image"] @ params["w_image"], data["x_text"] @ params["w_text"]
        return nt_xent(raw_1, raw_2, temperature=TEMPERATURE, **options)
    if kind == "siglip":
        return siglip(images, texts, scale, params["bias"], **options)
    features = images if kind == "supcon" else torch.stack([images, texts], dim=1)
    return supcon(features, data["labels"], temperature=TEMPERATURE, **options)


def cases(world_size: int) -> list[Case]:
    out: list[Case] = []
    for shards in SHARDS[world_size]:
        for kind in KINDS:
            for mode in ("weighted", "none"):
                for chunk_size in (None, 2):
                    out.append((kind, mode, shards, "", chunk_size))
                    if kind.startswith("clip"):
                        out.append((kind, mode, shards, "own", chunk_size))
                        out.append((kind, mode, shards, "shared", chunk_size))
    return out


def _slice(tensor: Tensor, shards: tuple[int, ...], rank: int) -> Tensor:
    start = sum(shards[:rank])
    return tensor[start : start + shards[rank]]


def run_cases(rank: int, world_size: int, all_cases: list[Case]) -> list[tuple[Tensor, dict[str, Tensor]]]:
    results = []
    for index, (kind, mode, shards, negatives_kind, chunk_size) in enumerate(all_cases):
        negative_shards = NEGATIVE_SHARDS[world_size]
        params, data = make_data(index, sum(shards), sum(negative_shards))
        names = ("x_image", "x_text", "labels", "weight", "upstream")
        local = {name: _slice(data[name], shards, rank) for name in names}
        negatives: Any = None
        if negatives_kind == "own":
            negatives = negatives_for(params, _slice(data["x_negative"], negative_shards, rank))
        elif negatives_kind == "shared":
            negatives = SharedNegatives(data["shared"])
        # Every other case passes the sizes (caller-given sizes take another path through the gather).
        sizes = shards if index % 2 else None
        value = package_value(kind, mode, params, local, negatives, chunk_size, sizes)
        objective = value if mode == "weighted" else (value * _upstream(local["upstream"], value)).sum()
        _, grads = value_and_grads(objective, params)
        results.append((value.detach(), grads))
    return results


def expected_for(index: int, case: Case, world_size: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Reference (rows or weighted mean) of the whole global batch, and the gradients of the objective."""
    kind, mode, shards, negatives_kind, _ = case
    params, data = make_data(index, sum(shards), sum(NEGATIVE_SHARDS[world_size]))
    negatives = None
    if negatives_kind == "own":
        negatives = negatives_for(params, data["x_negative"])
    elif negatives_kind == "shared":
        negatives = data["shared"]
    if mode == "weighted":
        value = reference_weighted_mean(kind, params, data, negatives)
        return value.detach(), value.detach(), value_and_grads(value, params)[1]
    rows = reference_rows(kind, params, data, negatives)
    return rows.detach(), rows.detach(), value_and_grads((rows * _upstream(data["upstream"], rows)).sum(), params)[1]


def _upstream(upstream: Tensor, rows: Tensor) -> Tensor:
    """The caller's arbitrary per-row gradient ``u``, shaped like ``rows`` (``(n,)`` or ``(n, 2)``)."""
    return upstream if rows.ndim == 2 else upstream[:, 0]


# ---------------------------------------------------------------- tests


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_weights_rows_and_negatives_equal_the_float64_reference(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    all_cases = cases(world_size)
    per_rank = pool(world_size).run(run_cases, all_cases, timeout=240)
    for index, case in enumerate(all_cases):
        kind, mode, shards, negatives_kind, chunk_size = case
        what = f"W={world_size} {case}"
        expected, _, expected_grads = expected_for(index, case, world_size)
        if mode == "weighted":
            # The mean over ranks is the weighted global mean; DDP averages the gradients.
            _close(sum(result[index][0] for result in per_rank) / world_size, expected, what)
            for name, grad in expected_grads.items():
                _close(sum(result[index][1][name] for result in per_rank) / world_size, grad, f"{what} d/d{name}")
        else:
            # Per-row losses: the ranks' rows, in rank order, are the global batch's rows; the
            # caller's objective Σ u_i ℓ_i is summed over ranks (DDP would average: × 1/W).
            _close(torch.cat([result[index][0] for result in per_rank]), expected, what)
            for name, grad in expected_grads.items():
                _close(sum(result[index][1][name] for result in per_rank), grad, f"{what} d/d{name}")


def test_all_ones_weights_give_the_unweighted_loss() -> None:
    params, data = make_data(0, 6, 0)
    images, texts = encode(params, data)
    ones = torch.ones(6, dtype=torch.float64)
    pairs = [
        (info_nce(images, texts), info_nce(images, texts, weight=ones)),
        (nt_xent(images, texts), nt_xent(images, texts, weight=ones)),
        (siglip(images, texts, 3.0, -1.0, chunk_size=4), siglip(images, texts, 3.0, -1.0, weight=ones, chunk_size=4)),
        (supcon(images, data["labels"]), supcon(images, data["labels"], weight=ones)),
    ]
    for plain, weighted in pairs:
        _close(weighted, plain, "weight=1")
    # Weights scale-free: 5·w gives the same loss; all-zero weights give a connected 0.
    leaf = images.detach().requires_grad_()
    _close(info_nce(leaf, texts, weight=5 * data["weight"]), info_nce(leaf, texts, weight=data["weight"]), "5w")
    zero = info_nce(leaf, texts, weight=torch.zeros(6, dtype=torch.float64))
    (grad,) = torch.autograd.grad(zero, leaf)
    assert zero.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def _bad_inputs_on_rank_one(rank: int, world_size: int) -> dict[str, tuple[str, str] | float]:
    bad = rank == 1
    images, texts = F.normalize(torch.randn(4, 5), dim=-1), F.normalize(torch.randn(4, 5), dim=-1)
    labels, ones = torch.tensor([0, 1, 0, 1]), torch.ones(4)
    negative_dtype = torch.float64 if bad else torch.float32
    calls: dict[str, Callable[[], object]] = {
        "negatives width": lambda: info_nce(images, texts, negatives=torch.randn(2, 3 if bad else 5)),
        "negatives dtype": lambda: info_nce(images, texts, negatives=torch.randn(2, 5, dtype=negative_dtype)),
        "shared negatives width": lambda: info_nce(
            images, texts, negatives=SharedNegatives(torch.randn(3, 4 if bad else 5))
        ),
        "weight length": lambda: info_nce(images, texts, weight=ones[:3] if bad else ones),
        "weight negative": lambda: nt_xent(images, texts, weight=-ones if bad else ones),
        "weight nan": lambda: siglip(images, texts, 2.0, -1.0, weight=ones * math.nan if bad else ones),
        "weight inf": lambda: supcon(images, labels, weight=ones * math.inf if bad else ones),
        "weight dtype": lambda: supcon(images, labels, weight=ones.bool() if bad else ones),
        "weight with none": lambda: info_nce(images, texts, weight=ones, reduction="none" if bad else "mean"),
        "reduction": lambda: nt_xent(images, texts, reduction="sum" if bad else "mean"),  # type: ignore[arg-type]
    }
    outcome: dict[str, tuple[str, str] | float] = {**error_outcomes(calls)}
    # On one rank only, weights or negatives would change which collectives run: the features'
    # gather disagrees instead, so every rank raises (no hang).
    on_one_rank: dict[str, Callable[[], object]] = {
        "weight on one rank": lambda: info_nce(images, texts, weight=ones if bad else None),
        "negatives on one rank": lambda: info_nce(images, texts, negatives=torch.randn(2, 5) if bad else None),
        "shared on one rank": lambda: info_nce(
            images, texts, negatives=SharedNegatives(torch.randn(2, 5)) if bad else torch.randn(2, 5)
        ),
    }
    outcome.update(error_outcomes(on_one_rank))
    outcome["after"] = float(info_nce(images, texts, negatives=torch.randn(rank, 5), weight=ones))
    return outcome


def test_bad_negatives_and_weights_on_one_rank_raise_on_every_rank(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_bad_inputs_on_rank_one, timeout=30, return_exceptions=True)
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert math.isfinite(outcome.pop("after"))  # type: ignore[arg-type]
        for name, result in outcome.items():
            kind, message = result  # type: ignore[misc]
            expected_kind = "TypeError" if "dtype" in name else "ValueError"
            assert kind == expected_kind, f"rank {rank} {name}: {kind} {message}"
            expected_text = "do not agree" if name.endswith("on one rank") else "(on rank 1;"
            assert expected_text in message, f"rank {rank} {name}: {message}"
            assert outcome[name] == per_rank[1][name], f"rank {rank} {name}: not the same error as rank 1"


def test_shared_negatives_in_another_dtype_than_the_features() -> None:
    # A float32 (or float64) queue beside bf16 features: the columns meet in the core's float32.
    generator = torch.Generator().manual_seed(4)
    images = F.normalize(torch.randn(6, 8, generator=generator), dim=-1).bfloat16()
    texts = F.normalize(torch.randn(6, 8, generator=generator), dim=-1).bfloat16()
    for queue_dtype in (torch.float32, torch.float64):
        shared = F.normalize(torch.randn(5, 8, generator=generator), dim=-1).to(queue_dtype)
        for chunk_size in (None, 4):
            loss = info_nce(images, texts, 5.0, negatives=SharedNegatives(shared), chunk_size=chunk_size)
            expected = clip_rows(images.double(), texts.double(), torch.tensor(5.0).double(), shared.double(), True)
            assert loss.dtype == torch.float32
            torch.testing.assert_close(loss.double(), expected.mean(), rtol=1e-6, atol=0)
