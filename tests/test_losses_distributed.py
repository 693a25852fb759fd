"""The gradient contract for every loss, in both communication modes, on real gloo processes.

One matrix: every loss, uneven shards with empty ranks, W up to 8, chunked or not, ``sizes=``
given or not, plain / weighted means and per-row losses, InfoNCE's own and shared negatives.
Sample ids (with duplicates inside and across ranks) under ``same_id="mask"`` and ``"positive"``,
negatives with ids. Every rank's value (or the ranks' rows in rank order) and the
DDP-averaged gradients of the encoder weights (hence the features), ``logit_scale`` and
``logit_bias`` — and each rank's own negatives — equal the plain float64 loop reference of the
whole global batch, written with explicit masks.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from loss_references import (
    GRAM_KINDS,
    ID_KINDS,
    KINDS,
    MODES,
    REGISTRY,
    assert_close,
    encode,
    make_problem,
    objective,
    own_negatives,
    package_value,
    reference_value,
    value_and_grads,
)
from outcomes import error_outcomes
from routes import ROUTES, on_route
from torch import Tensor, nn

from contrastive_dist import DistributedInfoNCE, SharedNegatives, info_nce, nt_xent, retrieval_accuracy, siglip, supcon
from contrastive_dist.losses import _same_key, _tiles
from contrastive_dist.losses._options import PRODUCTS_VARIABLE
from contrastive_dist.testing import WorkerPool

COMMUNICATIONS = ("gather", "ring")
# (shards, own negatives' shards): uneven, with empty ranks in both.
LAYOUTS: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {
    1: [((7,), (3,))],
    2: [((1, 7), (2, 0)), ((0, 2), (0, 3))],
    3: [((5, 0, 3), (0, 3, 1)), ((0, 0, 2), (1, 0, 0))],
    4: [((3, 3, 3, 3), (1, 0, 2, 0)), ((2, 0, 1, 1), (0, 2, 0, 1))],
    8: [((3, 0, 2, 0, 0, 1, 4, 0), (1, 0, 0, 2, 0, 0, 1, 0))],
}
Case = tuple[str, str, str, tuple[int, ...], tuple[int, ...], str, int | None, bool, str]
"""(kind, mode, negatives "" / "own" / "shared", shards, negative shards, dtype, chunk_size, sizes given,
same_id "" (no ids) / "mask" / "positive")."""


def cases(world_size: int) -> list[Case]:
    out: list[Case] = []
    for index, (shards, negative_shards) in enumerate(LAYOUTS[world_size]):
        # W = 8 keeps one chunk size: eight processes on a small machine.
        chunks = (2,) if world_size == 8 else (None, 2)
        for kind in KINDS:
            for same_id in ("", "mask", "positive") if kind in ID_KINDS else ("",):
                for mode in MODES:
                    negatives = ("", "own", "shared") if REGISTRY[kind].negatives and mode != "mean" else ("",)
                    for negative_kind in negatives:
                        for chunk in chunks:
                            sizes_given = (index + len(out)) % 2 == 0
                            case = (kind, mode, negative_kind, shards, negative_shards, "float64", chunk, sizes_given)
                            out.append((*case, same_id))
        if index == 0:
            out += [(kind, "mean", "", shards, negative_shards, "float32", 3, False, "") for kind in KINDS]
    return out


def _slice(tensor: Tensor, shards: tuple[int, ...], rank: int) -> Tensor:
    start = sum(shards[:rank])
    return tensor[start : start + shards[rank]]


def _negatives(kind: str, params: dict[str, Tensor], data: dict[str, Tensor], same_id: str) -> tuple[Any, Any]:
    """The negatives of a case and their ids (given with ids, every other case)."""
    negatives = {"": None, "own": own_negatives(params, data["x_negative"]), "shared": SharedNegatives(data["shared"])}
    ids = {"": None, "own": data["negative_ids"], "shared": data["shared_ids"]}[kind] if same_id else None
    return negatives[kind], ids


def _local(data: dict[str, Tensor], shards: tuple[int, ...], negative_shards: tuple[int, ...], rank: int) -> dict:
    local = {name: _slice(tensor, shards, rank) for name, tensor in data.items()}
    local.update(x_negative=_slice(data["x_negative"], negative_shards, rank), shared=data["shared"],
                 negative_ids=_slice(data["negative_ids"], negative_shards, rank), shared_ids=data["shared_ids"])
    return local


def run_cases(rank: int, world_size: int, communication: str, all_cases: list[Case]) -> list[tuple[Tensor, dict]]:
    results = []
    kept = _same_key.SPARSE_AT_MOST, _tiles.MIN_DIM, _tiles.RING_MIN_DIM, _tiles.ONE_PROCESS
    try:
        for seed, case in enumerate(all_cases):
            # Pairs that share a key (ids, labels): as indices in one case, as a mask in the next (_same_key);
            # Gram losses: by tiles in two cases of four, whatever their width and world size (both modes).
            _same_key.SPARSE_AT_MOST = 1.0 if seed % 2 == 0 else -1.0
            _tiles.MIN_DIM, _tiles.RING_MIN_DIM, _tiles.ONE_PROCESS = (0, 0, False) if seed % 4 < 2 else kept[1:]
            results.append(_run_case(seed, case, rank, communication))
    finally:
        _same_key.SPARSE_AT_MOST, _tiles.MIN_DIM, _tiles.RING_MIN_DIM, _tiles.ONE_PROCESS = kept
    return results


def _run_case(seed: int, case: Case, rank: int, communication: str) -> tuple[Tensor, dict]:
    kind, mode, negatives_kind, shards, negative_shards, dtype, chunk, sizes_given, same_id = case
    params, data = make_problem(seed, sum(shards), getattr(torch, dtype), negatives=sum(negative_shards))
    local = _local(data, shards, negative_shards, rank)
    negatives, negative_ids = _negatives(negatives_kind, params, local, same_id)
    inputs = dict(params, negatives=negatives) if negatives_kind == "own" else dict(params)
    value = package_value(kind, mode, params, local, chunk_size=chunk, sizes=shards if sizes_given else None,
                          communication=communication, negatives=negatives, same_id=same_id,
                          negative_ids=negative_ids)
    return value.detach(), value_and_grads(objective(value, mode, local["upstream"]), inputs)[1]


def _expected(seed: int, case: Case) -> tuple[Tensor, dict[str, Tensor]]:
    kind, mode, negatives_kind, shards, negative_shards, _, _, _, same_id = case
    params, data = make_problem(seed, sum(shards), torch.float64, negatives=sum(negative_shards))
    negatives, negative_ids = _negatives(negatives_kind, params, data, same_id)
    inputs = dict(params, negatives=negatives) if negatives_kind == "own" else dict(params)
    columns = negatives.keys if negatives_kind == "shared" else negatives
    value = reference_value(kind, mode, params, data, columns, same_id, negative_ids)
    return value.detach(), value_and_grads(objective(value, mode, data["upstream"]), inputs)[1]


def check(world_size: int, all_cases: list[Case], per_rank: list[list[tuple[Tensor, dict]]]) -> None:
    for seed, case in enumerate(all_cases):
        kind, mode, negatives_kind, shards, negative_shards, dtype_name, _, _, _ = case
        what, dtype = f"W={world_size} {case}", getattr(torch, dtype_name)
        expected, expected_grads = _expected(seed, case)
        # A mean: every rank returns the global loss, with its share's gradient, and DDP averages the
        # gradients. Rows: the ranks' rows in rank order are the global rows, and the objective Σ u_i ℓ_i
        # is their sum.
        divisor = 1 if mode == "none" else world_size
        values = [result[seed][0].double() for result in per_rank]
        for rank, value in enumerate([torch.cat(values)] if mode == "none" else values):
            assert_close(value, expected, dtype, f"{what} rank {rank}")
        for name, grad in expected_grads.items():
            if name == "negatives":  # each rank holds its own negatives' gradient: Σ over ranks' losses
                for rank, result in enumerate(per_rank):
                    expected_own = _slice(grad, negative_shards, rank) * (1 if mode == "none" else world_size)
                    assert_close(result[seed][1][name], expected_own, dtype, f"{what} rank {rank} d/dnegatives")
                continue
            averaged = sum(result[seed][1][name].double() for result in per_rank) / divisor
            assert_close(averaged, grad, dtype, f"{what} d/d{name}")


@pytest.mark.parametrize("communication", COMMUNICATIONS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_loss_equals_the_single_process_reference(
    pool: Callable[[int], WorkerPool], world_size: int, communication: str
) -> None:
    all_cases = cases(world_size)
    if world_size == 1:  # no process group: the plain single-process loss
        check(1, all_cases, [run_cases(0, 1, communication, all_cases)])
        return
    check(world_size, all_cases, pool(world_size).run(run_cases, communication, all_cases, timeout=300))




def _ring_tiles(rank: int, world_size: int) -> dict[str, Any]:
    """The Gram losses in ring mode by pairs of tiles, weighted and per row: on every rank, an empty batch, a subgroup.

    Returns each call's value and gradients, and which calls took the tiles.
    """
    taken = _tiles.states
    kept, formed = _tiles.RING_MIN_DIM, []
    outcome: dict[str, Any] = {}
    members, group_shards = [0, 2], (2, 5)
    group = dist.new_group(members)
    try:
        _tiles.RING_MIN_DIM = 0  # whatever the width
        for kind in GRAM_KINDS:
            _tiles.states = lambda *args, kind=kind: (formed.append(kind), taken(*args))[1]
            for name, shards, where in (("ranks", (3, 0, 4), None), ("empty", (0, 0, 0), None),
                                        ("group", group_shards, group)):  # fmt: skip
                if where is not None and rank not in members:
                    continue
                params, data = make_problem(7, sum(shards), torch.float64)
                at = rank if where is None else members.index(rank)
                local = {key: _slice(tensor, shards, at) for key, tensor in data.items()}
                for mode in ("weighted", "none"):
                    value = package_value(kind, mode, params, local, chunk_size=2, communication="ring", group=where)
                    _, grads = value_and_grads(objective(value, mode, local["upstream"]), params)
                    outcome[f"{name} {kind} {mode}"] = (value.detach(), grads)
    finally:
        _tiles.states = taken
        _tiles.RING_MIN_DIM = kept
        dist.destroy_process_group(group)
    outcome["formed"] = formed
    return outcome


def test_gram_losses_in_ring_mode_take_their_tiles(pool: Callable[[int], WorkerPool]) -> None:
    # Ring mode's NT-Xent, SupCon and DCL form each pair of tiles once (losses/_tiles.py), weighted and per
    # row, as in two cases of four of the matrix above; here every call does, on 3 ranks (one empty), with an
    # empty global batch, and on a subgroup of ranks {0, 2}.
    per_rank = pool(3).run(_ring_tiles, timeout=120)
    for rank, outcome in enumerate(per_rank):
        calls = 6 if rank in (0, 2) else 4
        taken = Counter(outcome["formed"])  # every call took its tiles (HCL: both of its passes)
        assert set(taken) == set(GRAM_KINDS) and all(taken[kind] >= calls for kind in GRAM_KINDS), (rank, taken)
    for kind in GRAM_KINDS:
        for name, members, total in (("ranks", (0, 1, 2), 7), ("empty", (0, 1, 2), 0), ("group", (0, 2), 7)):
            params, data = make_problem(7, total, torch.float64)
            for mode in ("weighted", "none"):
                reference = reference_value(kind, mode, params, data)
                expected, expected_grads = value_and_grads(objective(reference, mode, data["upstream"]), params)
                what = f"{name} {kind} {mode}"
                results = [per_rank[rank][what] for rank in members]
                values = [value for value, _ in results]
                divisor = 1 if mode == "none" else len(members)
                if mode == "none":  # the ranks' rows in rank order are the global rows
                    assert_close(torch.cat(values), reference.detach(), torch.float64, what)
                else:
                    assert_close(sum(values) / divisor, expected, torch.float64, what)
                for key, grad in expected_grads.items():
                    averaged = sum(grads[key] for _, grads in results) / divisor
                    assert_close(averaged, grad, torch.float64, f"{what} d/d{key}")


@pytest.mark.parametrize("route", ROUTES)
def test_gather_mode_on_both_transport_routes(pool: Callable[[int], WorkerPool], route: str) -> None:
    # The accelerator routes (all_gather_single, reduce_scatter_single, uneven all_to_all) on gloo.
    all_cases = [case for case in cases(3) if case[2] != "shared"][::3]
    check(3, all_cases, pool(3).run(on_route, route, run_cases, "gather", all_cases, timeout=240))


def _edge_cases(rank: int, world_size: int, communication: str) -> dict[str, Any]:
    """W = 4: an empty global batch, a subgroup of ranks {0, 2, 3} (rank 1 stays out), frozen towers."""
    outcome: dict[str, Any] = {}
    params, data = make_problem(3, 0, torch.float64, negatives=rank % 2)
    for kind in KINDS:
        for mode in MODES:
            negatives = own_negatives(params, data["x_negative"]) if REGISTRY[kind].negatives else None
            value = package_value(kind, mode, params, data, chunk_size=2, communication=communication,
                                  negatives=negatives)
            _, grads = value_and_grads(value.sum(), params)
            largest = max(float(grad.abs().max()) for grad in grads.values())
            outcome[f"empty {kind} {mode}"] = (tuple(value.shape), float(value.sum()), largest)
    members, shards = [0, 2, 3], (2, 0, 5)
    group = dist.new_group(members)
    if rank in members:
        params, data = make_problem(4, sum(shards), torch.float64)
        local = {name: _slice(tensor, shards, members.index(rank)) for name, tensor in data.items()}
        for kind in KINDS:
            value = package_value(kind, "weighted", params, local, chunk_size=2, communication=communication,
                                  group=group)
            outcome[f"group {kind}"] = value_and_grads(value, params)
    dist.destroy_process_group(group)
    # Ids beyond float32's integers on one rank only: every rank compares them as integers alike.
    shards = (2, 3, 1, 2)
    params, data = make_problem(6, sum(shards), torch.float64)
    local = {name: _slice(tensor, shards, rank) for name, tensor in data.items()}
    if rank == 1:
        local["ids"] = local["ids"] + 2**40 * (local["ids"] % 2)  # the reference gets the same ids
    for kind in ID_KINDS:
        options = {"chunk_size": 2, "communication": communication, "same_id": "positive"}
        value = package_value(kind, "mean", params, local, **options)  # type: ignore[arg-type]
        outcome[f"large ids {kind}"] = value_and_grads(value, params)
    # A frozen tower (LiT locks the image tower): the side without gradient sends no accumulator.
    shards = (3, 0, 4, 1)
    params, data = make_problem(5, sum(shards), torch.float64)
    local = {name: _slice(tensor, shards, rank) for name, tensor in data.items()}
    for frozen in ("image", "text"):
        for kind in ("clip", "clip_one_way", "siglip"):
            images, texts = encode(params, local)
            images, texts = (images.detach(), texts) if frozen == "image" else (images, texts.detach())
            scale, options = params["log_scale"].exp(), {"chunk_size": 2, "communication": communication}
            if kind == "siglip":
                loss = siglip(images, texts, scale, params["bias"], **options)  # type: ignore[arg-type]
            else:
                loss = info_nce(images, texts, scale, symmetric=kind == "clip", **options)  # type: ignore[arg-type]
            outcome[f"frozen {frozen} {kind}"] = value_and_grads(loss, params)
    return outcome


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_empty_global_batch_subgroup_and_frozen_towers(pool: Callable[[int], WorkerPool], communication: str) -> None:
    per_rank = pool(4).run(_edge_cases, communication, timeout=120)
    for rank, outcome in enumerate(per_rank):
        for name in (name for name in outcome if name.startswith("empty")):
            shape, value, largest_grad = outcome[name]
            assert shape[0] == 0 if " none" in name else shape == (), f"rank {rank} {name}: {shape}"
            assert (value, largest_grad) == (0.0, 0.0), f"rank {rank} {name}"
    for kind in KINDS:
        params, data = make_problem(4, 7, torch.float64)
        expected, expected_grads = value_and_grads(reference_value(kind, "weighted", params, data), params)
        members = [per_rank[rank][f"group {kind}"] for rank in (0, 2, 3)]
        assert_close(sum(value for value, _ in members) / 3, expected, torch.float64, f"group {kind}")
        for name, grad in expected_grads.items():
            assert_close(sum(grads[name] for _, grads in members) / 3, grad, torch.float64, f"group {kind} d/d{name}")
        assert f"group {kind}" not in per_rank[1]
    params, data = make_problem(6, 8, torch.float64)
    data["ids"][2:5] += 2**40 * (data["ids"][2:5] % 2)
    for kind in ID_KINDS:
        reference = reference_value(kind, "mean", params, data, None, "positive")
        expected, expected_grads = value_and_grads(reference, params)
        results, what = [outcome[f"large ids {kind}"] for outcome in per_rank], f"large ids {kind}"
        assert_close(sum(value for value, _ in results) / 4, expected, torch.float64, what)
        for name, grad in expected_grads.items():
            assert_close(sum(grads[name] for _, grads in results) / 4, grad, torch.float64, f"{what} d/d{name}")
    params, data = make_problem(5, 8, torch.float64)
    for frozen in ("image", "text"):
        for kind in ("clip", "clip_one_way", "siglip"):
            images, texts = encode(params, data)
            images, texts = (images.detach(), texts) if frozen == "image" else (images, texts.detach())
            scale = params["log_scale"].exp()
            if kind == "siglip":
                reference = siglip(images, texts, scale, params["bias"])
            else:
                reference = info_nce(images, texts, scale, symmetric=kind == "clip")
            expected, expected_grads = value_and_grads(reference, params)
            what = f"frozen {frozen} {kind}"
            results = [outcome[what] for outcome in per_rank]
            assert_close(sum(value for value, _ in results) / 4, expected, torch.float64, what)
            for name, grad in expected_grads.items():
                assert_close(sum(grads[name] for _, grads in results) / 4, grad, torch.float64, f"{what} d/d{name}")


def _bad_input_on_rank_one(rank: int, world_size: int, communication: str) -> dict[str, tuple[str, str] | float]:
    bad = rank == 1
    good, labels, ones = F.normalize(torch.randn(4, 8), dim=-1), torch.tensor([0, 1, 0, 1]), torch.ones(4)
    mode: dict[str, Any] = {"communication": communication}
    negative_dtype = torch.float64 if bad else torch.float32
    ids, shared = {"ids": labels}, torch.ones(2, 8)  # shared negatives: the same keys on every rank
    calls: dict[str, Callable[[], object]] = {
        "info_nce rows": lambda: info_nce(good, good[:3] if bad else good, **mode),
        "info_nce one-way ndim": lambda: info_nce(good[0] if bad else good, good[0] if bad else good,
                                                  symmetric=False, **mode),
        "info_nce scale": lambda: info_nce(good, good, -1.0 if bad else 2.0, **mode),
        "info_nce communication": lambda: info_nce(good, good, communication="rung" if bad else communication),
        "nt_xent dims": lambda: nt_xent(good, good[:, :5] if bad else good, **mode),
        "nt_xent scale with sizes": lambda: nt_xent(good, good, -1.0 if bad else 2.0, sizes=(4, 4, 4), **mode),
        "siglip rows": lambda: siglip(good, good[:3] if bad else good, 2.0, -1.0, chunk_size=2, **mode),
        "siglip dtype": lambda: siglip(good, good.double() if bad else good, 2.0, -1.0, **mode),
        "supcon labels": lambda: supcon(good, labels[:3] if bad else labels, **mode),
        "supcon ndim": lambda: supcon(good[0] if bad else good, labels, **mode),
        "retrieval rows": lambda: retrieval_accuracy(good, good[:3] if bad else good),
        "negatives width": lambda: info_nce(good, good, negatives=torch.randn(2, 3 if bad else 8), **mode),
        "negatives dtype": lambda: info_nce(good, good, negatives=torch.randn(2, 8, dtype=negative_dtype), **mode),
        "shared negatives width": lambda: info_nce(
            good, good, negatives=SharedNegatives(torch.randn(3, 4 if bad else 8)), **mode
        ),
        "weight length": lambda: info_nce(good, good, weight=ones[:3] if bad else ones, **mode),
        "weight negative": lambda: nt_xent(good, good, weight=-ones if bad else ones, **mode),
        "weight nan": lambda: siglip(good, good, 2.0, -1.0, weight=ones * math.nan if bad else ones, **mode),
        "weight inf": lambda: supcon(good, labels, weight=ones * math.inf if bad else ones, **mode),
        "weight dtype": lambda: supcon(good, labels, weight=ones.bool() if bad else ones, **mode),
        "weight with none": lambda: info_nce(good, good, weight=ones, reduction="none" if bad else "mean", **mode),
        "reduction": lambda: nt_xent(good, good, reduction="sum" if bad else "mean", **mode),
        "ids dtype": lambda: info_nce(good, good, ids=labels.int() if bad else labels, **mode),
        "ids length": lambda: siglip(good, good, 2.0, -1.0, ids=labels[:3] if bad else labels, **mode),
        "same_id": lambda: nt_xent(good, good, ids=labels, same_id="both" if bad else "mask", **mode),  # type: ignore[arg-type]
        "negative_ids without negatives": lambda: info_nce(
            good, good, negatives=None if bad else torch.randn(2, 8), negative_ids=labels[:2], **mode, **ids
        ),
        "negative_ids without ids": lambda: info_nce(
            good, good, negatives=torch.randn(2, 8), negative_ids=labels[:2], **mode, **({} if bad else ids)
        ),
        "shared negative_ids without ids": lambda: info_nce(
            good, good, negatives=SharedNegatives(shared), negative_ids=labels[:2], **mode, **({} if bad else ids)
        ),
        "negative_ids length": lambda: info_nce(
            good, good, negatives=torch.randn(2, 8), negative_ids=labels[:3] if bad else labels[:2], **mode, **ids
        ),
    }
    # No rank is wrong alone: the ranks disagree. Each would otherwise hang or abort the transport.
    differ: dict[str, Callable[[], object]] = {
        "options: temperature": lambda: info_nce(good, good, temperature=0.1 if bad else 0.07, **mode),
        "options: symmetric": lambda: info_nce(good, good, symmetric=not bad, **mode),
        "options: communication": lambda: nt_xent(good, good, communication="gather" if bad else "ring"),
        "options: chunk_size": lambda: supcon(good, labels, chunk_size=2 if bad else None, **mode),
        "options: reduction": lambda: supcon(good, labels, reduction="none" if bad else "mean", **mode),
        "options: weight": lambda: info_nce(good, good, weight=ones if bad else None, **mode),
        "options: negatives": lambda: info_nce(good, good, negatives=torch.randn(2, 8) if bad else None, **mode),
        "options: ids": lambda: info_nce(good, good, ids=labels if bad else None, **mode),
        "options: same_id": lambda: siglip(
            good, good, 2.0, -1.0, ids=labels, same_id="positive" if bad else "mask", **mode
        ),
        "options: shared negatives": lambda: info_nce(
            good, good, negatives=SharedNegatives(torch.randn(2, 8)) if bad else torch.randn(2, 8), **mode
        ),
        "options: shared negatives count": lambda: info_nce(
            good, good, negatives=SharedNegatives(torch.ones(3 if bad else 2, 8)), **mode
        ),
        "options: shared negative_ids": lambda: info_nce(
            good, good, negatives=SharedNegatives(shared), negative_ids=labels[:2] + int(bad), **mode, **ids
        ),
        "options: shared negative_ids order": lambda: info_nce(
            good, good, negatives=SharedNegatives(shared), negative_ids=labels[:2].flip(0) if bad else labels[:2],
            **mode, **ids
        ),
        "inputs: feature width": lambda: supcon(good[:, :5] if bad else good, labels, **mode),
        "inputs: negatives gradient": lambda: info_nce(
            good, good, negatives=torch.randn(2, 8, requires_grad=bad), **mode
        ),
        "sizes: wrong on one rank": lambda: siglip(good, good, 2.0, -1.0, sizes=(4, 3, 4) if bad else (4,) * 3, **mode),
        "sizes: on one rank only": lambda: info_nce(good, good, sizes=(4, 4, 4) if bad else None, **mode),
        "sizes: promised, not held": lambda: siglip(
            good[:3] if bad else good, good[:3] if bad else good, 2.0, -1.0, sizes=(4, 4, 4), **mode
        ),
    }
    outcome: dict[str, tuple[str, str] | float] = {**error_outcomes(calls), **error_outcomes(differ)}
    outcome["after"] = float(info_nce(good, good, negatives=torch.randn(rank, 8), weight=ones, ids=labels, **mode))
    return outcome


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_bad_input_or_differing_options_raise_the_same_error_on_every_rank(
    pool: Callable[[int], WorkerPool], communication: str
) -> None:
    # Without the agreement, rank 1 fails alone and the others wait in a collective: a timeout here.
    per_rank = pool(3).run(_bad_input_on_rank_one, communication, timeout=30, return_exceptions=True)
    expected_text = {"options": "different options", "inputs": "do not agree", "sizes": "sizes="}
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert math.isfinite(outcome.pop("after"))  # type: ignore[arg-type]  # the group still works
        for name, result in outcome.items():
            kind, message = result  # type: ignore[misc]
            assert kind == ("TypeError" if "dtype" in name else "ValueError"), f"rank {rank} {name}: {kind} {message}"
            group = name.split(":")[0]
            assert expected_text.get(group, "(on rank 1;") in message, f"rank {rank} {name}: {message}"
            assert outcome[name] == per_rank[1][name], f"rank {rank} {name}: not the same error as rank 1"
    assert "('gather', 'ring')" in per_rank[0]["info_nce communication"][1]  # type: ignore[index]
    assert "different options (temperature)" in per_rank[0]["options: temperature"][1]  # type: ignore[index]
    assert "but no ids= were passed" in per_rank[0]["negative_ids without ids"][1]  # type: ignore[index]
    assert "but no ids= were passed" in per_rank[0]["shared negative_ids without ids"][1]  # type: ignore[index]
    for name in ("options: shared negatives count", "options: shared negative_ids",
                 "options: shared negative_ids order"):
        assert "different options (shared_negatives)" in per_rank[0][name][1], name  # type: ignore[index]


def _retrieval_on_ranks(rank: int, world_size: int, shards: tuple[int, ...]) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(5)
    images, texts = torch.randn(sum(shards), 6, generator=generator), torch.randn(sum(shards), 6, generator=generator)
    texts[::2] = images[::2]
    return retrieval_accuracy(_slice(images, shards, rank), _slice(texts, shards, rank), top_k=(1, 3))


@pytest.mark.parametrize("shards", [(1, 8), (5, 0, 4)])
def test_retrieval_accuracy_is_global_and_identical_on_every_rank(
    pool: Callable[[int], WorkerPool], shards: tuple[int, ...]
) -> None:
    per_rank = pool(len(shards)).run(_retrieval_on_ranks, shards)
    expected = _retrieval_on_ranks(0, 1, (sum(shards),))  # one process, whole batch
    for result in per_rank:
        assert result.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result[name], value), name


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(6, 5), nn.Linear(4, 5)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.1)))

    def forward(self, x_image: Tensor, x_text: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return F.normalize(self.image(x_image), dim=-1), F.normalize(self.text(x_text), dim=-1), self.logit_scale.exp()


STEP_SHARDS = ((3, 2, 1), (0, 4, 2), (2, 2, 2), (5, 1, 0), (1, 0, 5))


def _training_data() -> tuple[_TwoTower, list[tuple[Tensor, Tensor]]]:
    torch.manual_seed(11)
    model = _TwoTower().double()
    batches = [(torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)) for _ in STEP_SHARDS]
    return model, batches


def _train_ddp(rank: int, world_size: int, communication: str) -> dict[str, Tensor]:
    model, batches = _training_data()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    criterion = DistributedInfoNCE(chunk_size=2, communication=communication)  # type: ignore[arg-type]
    for step, (shards, (x_image, x_text)) in enumerate(zip(STEP_SHARDS, batches, strict=True)):
        images, texts, scale = ddp(_slice(x_image, shards, rank), _slice(x_text, shards, rank))
        optimizer.zero_grad()
        criterion(images, texts, scale, sizes=shards if step % 2 else None).backward()
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_ddp_training_with_uneven_and_empty_shards_matches_single_process(
    pool: Callable[[int], WorkerPool], communication: str
) -> None:
    per_rank = pool(3).run(_train_ddp, communication, timeout=120)
    model, batches = _training_data()
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x_image, x_text in batches:
        optimizer.zero_grad()
        info_nce(*model(x_image, x_text)).backward()  # one process: the plain loss
        optimizer.step()
    for name, param in model.named_parameters():
        assert not torch.allclose(param, initial[name]), f"{name} did not move"
        for rank, params in enumerate(per_rank):
            torch.testing.assert_close(params[name], param.detach(), rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}")


def _both_routes(rank: int, world_size: int, communication: str) -> list[dict[str, tuple[Tensor, dict]]]:
    shards, results = (3, 0, 4), []
    for kind in ("clip", "siglip", "supcon_views"):
        routes = {}
        for products in ("full", "half"):
            os.environ[PRODUCTS_VARIABLE] = products
            params, data = make_problem(9, sum(shards), torch.bfloat16)
            local = {name: _slice(tensor, shards, rank) for name, tensor in data.items()}
            value = package_value(kind, "weighted", params, local, chunk_size=2, communication=communication)
            routes[products] = value_and_grads(value, params)
        results.append(routes)
    del os.environ[PRODUCTS_VARIABLE]
    return results


@pytest.mark.parametrize("communication", COMMUNICATIONS)
def test_bf16_features_on_the_half_products_route(pool: Callable[[int], WorkerPool], communication: str) -> None:
    # CUDA's route for bf16 features (half operands, float32 results and state), forced on gloo,
    # against the upcast route on the same bf16 features: the same loss; gradients to bf16's rounding.
    per_rank = pool(3).run(_both_routes, communication, timeout=60)
    for index, kind in enumerate(("clip", "siglip", "supcon_views")):
        full = [result[index]["full"] for result in per_rank]
        half = [result[index]["half"] for result in per_rank]
        assert_close(sum(v for v, _ in half) / 3, sum(v for v, _ in full) / 3, torch.float32, kind)
        for name in full[0][1]:
            expected = sum(grads[name].double() for _, grads in full) / 3
            actual = sum(grads[name].double() for _, grads in half) / 3
            scale = expected.abs().max().item()
            torch.testing.assert_close(actual, expected, rtol=2**-6, atol=2**-6 * scale, msg=f"{kind} d/d{name}")
