"""The gradient contract for every loss on real gloo processes, uneven shards and empty ranks included."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from outcomes import error_outcomes
from routes import ROUTES, on_route
from test_losses_reference import (
    KINDS,
    assert_close,
    clip_reference,
    make_problem,
    package_loss,
    reference_loss,
    value_and_grads,
)
from torch import Tensor, nn

from contrastive_dist import DistributedInfoNCE, info_nce, nt_xent, retrieval_accuracy, siglip, supcon
from contrastive_dist.testing import WorkerPool

SHARDS: dict[int, list[tuple[int, ...]]] = {
    1: [(8,)],
    2: [(1, 7), (0, 2)],
    3: [(5, 0, 3)],
    4: [(3, 3, 3, 3), (2, 0, 1, 1)],
}
Case = tuple[str, tuple[int, ...], str, int | None, bool]


def _cases(world_size: int) -> list[Case]:
    cases: list[Case] = []
    for index, shards in enumerate(SHARDS[world_size]):
        for kind in KINDS:
            for chunk_size, pass_sizes in ((None, index % 2 == 0), (2, index % 2 == 1), (64, True)):
                cases.append((kind, shards, "float64", chunk_size, pass_sizes))
            cases.append((kind, shards, "float32", 3, False))
    return cases


def _local(data: dict[str, Tensor], shards: tuple[int, ...], rank: int) -> dict[str, Tensor]:
    start = sum(shards[:rank])
    return {name: tensor[start : start + shards[rank]] for name, tensor in data.items()}


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> list[tuple[Tensor, dict[str, Tensor]]]:
    results: list[tuple[Tensor, dict[str, Tensor]]] = []
    for kind, shards, dtype_name, chunk_size, pass_sizes in cases:
        params, data = make_problem(seed=len(results), total=sum(shards), dtype=getattr(torch, dtype_name))
        loss = package_loss(kind, params, _local(data, shards, rank), chunk_size, shards if pass_sizes else None)
        results.append(value_and_grads(loss, params))
    return results


def _retrieval_on_ranks(rank: int, world_size: int, shards: tuple[int, ...]) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(5)
    images, texts = torch.randn(sum(shards), 6, generator=generator), torch.randn(sum(shards), 6, generator=generator)
    texts[::2] = images[::2]
    local = _local({"images": images, "texts": texts}, shards, rank)
    return retrieval_accuracy(local["images"], local["texts"], top_k=(1, 3))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mean_of_rank_losses_and_averaged_gradients_equal_single_process(
    pool: Callable[[int], WorkerPool], world_size: int, route: str
) -> None:
    cases = _cases(world_size)
    per_rank = pool(world_size).run(on_route, route, _run_cases, cases, timeout=120)
    for index, (kind, shards, dtype_name, chunk_size, pass_sizes) in enumerate(cases):
        params, data = make_problem(seed=index, total=sum(shards), dtype=torch.float64)
        expected, expected_grads = value_and_grads(reference_loss(kind, params, data), params)
        what = f"{kind} shards={shards} {dtype_name} chunk={chunk_size} sizes={pass_sizes}"
        dtype = getattr(torch, dtype_name)
        mean_loss = sum(result[index][0].double() for result in per_rank) / world_size
        assert_close(mean_loss, expected, dtype, what)
        for name, expected_grad in expected_grads.items():
            # DDP averages: sum over ranks / W.
            averaged = sum(result[index][1][name].double() for result in per_rank) / world_size
            assert_close(averaged, expected_grad, dtype, f"{what} d/d{name}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_retrieval_accuracy_is_global_and_identical_on_every_rank(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    shards = (5, 0, 4)[:world_size] if world_size == 3 else (1, 8)
    per_rank = pool(world_size).run(_retrieval_on_ranks, shards)
    expected = _retrieval_on_ranks(0, 1, (sum(shards),))  # one process, whole batch
    for result in per_rank:
        assert result.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result[name], value), name


def _bad_input_on_rank_one(rank: int, world_size: int) -> dict[str, tuple[str, str] | float]:
    bad = rank == 1
    good, labels = torch.randn(4, 8), torch.tensor([0, 1, 0, 1])
    calls: dict[str, Callable[[], object]] = {
        "info_nce rows": lambda: info_nce(good, good[:3] if bad else good),
        "info_nce one-way ndim": lambda: info_nce(good[0] if bad else good, good[0] if bad else good, symmetric=False),
        "info_nce scale": lambda: info_nce(good, good, -1.0 if bad else 2.0),
        "nt_xent dims": lambda: nt_xent(good, good[:, :5] if bad else good),
        "nt_xent scale": lambda: nt_xent(good, good, torch.ones(2) if bad else None),
        "siglip rows": lambda: siglip(good, good[:3] if bad else good, 2.0, -1.0, chunk_size=2),
        "siglip dtype": lambda: siglip(good, good.double() if bad else good, 2.0, -1.0),
        "supcon labels": lambda: supcon(good, labels[:3] if bad else labels),
        "supcon ndim": lambda: supcon(good[0] if bad else good, labels),
        "retrieval rows": lambda: retrieval_accuracy(good, good[:3] if bad else good),
    }
    outcome: dict[str, tuple[str, str] | float] = {**error_outcomes(calls)}
    outcome["after"] = float(info_nce(good, good))  # the group still works
    return outcome


def test_bad_input_on_one_rank_raises_on_every_rank(pool: Callable[[int], WorkerPool]) -> None:
    # Without the shared raise, rank 1 fails alone and the others wait in the gather: a timeout here.
    per_rank = pool(3).run(_bad_input_on_rank_one, timeout=20, return_exceptions=True)
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        for name, result in outcome.items():
            if name == "after":
                assert math.isfinite(result), rank  # type: ignore[arg-type]
                continue
            kind, message = result  # type: ignore[misc]
            expected_kind = "TypeError" if "dtype" in name else "ValueError"
            assert kind == expected_kind and "(on rank 1;" in message, f"rank {rank} {name}: {kind} {message}"
            assert outcome[name] == per_rank[1][name], f"rank {rank} {name}: not the same error as rank 1"


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(6, 5)
        self.text = nn.Linear(4, 5)
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
        start, stop = sum(shards[:rank]), sum(shards[: rank + 1])
        images, texts, scale = ddp(x_image[start:stop], x_text[start:stop])
        optimizer.zero_grad()
        criterion(images, texts, scale, sizes=shards if step % 2 else None).backward()
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("communication", ["gather", "ring"])
def test_ddp_training_with_uneven_and_empty_shards_matches_single_process(
    pool: Callable[[int], WorkerPool], communication: str
) -> None:
    per_rank = pool(3).run(_train_ddp, communication, timeout=120)
    model, batches = _training_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x_image, x_text in batches:
        optimizer.zero_grad()
        clip_reference(*model(x_image, x_text)).backward()
        optimizer.step()
    moved = False
    for name, param in model.named_parameters():
        for rank, params in enumerate(per_rank):
            torch.testing.assert_close(params[name], param.detach(), rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}")
        moved |= not torch.allclose(param, _training_data()[0].state_dict()[name])
    assert moved
