"""DistributedMemoryQueue: the same FIFO on every rank as in one process, checkpoints, clear errors."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from outcomes import error_outcomes

from contrastive_dist import DistributedMemoryQueue
from contrastive_dist.testing import WorkerPool

SIZE, DIM = 10, 5
# Seven steps of uneven per-rank batches: some ranks empty, one global batch larger than the
# queue (12 > 10), and a short last one.
STEPS: dict[int, list[tuple[int, ...]]] = {
    1: [(6,), (6,), (3,), (0,), (4,), (12,), (1,)],
    2: [(3, 3), (0, 6), (2, 1), (5, 0), (1, 3), (7, 5), (0, 1)],
    3: [(3, 2, 1), (0, 4, 2), (2, 2, 2), (5, 0, 1), (1, 3, 0), (4, 4, 4), (1, 0, 0)],
}


def global_batches(world_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(world_size)
    return [torch.randn(sum(shards), DIM, generator=generator) for shards in STEPS[world_size]]


def reference_queue(batches: list[torch.Tensor], size: int) -> torch.Tensor:
    """One process, a Python list: push every row in order, keep the last ``size``, newest first."""
    pushed: list[torch.Tensor] = []
    for batch in batches:
        pushed.extend(batch)
    kept = pushed[-size:][::-1]
    return torch.stack(kept) if kept else torch.zeros(0, DIM)


def run_steps(rank: int, world_size: int, resume_at: int | None) -> list[torch.Tensor]:
    """Enqueue this rank's share of every step; optionally restart from a saved state at ``resume_at``."""
    queue = DistributedMemoryQueue(SIZE, DIM)
    states = []
    for step, (shards, batch) in enumerate(zip(STEPS[world_size], global_batches(world_size), strict=True)):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save(queue.state_dict(), buffer)
            buffer.seek(0)
            queue = DistributedMemoryQueue(SIZE, DIM)
            queue.load_state_dict(torch.load(buffer))
        start = sum(shards[:rank])
        keys = batch[start : start + shards[rank]].requires_grad_()  # detached by the queue
        queue.enqueue(keys)
        states.append(queue.negatives.keys)
    return states


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_queue_after_uneven_steps_equals_the_single_process_queue_on_every_rank(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    batches = global_batches(world_size)
    for resume_at in (None, 4):
        per_rank = pool(world_size).run(run_steps, resume_at, timeout=60)
        for step in range(len(batches)):
            expected = reference_queue(batches[: step + 1], SIZE)
            for rank, states in enumerate(per_rank):
                assert torch.equal(states[step], expected), f"W={world_size} rank {rank} step {step} resume={resume_at}"
                assert not states[step].requires_grad


def test_single_process_queue_matches_the_list_reference_and_round_trips() -> None:
    generator = torch.Generator().manual_seed(0)
    queue = DistributedMemoryQueue(7, DIM)
    assert len(queue) == 0 and queue.negatives.keys.shape == (0, DIM)
    batches = [torch.randn(count, DIM, generator=generator, dtype=torch.float64) for count in (3, 0, 5, 9, 1, 2)]
    for index, batch in enumerate(batches):
        queue.enqueue(batch)
        expected = reference_queue([b.float() for b in batches[: index + 1]], 7)
        assert torch.equal(queue.negatives.keys, expected)
        assert len(queue) == expected.shape[0]
    snapshot = queue.negatives.keys
    queue.enqueue(torch.randn(2, DIM))
    assert not torch.equal(snapshot, queue.negatives.keys)  # a snapshot, not a view of the buffer
    restored = DistributedMemoryQueue(7, DIM)
    restored.load_state_dict(queue.state_dict())
    assert torch.equal(restored.negatives.keys, queue.negatives.keys)
    assert set(queue.state_dict()) == {"memory", "count"}
    assert "size=7, dim=5, count=7" in repr(queue)


def test_invalid_construction_and_keys_raise() -> None:
    for args, error in (((0, 4), ValueError), ((4, -1), ValueError), ((2.0, 4), TypeError), ((True, 4), TypeError)):
        with pytest.raises(error, match="must be a positive int"):
            DistributedMemoryQueue(*args)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="floating-point"):
        DistributedMemoryQueue(4, 4, dtype=torch.int64)
    queue = DistributedMemoryQueue(4, 4)
    with pytest.raises(ValueError, match=r"shape \(n, 4\).*got \(2, 3\)"):
        queue.enqueue(torch.randn(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        queue.enqueue(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="size mismatch"):
        queue.load_state_dict(DistributedMemoryQueue(5, 4).state_dict())
    with pytest.raises(ValueError, match=r"count must be in \[0, 4\], got 9"):
        queue.load_state_dict({"memory": torch.zeros(4, 4), "count": torch.tensor(9)})


def _mismatch_on_rank_one(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    checks = {
        # Rank 1's queue was built with another dim (and its keys fit it): the gather disagrees.
        "queue dim": lambda: DistributedMemoryQueue(SIZE, 6 if rank == 1 else DIM).enqueue(
            torch.randn(2, 6 if rank == 1 else DIM)
        ),
        # Rank 1 passes keys that do not fit its queue.
        "keys shape": lambda: DistributedMemoryQueue(SIZE, DIM).enqueue(torch.randn(2, DIM + 1 if rank == 1 else DIM)),
    }
    outcome = error_outcomes(checks)
    queue = DistributedMemoryQueue(SIZE, DIM)
    queue.enqueue(torch.randn(rank, DIM))  # the group still works
    outcome["after"] = ("count", str(len(queue)))
    return outcome


def test_dim_mismatch_raises_on_every_rank(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_mismatch_on_rank_one, timeout=20, return_exceptions=True)
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert outcome["after"] == ("count", "3")
        assert outcome["queue dim"][0] == "ValueError" and "do not agree" in outcome["queue dim"][1], outcome
        assert outcome["keys shape"][0] == "ValueError" and "(on rank 1;" in outcome["keys shape"][1], outcome


class _MoCoLike(torch.nn.Module):
    """An encoder with its queue as a submodule, as a user would hold it (DDP broadcasts its buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, DIM)
        self.queue = DistributedMemoryQueue(7, DIM, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.encoder(x), dim=-1)


TRAIN_STEPS = [(2, 1, 0), (0, 3, 2), (1, 1, 1), (4, 0, 1), (1, 0, 0)]


def _training_data() -> tuple[_MoCoLike, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(3)
    model = _MoCoLike().double()
    batches = [(torch.randn(sum(s), 4, dtype=torch.float64), torch.randn(sum(s), 4, dtype=torch.float64))
               for s in TRAIN_STEPS]
    return model, batches


def _train(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from contrastive_dist import info_nce

    model, batches = _training_data()
    steps = TRAIN_STEPS if world_size > 1 else [(sum(shards),) for shards in TRAIN_STEPS]
    trained = torch.nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for shards, (x_query, x_key) in zip(steps, batches, strict=True):
        start, stop = sum(shards[:rank]), sum(shards[: rank + 1])
        queries = trained(x_query[start:stop])
        with torch.no_grad():
            keys = model(x_key[start:stop])  # a key encoder without gradient (MoCo uses a momentum copy)
        optimizer.zero_grad()
        info_nce(queries, keys, 5.0, symmetric=False, negatives=model.queue.negatives, chunk_size=2).backward()
        optimizer.step()
        model.queue.enqueue(keys)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_ddp_training_with_the_queue_matches_one_process(pool: Callable[[int], WorkerPool]) -> None:
    expected = _train(0, 1)
    assert len(expected["queue.memory"]) == 7 and int(expected["queue.count"]) == 7
    for rank, state in enumerate(pool(3).run(_train, timeout=60)):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}")
