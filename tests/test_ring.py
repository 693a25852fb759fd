"""Ring mode (``communication="ring"``) on real gloo processes: exact like gather mode, uneven and empty ranks.

Each worker call checks many cases (spawning costs seconds): for every loss, shard layout and
option, the mean of the per-rank losses and the DDP-averaged gradients (features through the
encoder, ``logit_scale``, ``logit_bias``) must equal the float64 single-process loop reference
within 1e-10 and equal gather mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import pytest
import torch
import torch.distributed as dist
from outcomes import error_outcomes
from test_losses_reference import (
    KINDS,
    assert_close,
    encode,
    make_problem,
    package_loss,
    reference_loss,
    value_and_grads,
)
from torch import Tensor

from contrastive_dist import (
    DistributedInfoNCE,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    info_nce,
    nt_xent,
    siglip,
    supcon,
)
from contrastive_dist.testing import WorkerPool

SHARDS: dict[int, list[tuple[int, ...]]] = {
    1: [(7,)],
    2: [(1, 7), (0, 2)],
    3: [(5, 0, 3), (0, 0, 2)],
    4: [(4, 4, 4, 4), (2, 0, 3, 1)],
    8: [(3, 0, 2, 0, 0, 1, 4, 0)],
}
Case = tuple[str, tuple[int, ...], str, int | None, bool]
Result = tuple[Tensor, dict[str, Tensor]]


def _cases(world_size: int) -> list[Case]:
    cases: list[Case] = []
    for index, shards in enumerate(SHARDS[world_size]):
        for kind in KINDS:
            # chunk_size on (2: several chunks per block) and off; sizes given and exchanged.
            if index == 0:
                cases.append((kind, shards, "float64", None, False))
            cases.append((kind, shards, "float64", 2, index == 0))
    cases += [(kind, SHARDS[world_size][0], "float32", 3, False) for kind in ("clip", "siglip")]
    return cases


def _local(data: dict[str, Tensor], shards: tuple[int, ...], rank: int) -> dict[str, Tensor]:
    start = sum(shards[:rank])
    return {name: tensor[start : start + shards[rank]] for name, tensor in data.items()}


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> list[tuple[Result, Result]]:
    """Ring mode and gather mode on the same inputs, for every case."""
    results = []
    for seed, (kind, shards, dtype_name, chunk_size, pass_sizes) in enumerate(cases):
        both = []
        for communication in ("ring", "gather"):
            params, data = make_problem(seed=seed, total=sum(shards), dtype=getattr(torch, dtype_name))
            local = _local(data, shards, rank)
            sizes = shards if pass_sizes else None
            loss = package_loss(kind, params, local, chunk_size, sizes, communication=communication)
            both.append(value_and_grads(loss, params))
        results.append((both[0], both[1]))
    return results


@cache
def _reference(kind: str, seed: int, total: int) -> Result:
    params, data = make_problem(seed=seed, total=total, dtype=torch.float64)
    return value_and_grads(reference_loss(kind, params, data), params)


def _mean_over_ranks(per_rank: list[Result]) -> Result:
    """The mean loss and the DDP-averaged gradients (sum over ranks / W)."""
    world_size = len(per_rank)
    loss = sum(result[0].double() for result in per_rank) / world_size
    grads = {name: sum(result[1][name].double() for result in per_rank) / world_size for name in per_rank[0][1]}
    return loss, grads  # type: ignore[return-value]


def _check(cases: list[Case], per_rank: list[list[tuple[Result, Result]]]) -> None:
    for index, (kind, shards, dtype_name, chunk_size, pass_sizes) in enumerate(cases):
        what = f"{kind} shards={shards} {dtype_name} chunk={chunk_size} sizes={pass_sizes}"
        dtype = getattr(torch, dtype_name)
        ring = _mean_over_ranks([result[index][0] for result in per_rank])
        gather = _mean_over_ranks([result[index][1] for result in per_rank])
        expected = _reference(kind, index, sum(shards))
        assert_close(ring[0], expected[0], dtype, f"ring {what}")
        assert_close(ring[0], gather[0], dtype, f"ring vs gather {what}")
        for name, expected_grad in expected[1].items():
            assert_close(ring[1][name], expected_grad, dtype, f"ring {what} d/d{name}")
            assert_close(ring[1][name], gather[1][name], dtype, f"ring vs gather {what} d/d{name}")
        for rank, result in enumerate(per_rank):  # the per-rank shares too, not only their mean
            assert_close(result[index][0][0].double(), result[index][1][0].double(), dtype, f"{what} rank {rank}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_ring_equals_single_process_reference_and_gather_mode(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    cases = _cases(world_size)
    if world_size == 1:  # no process group: the same kernel with no transfer at all
        _check(cases, [_run_cases(0, 1, cases)])
        return
    _check(cases, pool(world_size).run(_run_cases, cases, timeout=120))


def _edge_cases(rank: int, world_size: int) -> dict[str, object]:
    """W = 4: an empty global batch, a subgroup of ranks {0, 2, 3} (rank 1 stays out), a frozen tower."""
    outcome: dict[str, object] = {}
    params, data = make_problem(seed=3, total=0, dtype=torch.float64)
    for kind in KINDS:
        loss = package_loss(kind, params, data, 2, None, communication="ring")
        value, grads = value_and_grads(loss, params)
        outcome[f"empty {kind}"] = (float(value), max(float(g.abs().max()) for g in grads.values()))
    members, shards = [0, 2, 3], (2, 0, 5)
    group = dist.new_group(members)
    if rank in members:
        params, data = make_problem(seed=4, total=sum(shards), dtype=torch.float64)
        local = _local(data, shards, members.index(rank))
        for kind in KINDS:
            loss = package_loss(kind, params, local, 2, None, communication="ring", group=group)
            outcome[f"group {kind}"] = value_and_grads(loss, params)
    dist.destroy_process_group(group)
    # A frozen tower (LiT locks the image tower): the side without gradient sends no accumulator.
    shards = (3, 0, 4, 1)
    params, data = make_problem(seed=5, total=sum(shards), dtype=torch.float64)
    local = _local(data, shards, rank)
    for frozen in ("image", "text"):
        for communication in ("ring", "gather"):
            for kind in ("clip", "clip_one_way", "siglip"):
                images, texts = encode(params, local)
                images, texts = (images.detach(), texts) if frozen == "image" else (images, texts.detach())
                scale, options = params["log_scale"].exp(), {"chunk_size": 2, "communication": communication}
                if kind == "siglip":
                    loss = siglip(images, texts, scale, params["bias"], **options)  # type: ignore[arg-type]
                else:
                    loss = info_nce(images, texts, scale, symmetric=kind == "clip", **options)  # type: ignore[arg-type]
                outcome[f"frozen {frozen} {kind} {communication}"] = value_and_grads(loss, params)
    return outcome


def test_empty_global_batch_subgroup_and_frozen_tower(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(4).run(_edge_cases, timeout=60)
    for rank, outcome in enumerate(per_rank):
        for kind in KINDS:
            assert outcome[f"empty {kind}"] == (0.0, 0.0), f"rank {rank} {kind}"
    for kind in KINDS:
        members = [per_rank[rank][f"group {kind}"] for rank in (0, 2, 3)]
        params, data = make_problem(seed=4, total=7, dtype=torch.float64)
        expected, expected_grads = value_and_grads(reference_loss(kind, params, data), params)
        loss, grads = _mean_over_ranks(members)  # type: ignore[arg-type]
        assert_close(loss, expected, torch.float64, f"group {kind}")
        for name, expected_grad in expected_grads.items():
            assert_close(grads[name], expected_grad, torch.float64, f"group {kind} d/d{name}")
        assert f"group {kind}" not in per_rank[1]
    for frozen in ("image", "text"):
        for kind in ("clip", "clip_one_way", "siglip"):
            what = f"frozen {frozen} {kind}"
            ring = _mean_over_ranks([outcome[f"{what} ring"] for outcome in per_rank])  # type: ignore[misc]
            gather = _mean_over_ranks([outcome[f"{what} gather"] for outcome in per_rank])  # type: ignore[misc]
            assert_close(ring[0], gather[0], torch.float64, what)
            for name, grad in gather[1].items():
                assert_close(ring[1][name], grad, torch.float64, f"{what} d/d{name}")
            frozen_weight = "w_image" if frozen == "image" else "w_text"
            assert not ring[1][frozen_weight].any(), what


def _bad_input_on_rank_one(rank: int, world_size: int) -> dict[str, tuple[str, str] | float]:
    bad = rank == 1
    good, labels = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    ring = {"communication": "ring"}
    calls: dict[str, Callable[[], object]] = {
        "info_nce rows": lambda: info_nce(good, good[:3] if bad else good, **ring),  # type: ignore[arg-type]
        "info_nce communication": lambda: info_nce(good, good, communication="rung" if bad else "ring"),  # type: ignore[arg-type]
        "info_nce scale": lambda: info_nce(good, good, -1.0 if bad else 2.0, **ring),  # type: ignore[arg-type]
        "nt_xent dims": lambda: nt_xent(good, good[:, :5] if bad else good, **ring),  # type: ignore[arg-type]
        "siglip dtype": lambda: siglip(good, good.double() if bad else good, 2.0, -1.0, **ring),  # type: ignore[arg-type]
        "supcon labels": lambda: supcon(good, labels[:3] if bad else labels, **ring),  # type: ignore[arg-type]
        "supcon disagree": lambda: supcon(good[:, :5] if bad else good, labels, **ring),  # type: ignore[arg-type]
        # With sizes= too: ring mode still exchanges, so a rank that stops never leaves a neighbour waiting.
        "nt_xent scale sizes": lambda: nt_xent(good, good, -1.0 if bad else 2.0, sizes=(4, 4, 4), **ring),  # type: ignore[arg-type]
        "siglip promised sizes": lambda: siglip(
            good[:3] if bad else good, good[:3] if bad else good, 2.0, -1.0, sizes=(4, 4, 4), **ring
        ),  # type: ignore[arg-type]
    }
    outcome: dict[str, tuple[str, str] | float] = {**error_outcomes(calls)}
    outcome["after"] = float(info_nce(good, good, communication="ring"))  # the group still works
    return outcome


def test_bad_input_on_one_rank_raises_on_every_rank(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_bad_input_on_rank_one, timeout=20, return_exceptions=True)
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        for name, result in outcome.items():
            if name == "after":
                assert math.isfinite(result), rank  # type: ignore[arg-type]
                continue
            kind, message = result  # type: ignore[misc]
            expected_kind = "TypeError" if "dtype" in name else "ValueError"
            assert kind == expected_kind, f"rank {rank} {name}: {kind} {message}"
            if name == "supcon disagree":  # no rank is wrong alone: the inputs disagree
                assert "do not agree" in message, message
            elif name == "siglip promised sizes":
                assert "sizes=(4, 4, 4) was given, but the ranks hold (4, 3, 4) rows" in message, message
            else:
                assert "(on rank 1;" in message, f"rank {rank} {name}: {message}"
            assert outcome[name] == per_rank[1][name], f"rank {rank} {name}: not the same error as rank 1"
    assert "('gather', 'ring')" in per_rank[0]["info_nce communication"][1]  # type: ignore[index]


def test_modules_hold_communication_and_reject_unknown_modes() -> None:
    generator = torch.Generator().manual_seed(0)
    images, texts = torch.randn(5, 8, generator=generator), torch.randn(5, 8, generator=generator)
    labels = torch.tensor([0, 1, 0, 1, 2])
    scale, bias = torch.tensor(5.0), torch.tensor(-2.0)
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
