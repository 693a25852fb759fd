"""grad_cache on real gloo processes: DDP on shards [5, 0, 3], SyncBatchNorm inside, errors on every rank.

With mini-batches of 2, rank 0 encodes 2 + 2 + 1 rows, rank 1 three empty mini-batches, rank 2
2 + 1 + 0: three encodes on every rank, forward and backward.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from grad_cache_models import KINDS, ImageTower, Setting, SyncTower, train
from outcomes import error_outcomes
from test_grad_cache import assert_same_run
from torch import Tensor, nn

from contrastive_dist import convert_sync_batchnorm, grad_cache, info_nce
from contrastive_dist.testing import WorkerPool

SHARDS = (5, 0, 3)
RunResult = tuple[dict[str, Tensor], list[float]]
SETTINGS = [
    Setting(kind, communication, chunk_size=3 if index % 2 else None, pass_sizes=index % 3 == 0)
    for index, (kind, communication) in enumerate(itertools.product(KINDS, ("gather", "ring")))
] + [Setting("clip", sync_bn=True), Setting("ntxent", "ring", sync_bn=True, pass_sizes=True)]


def _runs(rank: int, world_size: int, settings: list[Setting]) -> list[RunResult]:
    results = []
    for setting in settings:
        results.append(train(setting, SHARDS, rank, ddp=True))
    return results


@pytest.mark.timeout(300)
def test_ddp_training_with_dropout_equals_the_memory_hungry_reference_on_every_rank(
    pool: Callable[[int], WorkerPool],
) -> None:
    references = [Setting(**{**setting.__dict__, "strategy": "reference"}) for setting in SETTINGS]
    per_rank = pool(3).run(_runs, SETTINGS + references, timeout=240)
    for rank, results in enumerate(per_rank):
        for index, setting in enumerate(SETTINGS):
            assert_same_run(results[index], results[len(SETTINGS) + index], f"rank {rank} {setting}")
            if rank:  # DDP keeps the replicas identical, running statistics included (the losses are per rank)
                assert_same_run((results[index][0], []), (per_rank[0][index][0], []), f"rank {rank} vs 0 {setting}")
    sync_bn = per_rank[0][SETTINGS.index(Setting("clip", sync_bn=True))][0]
    assert int(sync_bn["image.net.1.num_batches_tracked"]) == 3 * 3  # 3 steps × 3 mini-batch encodes, not 6


def _without_dropout(rank: int, world_size: int) -> list[RunResult]:
    return [train(Setting(kind, communication, dropout=0.0), SHARDS, rank, ddp=True)
            for kind, communication in itertools.product(KINDS, ("gather", "ring"))]


def test_ddp_training_without_dropout_equals_plain_single_process_training(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_without_dropout, timeout=120)
    for index, (kind, communication) in enumerate(itertools.product(KINDS, ("gather", "ring"))):
        single = train(Setting(kind, communication, dropout=0.0, strategy="plain"), (sum(SHARDS),), 0)
        for rank, results in enumerate(per_rank):
            weights, losses = results[index]
            for name, value in single[0].items():
                torch.testing.assert_close(weights[name], value, rtol=1e-10, atol=1e-10,
                                           msg=f"rank {rank} {kind} {communication} {name}")
        mean_losses = [sum(results[index][1][step] for results in per_rank) / 3 for step in range(3)]
        assert mean_losses == pytest.approx(single[1], rel=1e-10)  # the contract: mean of rank losses = global loss


class _Cached(nn.Module):
    """grad_cache inside the forward of the module DDP wraps, as a user writes it."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower

    def forward(self, x: Tensor) -> Tensor:
        return grad_cache(self.tower, x, mini_batch_size=2)


def _hooks_and_encodes(rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    tower = SyncTower(0.1).double()
    calls: list[bool] = []
    tower.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    ddp = nn.parallel.DistributedDataParallel(_Cached(tower))
    buckets: list[int] = []

    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations' objects
        buckets.append(bucket.index())
        work = torch.distributed.all_reduce(bucket.buffer().div_(world_size), async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)
    arrivals = [0] * len(list(tower.parameters()))
    for index, parameter in enumerate(tower.parameters()):
        parameter.register_post_accumulate_grad_hook(lambda _, at=index: arrivals.__setitem__(at, arrivals[at] + 1))
    x = torch.randn(sum(SHARDS), 3, 4, dtype=torch.float64)[sum(SHARDS[:rank]) : sum(SHARDS[: rank + 1])]
    out = ddp(x)
    info_nce(out, out.flip(1)).backward()
    return {"calls": calls, "buckets": buckets, "arrivals": arrivals}


def test_every_rank_encodes_in_step_and_ddp_reduces_each_bucket_once(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_hooks_and_encodes, timeout=60)
    for outcome in per_rank:
        assert outcome["calls"] == [False] * 3 + [True] * 3  # padded: the empty rank too
        assert outcome["buckets"] == [0]  # one all-reduce for the whole step, not one per mini-batch
        assert set(outcome["arrivals"]) == {1}  # type: ignore[arg-type]


def _bad_input_on_one_rank(rank: int, world_size: int) -> dict[str, object]:
    torch.manual_seed(0)
    sync = SyncTower(0.0).double()  # a collective per encode: a rank that skipped one would hang the others
    x = torch.randn(SHARDS[rank], 3, 4, dtype=torch.float64)

    class Doubled(nn.Module):  # 2 rows per input row: rank 1, empty, cannot see it in its own 0 rows
        def forward(self, x: Tensor) -> Tensor:
            return sync(x).repeat(2, 1)

    flat = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12)).double()
    flat_sync = convert_sync_batchnorm(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12)).double())
    calls: dict[str, Callable[[], object]] = {
        "mini_batch_size": lambda: grad_cache(sync, x, mini_batch_size=0 if rank == 2 else 2),
        "leading sizes": lambda: grad_cache(sync, x, x[:1] if rank == 2 else x, mini_batch_size=2),
        "not a tensor": lambda: grad_cache(sync, x.tolist() if rank == 0 else x, mini_batch_size=2),
        "different mini_batch_size": lambda: grad_cache(sync, x, mini_batch_size=2 + rank),
        # One rank would call the module on its empty mini-batches and the others not: refused alike.
        "different synchronized": lambda: grad_cache(nn.Flatten(), x, mini_batch_size=2, synchronized=rank == 0),
        # Its SyncBatchNorm is not a submodule (held by the closure): synchronized=True says it runs collectives.
        "output rows": lambda: grad_cache(Doubled(), x, mini_batch_size=2, synchronized=True),
        # The third global mini-batch holds 1 + 0 + 0 rows: SyncBatchNorm raises on every rank.
        "synchronized BatchNorm": lambda: grad_cache(flat_sync, x, mini_batch_size=2),
        # Only rank 0's third mini-batch holds 1 row: a per-rank BatchNorm raises there alone.
        "per-rank BatchNorm": lambda: grad_cache(flat, x, mini_batch_size=2),
    }
    outcome: dict[str, object] = {**error_outcomes(calls)}

    class FailsOnRankTwo(nn.Module):  # e.g. out of memory on one rank: the others must not wait for it
        def forward(self, x: Tensor) -> Tensor:
            if rank == 2:
                raise RuntimeError("simulated out of memory")
            return x.flatten(1)  # no collective of its own, which a failing rank would leave unmatched

    try:
        grad_cache(FailsOnRankTwo(), x, mini_batch_size=2)
        outcome["runtime error"] = ("no error", "")
    except RuntimeError as error:
        outcome["runtime error"] = (type(error).__name__, str(error).split("\n")[0])
    outcome["after"] = float(grad_cache(ImageTower(0.0).double(), torch.randn(SHARDS[rank], 6, dtype=torch.float64),
                                        mini_batch_size=2).sum())  # the group still works
    return outcome


def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_bad_input_on_one_rank, timeout=30, return_exceptions=True)
    expected = {
        "mini_batch_size": ("ValueError", "mini_batch_size must be a positive int, got 0 (on rank 2;"),
        "leading sizes": ("ValueError", "same leading (batch) size, got shapes [(3, 3, 4), (1, 3, 4)] (on rank 2;"),
        "not a tensor": (
            "TypeError",
            "every input must be a torch.Tensor or a mapping of names to tensors, got list at position 0 (on rank 0;",
        ),
        "different mini_batch_size": ("ValueError", "different options (mini_batch_size)"),
        "different synchronized": ("ValueError", "different options (synchronized)"),
        "output rows": ("ValueError", "(2 rows in this mini-batch), got shapes [(4, 5)] (on rank 0;"),
        "synchronized BatchNorm": ("ValueError", "raised ValueError on a mini-batch of 1 rows: Expected more than 1"),
        "per-rank BatchNorm": ("ValueError", "raised ValueError on a mini-batch of 1 rows: Expected more than 1"),
        "runtime error": ("RuntimeError", "raised RuntimeError on a mini-batch of 2 rows: simulated out of memory "
                          "(on rank 2;"),
    }
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert math.isfinite(outcome.pop("after"))  # type: ignore[arg-type]
        for name, (kind, fragment) in expected.items():
            got_kind, message = outcome[name]  # type: ignore[misc]
            assert got_kind == kind and fragment in message, f"rank {rank} {name}: {got_kind} {message}"
            assert outcome[name] == per_rank[0][name], f"rank {rank} {name}: not the same error as rank 0"
