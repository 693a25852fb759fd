"""Ring mode with per-sample weights, ``reduction="none"`` and extra negatives, on real gloo ranks.

Every case runs ring mode and gather mode on the same inputs and compares both with the plain
float64 loop references of ``test_negatives_weights`` (weighted means ``Σ w_i ℓ_i / Σ w_i``;
per-row losses with the gradient of an arbitrary upstream ``Σ u_i ℓ_i``; InfoNCE with own or
shared negatives): values and gradients of the encoder weights (hence the features),
``logit_scale``, ``logit_bias`` and each rank's own negatives, within 1e-10, with uneven shards
including empty ranks (for the negatives too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from outcomes import error_outcomes
from test_losses_reference import encode, value_and_grads
from test_negatives_weights import (
    KINDS,
    TEMPERATURE,
    _upstream,
    make_data,
    negatives_for,
    package_value,
    reference_rows,
    reference_weighted_mean,
)
from torch import Tensor

from contrastive_dist import SharedNegatives, info_nce, nt_xent, siglip, supcon
from contrastive_dist.testing import WorkerPool

# (shards, negative shards): uneven, with empty ranks in both.
LAYOUTS: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {
    1: [((5,), (3,))],
    2: [((1, 4), (2, 0)), ((0, 3), (0, 3))],
    3: [((3, 0, 2), (0, 3, 1)), ((0, 0, 2), (1, 0, 0))],
    4: [((2, 0, 3, 1), (1, 0, 2, 0))],
}
Case = tuple[str, str, tuple[int, ...], tuple[int, ...], str, int | None]
"""(kind, mode, shards, negative shards, negatives, chunk_size).

mode: "weighted" or "none"; negatives: "" (none), "own" or "shared".
"""
Result = tuple[Tensor, dict[str, Tensor]]


def cases(world_size: int) -> list[Case]:
    out: list[Case] = []
    for layout, (shards, negative_shards) in enumerate(LAYOUTS[world_size]):
        for kind in KINDS:
            for mode in ("weighted", "none"):
                # chunk_size on (2: several chunks per block) and off; off only for the first layout
                # and W < 4 (one W = 4 layout keeps the run short).
                chunks = (None, 2) if layout == 0 and world_size < 4 else (2,)
                for chunk_size in chunks:
                    negative_kinds = ("", "own", "shared") if kind.startswith("clip") else ("",)
                    out += [(kind, mode, shards, negative_shards, neg, chunk_size) for neg in negative_kinds]
    return out


def _slice(tensor: Tensor, shards: tuple[int, ...], rank: int) -> Tensor:
    start = sum(shards[:rank])
    return tensor[start : start + shards[rank]]


def _run_cases(rank: int, world_size: int, all_cases: list[Case]) -> list[tuple[Result, Result]]:
    """Ring mode and gather mode on the same local inputs, for every case."""
    results = []
    for seed, (kind, mode, shards, negative_shards, negatives_kind, chunk_size) in enumerate(all_cases):
        both = []
        for communication in ("ring", "gather"):
            params, data = make_data(seed, sum(shards), sum(negative_shards))
            names = ("x_image", "x_text", "labels", "weight", "upstream")
            local = {name: _slice(data[name], shards, rank) for name in names}
            inputs: dict[str, Tensor] = dict(params)
            negatives: Any = None
            if negatives_kind == "own":
                negatives = negatives_for(params, _slice(data["x_negative"], negative_shards, rank))
                inputs["negatives"] = negatives  # not a leaf: its gradient is this rank's share
            elif negatives_kind == "shared":
                negatives = SharedNegatives(data["shared"])
            # Odd seeds pass sizes= (ring mode checks them against its own exchange).
            sizes = shards if seed % 2 else None
            value = package_value(kind, mode, params, local, negatives, chunk_size, sizes, communication)
            objective = value if mode == "weighted" else (value * _upstream(local["upstream"], value)).sum()
            _, grads = value_and_grads(objective, inputs)
            both.append((value.detach(), grads))
        results.append((both[0], both[1]))
    return results


def _expected(seed: int, case: Case, world_size: int) -> Result:
    """The reference of the whole global batch: its value (weighted mean or rows) and gradients.

    The negatives' gradient is given as each rank's autograd sees it: with the mean, DDP's
    contract makes a rank's local gradient ``W ×`` the gradient of the mean over ranks; with
    per-row losses the objective is the sum over ranks, so no factor.
    """
    kind, mode, shards, negative_shards, negatives_kind, _ = case
    params, data = make_data(seed, sum(shards), sum(negative_shards))
    inputs: dict[str, Tensor] = dict(params)
    negatives = None
    if negatives_kind == "own":
        negatives = negatives_for(params, data["x_negative"])
        inputs["negatives"] = negatives
    elif negatives_kind == "shared":
        negatives = data["shared"]
    if mode == "weighted":
        value = reference_weighted_mean(kind, params, data, negatives)
        objective = value
    else:
        value = reference_rows(kind, params, data, negatives)
        objective = (value * _upstream(data["upstream"], value)).sum()
    _, grads = value_and_grads(objective, inputs)
    if "negatives" in grads and mode == "weighted":
        grads["negatives"] = grads["negatives"] * world_size
    return value.detach(), grads


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


def _check(world_size: int, all_cases: list[Case], per_rank: list[list[tuple[Result, Result]]]) -> None:
    for seed, case in enumerate(all_cases):
        kind, mode, shards, negative_shards, _, _ = case
        what = f"W={world_size} {case}"
        # Ring mode equals gather mode: each rank's value and own negatives' gradient, and the sum
        # over ranks of the parameters' gradients (a replicated scalar such as logit_scale gets
        # its terms on the rank that formed the logits, which differs between the modes).
        for rank in range(world_size):
            (ring_value, ring_grads), (gather_value, gather_grads) = per_rank[rank][seed]
            _close(ring_value, gather_value, f"{what} rank {rank} ring vs gather")
            if "negatives" in gather_grads:
                _close(ring_grads["negatives"], gather_grads["negatives"], f"{what} rank {rank} vs gather d/dnegatives")
        for name in (name for name in per_rank[0][seed][1][1] if name != "negatives"):
            ring_sum = sum(per_rank[rank][seed][0][1][name] for rank in range(world_size))
            gather_sum = sum(per_rank[rank][seed][1][1][name] for rank in range(world_size))
            _close(ring_sum, gather_sum, f"{what} ring vs gather d/d{name}")
        expected, expected_grads = _expected(seed, case, world_size)
        ring = [per_rank[rank][seed][0] for rank in range(world_size)]
        # Weighted: the mean over ranks is the global weighted mean, DDP averages the gradients.
        # Rows: the ranks' rows in rank order are the global rows; the objective Σ u_i ℓ_i is summed.
        divisor = world_size if mode == "weighted" else 1
        if mode == "weighted":
            _close(sum(value for value, _ in ring) / world_size, expected, what)
        else:
            _close(torch.cat([value for value, _ in ring]), expected, what)
        for name, grad in expected_grads.items():
            if name == "negatives":  # each rank holds the gradient of its own negatives
                for rank, (_, grads) in enumerate(ring):
                    _close(grads[name], _slice(grad, negative_shards, rank), f"{what} rank {rank} d/dnegatives")
                continue
            _close(sum(grads[name] for _, grads in ring) / divisor, grad, f"{what} d/d{name}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_weights_rows_and_negatives_equal_gather_mode_and_the_float64_reference(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    all_cases = cases(world_size)
    per_rank = pool(world_size).run(_run_cases, all_cases, timeout=300)
    _check(world_size, all_cases, per_rank)


def _bad_inputs_on_rank_one(rank: int, world_size: int) -> dict[str, tuple[str, str] | float]:
    bad = rank == 1
    generator = torch.Generator().manual_seed(rank)
    images = F.normalize(torch.randn(4, 5, generator=generator), dim=-1)
    texts = F.normalize(torch.randn(4, 5, generator=generator), dim=-1)
    labels, ones = torch.tensor([0, 1, 0, 1]), torch.ones(4)
    negative_dtype = torch.float64 if bad else torch.float32
    ring = {"communication": "ring"}
    calls: dict[str, Callable[[], object]] = {
        "negatives width": lambda: info_nce(images, texts, negatives=torch.randn(2, 3 if bad else 5), **ring),
        "negatives dtype": lambda: info_nce(images, texts, negatives=torch.randn(2, 5, dtype=negative_dtype), **ring),
        "shared negatives width": lambda: info_nce(
            images, texts, negatives=SharedNegatives(torch.randn(3, 4 if bad else 5)), **ring
        ),
        "weight length": lambda: info_nce(images, texts, weight=ones[:3] if bad else ones, **ring),
        "weight negative": lambda: nt_xent(images, texts, weight=-ones if bad else ones, **ring),
        "weight nan": lambda: siglip(images, texts, 2.0, -1.0, weight=ones * math.nan if bad else ones, **ring),
        "weight inf": lambda: supcon(images, labels, weight=ones * math.inf if bad else ones, **ring),
        "weight dtype": lambda: supcon(images, labels, weight=ones.bool() if bad else ones, **ring),
        "weight with none": lambda: info_nce(
            images, texts, weight=ones, reduction="none" if bad else "mean", **ring
        ),
    }
    # On one rank only, weights or negatives would change what travels or which collectives
    # run: the ring's agreement exchange disagrees instead, so every rank raises (no hang).
    negatives_grad = torch.randn(2, 5).requires_grad_(not bad)
    on_one_rank: dict[str, Callable[[], object]] = {
        "weight on one rank": lambda: siglip(images, texts, 2.0, -1.0, weight=ones if bad else None, **ring),
        "supcon weight on one rank": lambda: supcon(images, labels, weight=None if bad else ones, **ring),
        "negatives on one rank": lambda: info_nce(images, texts, negatives=torch.randn(2, 5) if bad else None, **ring),
        "shared on one rank": lambda: info_nce(
            images, texts, negatives=SharedNegatives(torch.randn(2, 5)) if bad else torch.randn(2, 5), **ring
        ),
        "negatives gradient on one rank": lambda: info_nce(images, texts, negatives=negatives_grad, **ring),
    }
    outcome: dict[str, tuple[str, str] | float] = {**error_outcomes({**calls, **on_one_rank})}
    # "none" on one rank beside "mean" elsewhere is each rank's own choice: no error, no hang.
    rows = supcon(images, labels, reduction="none" if bad else "mean", communication="ring")
    outcome["mixed reduction"] = float(rows.sum())
    # The ring still works afterwards, with weights and own negatives (rank 0 has none).
    outcome["after"] = float(info_nce(images, texts, negatives=torch.randn(rank, 5), weight=ones, **ring))
    return outcome


def test_bad_weights_and_negatives_on_one_rank_raise_on_every_rank_in_ring_mode(
    pool: Callable[[int], WorkerPool],
) -> None:
    per_rank = pool(3).run(_bad_inputs_on_rank_one, timeout=30, return_exceptions=True)
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert math.isfinite(outcome.pop("after"))  # type: ignore[arg-type]
        assert math.isfinite(outcome.pop("mixed reduction"))  # type: ignore[arg-type]
        for name, result in outcome.items():
            kind, message = result  # type: ignore[misc]
            expected_kind = "TypeError" if "dtype" in name else "ValueError"
            assert kind == expected_kind, f"rank {rank} {name}: {kind} {message}"
            expected_text = "do not agree" if name.endswith("on one rank") else "(on rank 1;"
            assert expected_text in message, f"rank {rank} {name}: {message}"
            assert outcome[name] == per_rank[1][name], f"rank {rank} {name}: not the same error as rank 1"


def test_half_precision_features_with_a_float32_queue_and_own_negatives_in_one_process() -> None:
    # bf16 features, a float32 or float64 queue, bf16 own negatives: the core runs in float32 in
    # both modes, so ring mode matches gather mode to float32 rounding (values and gradients).
    generator = torch.Generator().manual_seed(5)
    images = F.normalize(torch.randn(6, 8, generator=generator), dim=-1).bfloat16().requires_grad_()
    texts = F.normalize(torch.randn(6, 8, generator=generator), dim=-1).bfloat16().requires_grad_()
    own = F.normalize(torch.randn(4, 8, generator=generator), dim=-1).bfloat16().requires_grad_()
    weight = torch.rand(6, generator=generator)
    for queue_dtype in (torch.float32, torch.float64):
        queue = SharedNegatives(F.normalize(torch.randn(5, 8, generator=generator), dim=-1).to(queue_dtype))
        for negatives, chunk_size in ((queue, None), (queue, 4), (own, None), (own, 4)):
            results = []
            for communication in ("ring", "gather"):
                loss = info_nce(
                    images, texts, 5.0, negatives=negatives, weight=weight, chunk_size=chunk_size,
                    communication=communication,  # type: ignore[arg-type]
                )
                grads = torch.autograd.grad(loss, (images, texts, own), allow_unused=True)
                results.append((loss, grads))
            (ring_loss, ring_grads), (gather_loss, gather_grads) = results
            assert ring_loss.dtype == torch.float32
            torch.testing.assert_close(ring_loss, gather_loss, rtol=1e-6, atol=1e-6)
            for ring_grad, gather_grad in zip(ring_grads, gather_grads, strict=True):
                if gather_grad is None:
                    assert ring_grad is None
                    continue
                assert ring_grad is not None and ring_grad.dtype == torch.bfloat16
                # Within bf16 rounding of the gradient's scale: gather mode rounds the images'
                # two paths (rows and gathered columns) to bf16 apart before summing them.
                scale = gather_grad.abs().max().item()
                torch.testing.assert_close(ring_grad.float(), gather_grad.float(), rtol=2**-7, atol=2**-7 * scale)


def _edge_cases(rank: int, world_size: int) -> dict[str, Any]:
    """W = 3: an empty global batch with negatives on some ranks; a subgroup {0, 2} (rank 1 stays out)."""
    outcome: dict[str, Any] = {}
    params, data = make_data(0, 0, 3)
    for kind in KINDS:
        for mode in ("weighted", "none"):
            for negatives_kind in ("", "own", "shared") if kind.startswith("clip") else ("",):
                own = negatives_for(params, _slice(data["x_negative"], (2, 0, 1), rank))
                negatives = {"": None, "own": own, "shared": SharedNegatives(data["shared"])}[negatives_kind]
                value = package_value(kind, mode, params, data, negatives, 2, None, "ring")
                _, grads = value_and_grads(value.sum(), dict(params, negatives=own))
                largest = max(float(grad.abs().max()) if grad.numel() else 0.0 for grad in grads.values())
                outcome[f"empty {kind} {mode} {negatives_kind}"] = (tuple(value.shape), float(value.sum()), largest)
    members, shards, negative_shards = [0, 2], (3, 2), (0, 2)
    group = dist.new_group(members)
    if rank in members:
        index = members.index(rank)
        params, data = make_data(7, sum(shards), sum(negative_shards))
        local = {name: _slice(data[name], shards, index) for name in ("x_image", "x_text", "labels", "weight")}
        images, texts = encode(params, local)
        negatives = negatives_for(params, _slice(data["x_negative"], negative_shards, index))
        options: dict[str, Any] = {"weight": local["weight"], "group": group, "communication": "ring", "chunk_size": 2}
        loss = info_nce(images, texts, params["log_scale"].exp(), negatives=negatives, **options)
        outcome["group clip"] = value_and_grads(loss, params)
        images, texts = encode(params, local)
        loss = supcon(torch.stack([images, texts], dim=1), local["labels"], temperature=TEMPERATURE, **options)
        outcome["group supcon_views"] = value_and_grads(loss, params)
    dist.destroy_process_group(group)
    return outcome


def test_empty_global_batch_and_subgroup_with_weights_and_negatives(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_edge_cases, timeout=60)
    for rank, outcome in enumerate(per_rank):
        for name, (shape, value, largest_grad) in ((k, v) for k, v in outcome.items() if k.startswith("empty")):
            assert shape[0] == 0 if " none " in name else shape == (), f"rank {rank} {name}: {shape}"
            assert (value, largest_grad) == (0.0, 0.0), f"rank {rank} {name}"
    params, data = make_data(7, 5, 2)
    for kind in ("clip", "supcon_views"):
        negatives = negatives_for(params, data["x_negative"]) if kind == "clip" else None
        expected, expected_grads = value_and_grads(reference_weighted_mean(kind, params, data, negatives), params)
        members = [per_rank[rank][f"group {kind}"] for rank in (0, 2)]
        _close(sum(value for value, _ in members) / 2, expected, f"group {kind}")
        for name, grad in expected_grads.items():
            _close(sum(grads[name] for _, grads in members) / 2, grad, f"group {kind} d/d{name}")
        assert f"group {kind}" not in per_rank[1]
